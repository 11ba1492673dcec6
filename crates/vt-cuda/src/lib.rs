//! vt-cuda: the CUDA backend. Not yet implemented: this crate is a compiling placeholder so the
//! workspace layering is in place; see the CUDA backend issue.
