//! An OpenAI-compatible HTTP server over an `EngineHandle`: `/v1/completions`,
//! `/v1/chat/completions` (streaming SSE or not), `/v1/models`, `/health`.
//!
//! Concurrent requests are batched by the engine. Bad requests get OpenAI-style error bodies
//! (400/404); a full queue gets 429; a client that goes away cancels its request.

mod agent;
mod choice;
mod error;
mod handlers;
mod request;
mod respond;

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use vt::{EngineHandle, Tokenizer};

pub use agent::AgentConfig;

use handlers::{chat_completions, completions, models};

/// What the handlers share.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Option<Tokenizer>,
    /// The name `/v1/models` reports and requests may give as `model`.
    pub model_id: String,
    /// Tool-call format, reasoning, special tokens in messages, constrained decoding.
    pub agent: AgentConfig,
    next_id: AtomicU64,
}

impl AppState {
    /// With the model's own agent settings (`AgentConfig::for_model`).
    pub fn new(engine: EngineHandle, tokenizer: Option<Tokenizer>, model_id: String) -> Self {
        let spec = engine.spec();
        let stop: Vec<u32> = tokenizer
            .as_ref()
            .and_then(Tokenizer::eos_id)
            .into_iter()
            .chain(spec.eos_token_ids.iter().copied())
            .collect();
        let agent = AgentConfig::for_model(tokenizer.as_ref(), spec.family, &stop, spec.vocab);
        AppState { engine, tokenizer, model_id, agent, next_id: AtomicU64::new(1) }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then lets in-flight requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
