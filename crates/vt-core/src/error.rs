//! The one error type of vt. Every message names the file, tensor or field at fault.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: invalid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("{file}: config field `{field}`: {reason}")]
    Config { file: PathBuf, field: String, reason: String },
    #[error("tensor `{name}` not found in the checkpoint at {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("unsupported model: {0}")]
    UnsupportedModel(String),
    #[error("invalid input: {0}")]
    Input(String),
    /// The model computed a NaN or an infinity where a number must come out (broken weights).
    #[error("non-finite model output: {0}")]
    NonFinite(String),
    #[error("backend {backend}: {reason}")]
    Backend { backend: &'static str, reason: String },
}

impl Error {
    pub fn tensor(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), reason: reason.into() }
    }

    pub fn input(reason: impl Into<String>) -> Self {
        Error::Input(reason.into())
    }

    pub fn backend(backend: &'static str, reason: impl Into<String>) -> Self {
        Error::Backend { backend, reason: reason.into() }
    }
}
