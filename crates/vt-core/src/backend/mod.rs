//! The Backend trait, in layers a backend implements one by one:
//!
//! - `Device` (device.rs): identity, memory, transfers in and out; all `Tensor<B>` needs.
//! - `Ops` (ops.rs): the primitive ops a model graph is made of.
//! - `KvOps` (kv.rs): attention's key/value block pool and the attention that reads and writes it
//!   through a sequence's block table.
//! - `FusedOps` (fused.rs): composite steps a backend may fuse; every one has a composed default
//!   (composed.rs), so a new backend may implement none of them.
//! - `StepRecording` (record.rs): capturing a decode step to replay it; optional, defaults record
//!   nothing.
//!
//! `Backend` is their sum: generic code asks for `B: Backend` and calls any layer's methods.
//! The arguments every method must check are checked by one function each in check.rs, which a
//! backend calls first; it then checks only its own limits.
//! Activations are contiguous row-major tensors of `activation_dtype()` (f32 on the CPU
//! reference); vt-cpu's ops are the reference. Every op checks its shapes and returns an `Error`
//! naming the mismatch, never panics.

pub mod check;
pub mod composed;
mod device;
mod fused;
mod kv;
mod ops;
mod record;
pub mod sample;

pub use composed::{
    argmax, check_finite, mask_words, non_finite_row, stack_rows, token_logprobs, Pick, Sampled, TokenLogprobs,
};
pub use device::{Device, MemoryStats};
pub use fused::{FusedOps, GdnState, GdnStep, SharedExpert};
pub use kv::{AttentionParams, KvLayout, KvOps, KvSeq, RELEASED};
pub use ops::{GateAct, GdnDims, GdnInputs, GdnMode, NormKind, Ops, Rope};
pub use record::{ReplayInputs, ReplayStates, StepRecording};
pub use sample::{LogitAdjust, SampleRow};

/// Every layer: what the model graphs and the engine ask of a backend.
pub trait Backend: Device + Ops + KvOps + FusedOps + StepRecording {}

impl<B: Device + Ops + KvOps + FusedOps + StepRecording> Backend for B {}

/// The layer traits, for code that calls a concrete backend's methods (`use
/// vt_core::backend::prelude::*`); generic `B: Backend` code needs only `Backend`.
pub mod prelude {
    pub use super::{Backend, Device, FusedOps, KvOps, Ops, StepRecording};
}
