//! OpenAI-style JSON error bodies.

use axum::http::StatusCode;
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
