//! An OpenAI-compatible HTTP server over an `EngineHandle`: `/v1/completions`,
//! `/v1/chat/completions` (streaming SSE or not), `/v1/models`, `/health`.
//!
//! Concurrent requests are batched by the engine. Bad requests get OpenAI-style error bodies
//! (400/404); a full queue gets 429; a client that goes away cancels its request.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;
use vt::{
    ChatMessage, Detokenizer, EngineHandle, Event, Finish, Request, SamplingParams, StopStrings, SubmitError, Tokenizer,
};

/// What the handlers share.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Option<Tokenizer>,
    /// The name `/v1/models` reports and requests may give as `model`.
    pub model_id: String,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(engine: EngineHandle, tokenizer: Option<Tokenizer>, model_id: String) -> Self {
        AppState { engine, tokenizer, model_id, next_id: AtomicU64::new(1) }
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

/// An OpenAI-style error response.
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": null}});
        (self.status, Json(body)).into_response()
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        let (status, kind) = match e {
            SubmitError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            SubmitError::QueueFull => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            SubmitError::Closed => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
        };
        ApiError { status, kind, message: e.to_string() }
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": s.model_id, "object": "model", "created": 0, "owned_by": "vt"}]}))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(OneOrMany<String>),
    Ids(Vec<u32>),
}

/// The fields both endpoints share.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<OneOrMany<String>>,
    #[serde(default)]
    stream: bool,
    n: Option<usize>,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessage>,
    #[serde(flatten)]
    common: Common,
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("invalid request body: {e}")))
}

/// A request checked and turned into engine terms.
struct Prepared {
    req: Request,
    stops: Vec<String>,
    stream: bool,
}

fn prepare(s: &AppState, c: Common, prompt: Vec<u32>, default_max: usize) -> Result<Prepared, ApiError> {
    if let Some(m) = c.model.as_deref().filter(|m| *m != s.model_id) {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("the model `{m}` does not exist; this server serves `{}`", s.model_id),
        });
    }
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only n = 1 is supported"));
    }
    let stops = match c.stop {
        None => vec![],
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) if v.len() <= 4 => v,
        Some(OneOrMany::Many(_)) => return Err(ApiError::bad("stop takes at most 4 strings")),
    };
    let d = SamplingParams::default();
    // Without a seed, each request draws its own.
    let seed = c.seed.unwrap_or_else(|| s.next_id.fetch_add(1, Ordering::Relaxed) ^ (now() * 0x9e37_79b9));
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_k: c.top_k.unwrap_or(d.top_k),
        top_p: c.top_p.unwrap_or(d.top_p),
        min_p: c.min_p.unwrap_or(d.min_p),
        repetition_penalty: c.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: c.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: c.frequency_penalty.unwrap_or(d.frequency_penalty),
        seed,
    };
    let stop_token_ids = s
        .tokenizer
        .as_ref()
        .and_then(Tokenizer::eos_id)
        .into_iter()
        .chain(s.engine.spec().eos_token_ids.iter().copied())
        .collect();
    let max_tokens = c.max_completion_tokens.or(c.max_tokens).unwrap_or(default_max);
    Ok(Prepared { req: Request { prompt, max_tokens, sampling, stop_token_ids }, stops, stream: c.stream })
}

fn tokenizer(s: &AppState) -> Result<&Tokenizer, ApiError> {
    s.tokenizer.as_ref().ok_or_else(|| ApiError::bad("this model has no tokenizer.json; send prompts as token ids"))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// What a running request produces for the response.
enum Piece {
    Text(String),
    Done { finish: &'static str, completion_tokens: usize },
    Error(String),
}

/// Submits `p` and turns its engine events into text pieces on a channel. Dropping the
/// receiver cancels the request.
fn start(s: &Arc<AppState>, p: Prepared) -> Result<mpsc::UnboundedReceiver<Piece>, ApiError> {
    let (tx, mut events) = mpsc::unbounded_channel::<Event>();
    let cancel = s.engine.submit(p.req, Box::new(move |e| tx.send(e).is_ok()))?;
    let (out, pieces) = mpsc::unbounded_channel();
    let state = s.clone();
    tokio::spawn(async move {
        let mut detok = Detokenizer::new();
        let mut stops = StopStrings::new(p.stops);
        let mut n = 0;
        let text = |ids: &mut Detokenizer, id: Option<u32>| match (&state.tokenizer, id) {
            (Some(t), Some(id)) => ids.push(t, id).unwrap_or_default(),
            (Some(t), None) => ids.finish(t).unwrap_or_default(),
            (None, _) => String::new(),
        };
        while let Some(e) = events.recv().await {
            let (piece, done) = match e {
                Event::Token(id) => {
                    n += 1;
                    let (t, stopped) = stops.push(&text(&mut detok, Some(id)));
                    if stopped {
                        cancel.cancel();
                        let _ = out.send(Piece::Text(t));
                        (Piece::Done { finish: "stop", completion_tokens: n }, true)
                    } else {
                        (Piece::Text(t), false)
                    }
                }
                Event::Done(f) => {
                    let (t, stopped) = stops.push(&text(&mut detok, None));
                    let rest = if stopped { t } else { t + &stops.finish() };
                    let _ = out.send(Piece::Text(rest));
                    let finish = if f == Finish::Length && !stopped { "length" } else { "stop" };
                    (Piece::Done { finish, completion_tokens: n }, true)
                }
                Event::Failed(m) => (Piece::Error(m), true),
            };
            if out.send(piece).is_err() {
                cancel.cancel();
                return;
            }
            if done {
                return;
            }
        }
    });
    Ok(pieces)
}

/// The response for `pieces`: one JSON body, or SSE chunks built by `chunk` then `[DONE]`.
async fn respond(
    mut pieces: mpsc::UnboundedReceiver<Piece>,
    stream: bool,
    mut chunk: impl FnMut(&Piece) -> Option<Value> + Send + 'static,
    full: impl FnOnce(String, &'static str, usize) -> Value,
) -> Response {
    if stream {
        let events = UnboundedReceiverStream::new(pieces)
            .filter_map(move |p| match &p {
                Piece::Error(m) => {
                    Some(json!({"error": {"message": m, "type": "server_error", "param": null, "code": null}}))
                }
                _ => chunk(&p),
            })
            .map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
            .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
        return Sse::new(events).into_response();
    }
    let mut text = String::new();
    while let Some(p) = pieces.recv().await {
        match p {
            Piece::Text(t) => text.push_str(&t),
            Piece::Done { finish, completion_tokens } => {
                return Json(full(text, finish, completion_tokens)).into_response()
            }
            Piece::Error(m) => {
                return ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", message: m }
                    .into_response()
            }
        }
    }
    ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", message: "the engine stopped".into() }
        .into_response()
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let body: CompletionBody = parse(&body)?;
    let prompt = match body.prompt {
        Prompt::Ids(ids) => ids,
        Prompt::Text(OneOrMany::One(t)) => tokenizer(&s)?.encode(&t, true).map_err(|e| ApiError::bad(e.to_string()))?,
        Prompt::Text(OneOrMany::Many(v)) if v.len() == 1 => {
            tokenizer(&s)?.encode(&v[0], true).map_err(|e| ApiError::bad(e.to_string()))?
        }
        Prompt::Text(OneOrMany::Many(_)) => return Err(ApiError::bad("only one prompt per request is supported")),
    };
    let prompt_len = prompt.len();
    // OpenAI's default for completions.
    let p = prepare(&s, body.common, prompt, 16)?;
    let stream = p.stream;
    let pieces = start(&s, p)?;
    let (id, created, model) =
        (format!("cmpl-{}", s.next_id.fetch_add(1, Ordering::Relaxed)), now(), s.model_id.clone());
    let head = json!({"id": id, "object": "text_completion", "created": created, "model": model});
    let chunk_head = head.clone();
    let chunk = move |p: &Piece| {
        let choice = match p {
            Piece::Text(t) if t.is_empty() => return None,
            Piece::Text(t) => json!({"index": 0, "text": t, "logprobs": null, "finish_reason": null}),
            Piece::Done { finish, .. } => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish}),
            Piece::Error(_) => return None,
        };
        Some(with(&chunk_head, "choices", json!([choice])))
    };
    let full = move |text: String, finish, n| {
        let v = with(&head, "choices", json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]));
        with(&v, "usage", usage(prompt_len, n))
    };
    Ok(respond(pieces, stream, chunk, full).await)
}

async fn chat_completions(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let body: ChatBody = parse(&body)?;
    if body.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty"));
    }
    let tok = tokenizer(&s)?;
    let text = tok.apply_chat_template(&body.messages, true).map_err(|e| ApiError::bad(e.to_string()))?;
    // The template already holds any BOS the model wants.
    let prompt = tok.encode(&text, false).map_err(|e| ApiError::bad(e.to_string()))?;
    let prompt_len = prompt.len();
    let p = prepare(&s, body.common, prompt, usize::MAX)?;
    let stream = p.stream;
    let pieces = start(&s, p)?;
    let (id, created, model) =
        (format!("chatcmpl-{}", s.next_id.fetch_add(1, Ordering::Relaxed)), now(), s.model_id.clone());
    let head = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
    let mut first = true;
    let chunk_head = head.clone();
    let chunk = move |p: &Piece| {
        let choice = match p {
            Piece::Text(t) if t.is_empty() && !first => return None,
            Piece::Text(t) => {
                // The first chunk names the role, as OpenAI's does.
                let delta = if std::mem::take(&mut first) {
                    json!({"role": "assistant", "content": t})
                } else {
                    json!({"content": t})
                };
                json!({"index": 0, "delta": delta, "finish_reason": null})
            }
            Piece::Done { finish, .. } => json!({"index": 0, "delta": {}, "finish_reason": finish}),
            Piece::Error(_) => return None,
        };
        Some(with(&chunk_head, "choices", json!([choice])))
    };
    let full = move |text: String, finish, n| {
        let v = with(&head, "object", json!("chat.completion"));
        let v = with(
            &v,
            "choices",
            json!([{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]),
        );
        with(&v, "usage", usage(prompt_len, n))
    };
    Ok(respond(pieces, stream, chunk, full).await)
}

/// `base` with `key` set to `value`.
fn with(base: &Value, key: &str, value: Value) -> Value {
    let mut v = base.clone();
    v[key] = value;
    v
}
