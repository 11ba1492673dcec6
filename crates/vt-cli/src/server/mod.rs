//! An OpenAI-compatible HTTP server over an `EngineHandle`: `/v1/completions`,
//! `/v1/chat/completions` (streaming SSE or not), `/v1/models[/{id}]`, `/health`, `/metrics`.
//!
//! Concurrent requests are batched by the engine. Every error is an OpenAI-style JSON body; a full
//! queue gets 429 with `Retry-After`; a client that goes away cancels its request. The transport
//! bounds connections and header/body read times and drains on shutdown (transport.rs); an API
//! key and CORS origins are opt-in (auth.rs).

mod agent;
mod auth;
mod choice;
mod error;
#[cfg(test)]
mod fuzz;
mod handlers;
mod limits;
mod metrics;
mod request;
mod respond;
mod transport;

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::DefaultBodyLimit;
use axum::middleware::from_fn_with_state;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use vt::{EngineHandle, SamplingParams, Tokenizer};

pub use agent::AgentConfig;
pub use limits::BodyLimits;
pub use metrics::Metrics;
pub use transport::{shutdown_signal, Transport};

use handlers::{chat_completions, completions, model, models};

/// What the handlers share.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Option<Tokenizer>,
    /// The name `/v1/models` reports and requests may give as `model`.
    pub model_id: String,
    /// Tool-call format, reasoning, special tokens in messages, constrained decoding.
    pub agent: AgentConfig,
    /// What a request leaves unset samples with (OpenAI's temperature 1, or the checkpoint's
    /// generation_config.json).
    pub sampling: SamplingParams,
    /// `max_tokens` of a chat request that sets none.
    pub chat_max_tokens: usize,
    pub metrics: Metrics,
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
        AppState {
            engine,
            tokenizer,
            model_id,
            agent,
            sampling: SamplingParams { temperature: 1.0, ..SamplingParams::default() },
            chat_max_tokens: 1024,
            metrics: Metrics::default(),
            next_id: AtomicU64::new(1),
        }
    }
}

/// Everything about serving that is not the model.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub transport: Transport,
    pub body: BodyLimits,
    /// Requests to `/v1/*` and `/metrics` need `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Origins browsers may call from (CORS); `*` for any. None by default.
    pub allowed_origins: Vec<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            transport: Transport::default(),
            body: BodyLimits { max_bytes: 16 << 20, timeout: Duration::from_secs(30) },
            api_key: None,
            allowed_origins: Vec::new(),
        }
    }
}

pub fn router(state: Arc<AppState>, config: &ServerConfig) -> Result<Router, String> {
    let mut api = Router::new()
        .route("/metrics", get(metrics::render))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(from_fn_with_state(config.body, limits::read_body));
    if let Some(key) = &config.api_key {
        // Outside the body reader: a caller without the key sends no body for nothing.
        api = api.route_layer(from_fn_with_state(Arc::<str>::from(key.as_str()), auth::require_key));
    }
    let app = Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .merge(api)
        .fallback(error::no_route)
        .method_not_allowed_fallback(error::wrong_method)
        // limits::read_body bounds the body; the extractors need no limit of their own.
        .layer(DefaultBodyLimit::disable())
        .layer(from_fn_with_state(state.clone(), metrics::access_log))
        .with_state(state);
    Ok(match auth::cors(&config.allowed_origins)? {
        Some(cors) => app.layer(cors),
        None => app,
    })
}

/// Serves until `shutdown` resolves, then drains in-flight requests (default settings).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, state, &ServerConfig::default(), shutdown).await
}

pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    config: &ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(state, config).map_err(std::io::Error::other)?;
    transport::serve(listener, app, &config.transport, shutdown).await
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
