//! Who may call the API: a bearer key (`--api-key`) and the browser origins allowed by CORS
//! (`--allowed-origins`; none by default, so browsers refuse cross-origin calls).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use tower_http::cors::{AllowOrigin, CorsLayer};

use super::error::ApiError;

/// Refuses requests without `Authorization: Bearer <key>`; the key compares in constant time.
pub async fn require_key(State(key): State<Arc<str>>, req: Request, next: Next) -> Response {
    let given = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| bool::from(g.trim().as_bytes().ct_eq(key.as_bytes()))) {
        return next.run(req).await;
    }
    let mut r = ApiError {
        status: StatusCode::UNAUTHORIZED,
        kind: "authentication_error",
        message: "a valid API key is required: `Authorization: Bearer <key>`".into(),
    }
    .into_response();
    r.headers_mut().insert("www-authenticate", HeaderValue::from_static("Bearer"));
    r
}

/// A CORS policy allowing `origins` (`*` for any), or `None` when there are none.
pub fn cors(origins: &[String]) -> Result<Option<CorsLayer>, String> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let values = origins
            .iter()
            .map(|o| HeaderValue::from_str(o).map_err(|_| format!("--allowed-origins: `{o}` is not a valid origin")))
            .collect::<Result<Vec<_>, _>>()?;
        AllowOrigin::list(values)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([AUTHORIZATION, CONTENT_TYPE]),
    ))
}
