//! Request bodies and their checks, turned into engine terms.

use std::sync::atomic::Ordering;

use axum::body::Bytes;
use serde::Deserialize;
use vt::{Request, SamplingParams, Tokenizer};

use super::error::ApiError;
use super::{now, AppState};

#[derive(Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(OneOrMany<String>),
    Ids(Vec<u32>),
}

/// The fields both endpoints share.
#[derive(Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany<String>>,
    #[serde(default)]
    pub stream: bool,
}

pub fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("invalid request body: {e}")))
}

/// A request checked and turned into engine terms.
pub struct Prepared {
    pub req: Request,
    pub stops: Vec<String>,
    pub stream: bool,
}

pub fn prepare(s: &AppState, c: Common, prompt: Vec<u32>, default_max: usize) -> Result<Prepared, ApiError> {
    if let Some(m) = c.model.as_deref().filter(|m| *m != s.model_id) {
        return Err(ApiError::not_found(format!(
            "the model `{m}` does not exist; this server serves `{}`",
            s.model_id
        )));
    }
    let stops = match c.stop {
        None => vec![],
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) if v.len() <= 4 => v,
        Some(OneOrMany::Many(_)) => return Err(ApiError::bad("stop takes at most 4 strings")),
    };
    let d = &s.sampling;
    // Without a seed, each request draws its own.
    let seed = c.seed.unwrap_or_else(|| s.next_id.fetch_add(1, Ordering::Relaxed) ^ (now() * 0x9e37_79b9));
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(d.temperature),
        top_k: c.top_k.unwrap_or(d.top_k),
        top_p: c.top_p.unwrap_or(d.top_p),
        min_p: c.min_p.unwrap_or(d.min_p),
        repetition_penalty: c.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: c.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: c.frequency_penalty.unwrap_or(d.frequency_penalty),
        logit_bias: vec![],
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
    Ok(Prepared {
        req: Request { prompt, max_tokens, sampling, stop_token_ids, ..Default::default() },
        stops,
        stream: c.stream,
    })
}
