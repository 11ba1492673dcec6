//! vt-models: the decoder graphs of Qwen3.5-MoE, Laguna and Qwen3-MoE, generic over the Backend.
//! Model code never names a device; it calls Backend methods.

mod loader;
mod model;
mod quant;
mod rope;
pub mod spec;
pub mod split;

/// Reading single weights of a checkpoint (tools and tests; `Model::load` reads them all).
pub use loader::{DummyNvfp4, DummyWeights, Loader};
pub use model::{
    decode_first, Comms, Draft, DraftInput, Logits, Model, PoolConfig, PoolShape, PoolStats, SeqState, StatePool,
    StepOutput, StepSeq, BATCH_ROWS,
};
pub use spec::{Family, ModelSpec};
