//! The endpoints' handlers: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use serde_json::{json, Value};
use vt::Tokenizer;

use super::error::ApiError;
use super::request::{parse, prepare, ChatBody, CompletionBody, OneOrMany, Prompt};
use super::stream::{respond, start, Piece};
use super::{now, AppState};

pub async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": s.model_id, "object": "model", "created": 0, "owned_by": "vt"}]}))
}

fn tokenizer(s: &AppState) -> Result<&Tokenizer, ApiError> {
    s.tokenizer.as_ref().ok_or_else(|| ApiError::bad("this model has no tokenizer.json; send prompts as token ids"))
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

pub async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
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

pub async fn chat_completions(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
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
