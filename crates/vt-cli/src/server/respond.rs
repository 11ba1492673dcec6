//! Responses for `n` choices, whole or streamed: OpenAI's chat and completion shapes with
//! `reasoning_content`, `tool_calls` (streamed as id and name, then argument text), logprobs, and
//! usage (in the body, or as a last chunk with `stream_options.include_usage`).

use std::convert::Infallible;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{StreamExt, StreamMap};
use vt::TokenLogprobs;

use super::choice::Out;
use super::error::ApiError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// What every chunk or body of one response shares.
#[derive(Clone)]
pub struct Shape {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_tokens: usize,
    pub include_usage: bool,
    /// Logprob tokens as `token_id:N` (vLLM's `return_tokens_as_token_ids`).
    pub token_ids: bool,
    /// Completions `echo`: the prompt's text, put before each choice's text.
    pub echo: Option<String>,
}

impl Shape {
    fn head(&self, chunk: bool) -> Map<String, Value> {
        let object = match (self.kind, chunk) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        };
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(object));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m
    }

    fn usage(&self, completion: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
               "total_tokens": self.prompt_tokens + completion})
    }

    fn token_text(&self, id: u32, text: &str) -> String {
        if self.token_ids {
            format!("token_id:{id}")
        } else {
            text.to_string()
        }
    }
}

/// One logprob entry in chat's form.
fn chat_logprob(shape: &Shape, id: u32, token: &str, lp: &TokenLogprobs, top: &[String]) -> Value {
    let entry = |id: u32, text: &str, logprob: f32| {
        let t = shape.token_text(id, text);
        json!({"token": t, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let mut e = entry(id, token, lp.logprob);
    e["top_logprobs"] = lp.top.iter().zip(top).map(|(&(i, l), t)| entry(i, t, l)).collect();
    e
}

/// The logprobs of some tokens in completions' form (`text_offset` from `offset`).
fn completion_logprobs(
    shape: &Shape,
    entries: &[(u32, String, TokenLogprobs, Vec<String>)],
    mut offset: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for (id, text, lp, top) in entries {
        tokens.push(json!(shape.token_text(*id, text)));
        lps.push(json!(lp.logprob));
        let mut m = Map::new();
        for (&(i, l), t) in lp.top.iter().zip(top) {
            m.insert(shape.token_text(i, t), json!(l));
        }
        tops.push(Value::Object(m));
        offsets.push(json!(offset));
        offset += text.len();
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

fn internal(message: String) -> Response {
    ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", message }.into_response()
}

/// The response for the choices' outputs (`choices[i]` is choice i).
pub async fn respond(choices: Vec<UnboundedReceiver<Out>>, stream: bool, shape: Shape) -> Response {
    if stream {
        return stream_response(choices, shape);
    }
    let mut bodies = Vec::new();
    let mut completion = 0;
    for (index, mut rx) in choices.into_iter().enumerate() {
        let mut acc = Accumulated::default();
        let mut done = false;
        while let Some(out) = rx.recv().await {
            match out {
                Out::Error(m) => return internal(m),
                Out::Done { finish, completion_tokens } => {
                    acc.finish = finish;
                    completion += completion_tokens;
                    done = true;
                    break;
                }
                other => acc.add(other),
            }
        }
        if !done {
            return internal("the engine stopped".into());
        }
        bodies.push(acc.body(&shape, index));
    }
    let mut body = shape.head(false);
    body.insert("choices".into(), Value::Array(bodies));
    body.insert("usage".into(), shape.usage(completion));
    Json(Value::Object(body)).into_response()
}

#[derive(Default)]
struct Accumulated {
    content: String,
    reasoning: String,
    calls: Vec<Value>,
    logprobs: Vec<(u32, String, TokenLogprobs, Vec<String>)>,
    finish: &'static str,
}

impl Accumulated {
    fn add(&mut self, out: Out) {
        match out {
            Out::Content(t) => self.content.push_str(&t),
            Out::Reasoning(t) => self.reasoning.push_str(&t),
            Out::ToolCall { call, .. } => self.calls.push(json!({"id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}})),
            Out::Logprobs { id, token, lp, top } => self.logprobs.push((id, token, lp, top)),
            Out::Done { .. } | Out::Error(_) => {}
        }
    }

    fn body(self, shape: &Shape, index: usize) -> Value {
        let want_lp = !self.logprobs.is_empty();
        match shape.kind {
            Kind::Chat => {
                let content = if self.content.is_empty() && !(self.calls.is_empty() && self.reasoning.is_empty()) {
                    Value::Null
                } else {
                    json!(self.content)
                };
                let mut message = json!({"role": "assistant", "content": content});
                if !self.reasoning.is_empty() {
                    message["reasoning_content"] = json!(self.reasoning);
                }
                if !self.calls.is_empty() {
                    message["tool_calls"] = Value::Array(self.calls);
                }
                let logprobs = if want_lp {
                    let entries: Vec<Value> =
                        self.logprobs.iter().map(|(id, t, lp, top)| chat_logprob(shape, *id, t, lp, top)).collect();
                    json!({"content": entries})
                } else {
                    Value::Null
                };
                json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": self.finish})
            }
            Kind::Completion => {
                let echo = shape.echo.clone().unwrap_or_default();
                let logprobs =
                    if want_lp { completion_logprobs(shape, &self.logprobs, echo.len()) } else { Value::Null };
                json!({"index": index, "text": echo + &self.content, "logprobs": logprobs, "finish_reason": self.finish})
            }
        }
    }
}

/// A chunk: the head around `choice` (with `"usage": null` when usage comes last).
fn chunk(shape: &Shape, choice: Value) -> Value {
    let mut m = shape.head(true);
    m.insert("choices".into(), json!([choice]));
    if shape.include_usage {
        m.insert("usage".into(), Value::Null);
    }
    Value::Object(m)
}

/// The chunks one piece of choice `i` makes; `offset`: the choice's text so far (completions).
fn piece_chunks(shape: &Shape, i: usize, out: Out, offset: &mut usize) -> Vec<Value> {
    let chat =
        |delta: Value| chunk(shape, json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": null}));
    let text = |t: &str| chunk(shape, json!({"index": i, "text": t, "logprobs": null, "finish_reason": null}));
    match (shape.kind, out) {
        (_, Out::Error(m)) => {
            vec![json!({"error": {"message": m, "type": "server_error", "param": null, "code": null}})]
        }
        (Kind::Chat, Out::Reasoning(t)) => vec![chat(json!({"reasoning_content": t}))],
        (Kind::Chat, Out::Content(t)) => vec![chat(json!({"content": t}))],
        (Kind::Chat, Out::ToolCall { index, call }) => vec![
            chat(json!({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}]})),
            chat(json!({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})),
        ],
        (Kind::Chat, Out::Logprobs { id, token, lp, top }) => {
            let mut c = chat(json!({}));
            c["choices"][0]["logprobs"] = json!({"content": [chat_logprob(shape, id, &token, &lp, &top)]});
            vec![c]
        }
        (Kind::Chat, Out::Done { finish, .. }) => {
            let mut c = chat(json!({}));
            c["choices"][0]["finish_reason"] = json!(finish);
            vec![c]
        }
        (Kind::Completion, Out::Content(t) | Out::Reasoning(t)) => {
            *offset += t.len();
            vec![text(&t)]
        }
        (Kind::Completion, Out::ToolCall { .. }) => vec![],
        (Kind::Completion, Out::Logprobs { id, token, lp, top }) => {
            let mut c = text("");
            c["choices"][0]["logprobs"] = completion_logprobs(shape, &[(id, token, lp, top)], *offset);
            vec![c]
        }
        (Kind::Completion, Out::Done { finish, .. }) => {
            let mut c = text("");
            c["choices"][0]["finish_reason"] = json!(finish);
            vec![c]
        }
    }
}

/// Server-sent events: each choice's chunks as they come, interleaved, then the usage chunk (if
/// asked for) and `[DONE]`. A client that goes away drops the choices, which cancels them.
fn stream_response(choices: Vec<UnboundedReceiver<Out>>, shape: Shape) -> Response {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
    tokio::spawn(async move {
        let n = choices.len();
        let mut map = StreamMap::new();
        for (i, rx) in choices.into_iter().enumerate() {
            map.insert(i, UnboundedReceiverStream::new(rx));
        }
        // Each choice's first chunk: the role (chat) or the echoed prompt (completions).
        for i in 0..n {
            let first = match (&shape.kind, &shape.echo) {
                (Kind::Chat, _) => Some(chunk(
                    &shape,
                    json!({"index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null}),
                )),
                (Kind::Completion, Some(e)) => {
                    Some(chunk(&shape, json!({"index": i, "text": e, "logprobs": null, "finish_reason": null})))
                }
                (Kind::Completion, None) => None,
            };
            if first.is_some_and(|c| tx.send(c).is_err()) {
                return;
            }
        }
        let mut offsets = vec![shape.echo.as_ref().map_or(0, String::len); n];
        let mut completion = 0;
        while let Some((i, out)) = map.next().await {
            let done = matches!(out, Out::Done { .. } | Out::Error(_));
            if let Out::Done { completion_tokens, .. } = &out {
                completion += completion_tokens;
            }
            for c in piece_chunks(&shape, i, out, &mut offsets[i]) {
                if tx.send(c).is_err() {
                    return;
                }
            }
            if done {
                map.remove(&i);
            }
        }
        if shape.include_usage {
            let mut last = shape.head(true);
            last.insert("choices".into(), json!([]));
            last.insert("usage".into(), shape.usage(completion));
            let _ = tx.send(Value::Object(last));
        }
    });
    let events = UnboundedReceiverStream::new(rx)
        .map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
        .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
    Sse::new(events).into_response()
}
