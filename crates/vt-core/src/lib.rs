//! vt-core: dtypes, errors, the `Backend` trait, `ResidentSlot<B>`, typed weights and checkpoint
//! reading. Backends and model graphs build on this crate; it names neither a device nor a model.

pub mod alloc;
pub mod backend;
pub mod blocks;
pub mod checkpoint;
pub mod comm;
pub mod dtype;
pub mod error;
#[cfg(feature = "mutation-address-keyed-cache")]
mod mutation;
pub mod quant;
pub mod random;
pub mod resident;
pub mod tensor;
pub mod weights;

pub use backend::{
    argmax, AttentionParams, Backend, Device, FusedOps, GateAct, GdnDims, GdnInputs, GdnMode, GdnState, GdnStep,
    KvLayout, KvOps, KvSeq, MemoryStats, NormKind, Ops, ReplayInputs, ReplayStates, Rope, SharedExpert, StepRecording,
    TokenLogprobs, RELEASED,
};
pub use comm::{Communicator, HostComm};
pub use dtype::DType;
pub use error::{Error, Result};
pub use quant::{Fp8Block, Nvfp4, Quantized, NVFP4_GROUP};
pub use resident::ResidentSlot;
pub use tensor::Tensor;
pub use weights::{Expert, Linear, MoeExperts, Router, RouterKind, Weight};
