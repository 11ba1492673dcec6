//! Request bodies read whole, within a size limit and a deadline for the whole body (a client
//! trickling bytes cannot hold a connection and a handler open), before any handler runs.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    pub max_bytes: usize,
    pub timeout: Duration,
}

pub async fn read_body(State(l): State<BodyLimits>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(l.timeout, axum::body::to_bytes(body, l.max_bytes)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            // to_bytes fails on the size limit or on a broken connection.
            let too_large = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            let (status, message) = if too_large {
                (StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than {} bytes", l.max_bytes))
            } else {
                (StatusCode::BAD_REQUEST, format!("reading the request body: {e}"))
            };
            return ApiError { status, kind: "invalid_request_error", message }.into_response();
        }
        Err(_) => {
            let message = format!("the request body did not arrive within {:?}", l.timeout);
            return ApiError { status: StatusCode::REQUEST_TIMEOUT, kind: "invalid_request_error", message }
                .into_response();
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}
