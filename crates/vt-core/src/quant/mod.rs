//! Quantized weight formats. Each format is one module here (its in-memory form and what makes
//! one well formed), one in vt-models (checkpoint decoding), one in vt-cpu and one in vt-cuda (its
//! `y = x Wᵀ`). `Weight` (weights.rs) lists the formats; `Weight::quantized` is where a new one is
//! registered in this crate.

mod fp8;
mod nvfp4;

pub use fp8::Fp8Block;
pub use nvfp4::{Nvfp4, NVFP4_GROUP};

use crate::backend::Device;
use crate::tensor::Tensor;
use crate::Result;

/// What the format-independent code (shapes, byte accounting, resident slots, load-time checks)
/// needs to know of a quantized matrix `[n, k]`.
pub trait Quantized<B: Device> {
    /// `(n, k)`: outputs, inputs.
    fn dims(&self) -> (usize, usize);
    /// The tensor holding the values (codes): what a resident slot is keyed to.
    fn values(&self) -> &Tensor<B>;
    /// Bytes resident for the weight: values, scales and any per-tensor constants.
    fn resident_bytes(&self) -> usize;
    /// Checks that the parts agree with each other, so kernels that read them as the shapes say
    /// stay inside them; `name` is for the error.
    fn validate(&self, name: &str) -> Result<()>;
}

/// Bytes of a tensor's storage.
pub(crate) fn bytes<B: Device>(t: &Tensor<B>) -> usize {
    t.dtype().bytes_for(t.numel()).unwrap_or(0)
}
