//! Running a prepared request: engine events to text pieces, then to one JSON body or SSE chunks.

use std::convert::Infallible;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;
use vt::{Detokenizer, Event, Finish, StopStrings};

use super::error::ApiError;
use super::request::Prepared;
use super::AppState;

/// What a running request produces for the response.
pub enum Piece {
    Text(String),
    Done { finish: &'static str, completion_tokens: usize },
    Error(String),
}

/// Submits `p` and turns its engine events into text pieces on a channel. Dropping the
/// receiver cancels the request.
pub fn start(s: &Arc<AppState>, p: Prepared) -> Result<mpsc::UnboundedReceiver<Piece>, ApiError> {
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
pub async fn respond(
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
