//! vt: serve sparse mixture-of-experts language models (Qwen3.5/3.6-MoE, Laguna, Qwen3-MoE) from
//! Hugging Face checkpoints. Pick a backend with a cargo feature: `cpu` (default), `cuda` or `wgpu`.
//!
//! ```no_run
//! # fn main() -> vt::Result<()> {
//! let backend = vt::CpuBackend::new();
//! let model = vt::Model::load(&backend, std::path::Path::new("path/to/checkpoint"))?;
//! let out = vt::generate(&model, &[1, 2, 3], &vt::GenerateOptions { max_new_tokens: 8, ..Default::default() })?;
//! println!("{:?}", out.token_ids);
//! # Ok(()) }
//! ```
//!
//! Many sequences at once: [`Engine`] (stepped by the caller) or [`EngineHandle`] (its own thread).

pub mod chat;
pub mod engine;
mod generate;
pub mod grammar;
mod prefix_cache;
pub mod prefix_index;
pub mod reasoning;
pub mod sampling;
pub mod speculative;
pub mod text;
pub mod tool_parser;

pub use chat::ChatInput;
pub use engine::{CancelToken, Engine, EngineConfig, EngineHandle, Event, Finish, Request, Sink, SubmitError};
pub use generate::{generate, generate_speculative, generate_with, GenerateOptions, Generation};
pub use sampling::{Sampler, SamplingParams, TokenLogprobs, Verdict};
pub use speculative::{Draft, Drafter, DrafterKind, MtpDrafter, NgramDrafter, Observation, Proposal, SeqId};
pub use text::{ChatMessage, ChatPrompt, Detokenizer, StopStrings, Tokenizer};
pub use vt_core::{checkpoint, Backend, Communicator, DType, Error, HostComm, MemoryStats, Result};
pub use vt_models::{Comms, DummyNvfp4, DummyWeights, Family, Logits, Model, ModelSpec, SeqState};

#[cfg(feature = "cpu")]
pub use vt_cpu::{AllocMode, CpuBackend};
#[cfg(feature = "cuda")]
pub use vt_cuda::{AllocMode as CudaAllocMode, CudaBackend, NcclComm};
#[cfg(feature = "wgpu")]
pub use vt_wgpu::{AllocMode as WgpuAllocMode, WgpuBackend};

/// The checkpoint's context limit (`max_position_embeddings`), if its config states one.
pub fn context_limit(dir: &std::path::Path) -> Result<Option<usize>> {
    let cfg = checkpoint::Config::from_file(&dir.join("config.json"))?;
    let field = "max_position_embeddings";
    match cfg.opt_usize(field)? {
        // A context of one token has no room for a prompt and a generated token.
        Some(n) if n < 2 => Err(cfg.error(field, format!("{n} leaves no room for a prompt and a generated token"))),
        n => Ok(n),
    }
}
