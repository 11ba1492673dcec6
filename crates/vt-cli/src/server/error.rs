//! OpenAI-style JSON error bodies.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use vt::SubmitError;

/// An OpenAI-style error response.
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", message: message.into() }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", message: message.into() }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, kind: "invalid_request_error", message: message.into() }
    }
}

/// The router's fallback: an unknown path.
pub async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no route for `{}`", uri.path()))
}

/// The router's fallback for a known path asked with another method.
pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    let message = format!("`{}` does not take {method}", uri.path());
    ApiError { status: StatusCode::METHOD_NOT_ALLOWED, kind: "invalid_request_error", message }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": null}});
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // The queue moves at the engine's step rate: a second is a fair wait.
            r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
        }
        r
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
