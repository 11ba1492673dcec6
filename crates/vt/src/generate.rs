//! Token generation for one sequence: prefill, then decode step by step.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use vt_core::{Backend, Result};
use vt_models::{Logits, Model};

use crate::sampling::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop after emitting one of these (it is included in the output).
    pub stop_token_ids: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_new_tokens: 16, sampling: SamplingParams::greedy(), stop_token_ids: Vec::new() }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated ids only.
    pub token_ids: Vec<u32>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

/// Generates up to `max_new_tokens` after `prompt`.
pub fn generate<B: Backend>(model: &Model<B>, prompt: &[u32], opts: &GenerateOptions) -> Result<Generation> {
    generate_with(model, prompt, opts, |_| ControlFlow::Continue(()))
}

/// `generate`, where `on_token` sees each id as it comes and may stop the generation there.
/// Non-finite logits are an error (`Error::NonFinite`), never a token.
pub fn generate_with<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation> {
    let b = model.backend();
    let mut sampler = Sampler::new(opts.sampling.clone(), prompt)?;
    // The last generated token is never run.
    let mut state = model.new_state((prompt.len() + opts.max_new_tokens).saturating_sub(1).max(1))?;
    // A few pages up front: `max_new_tokens` may be far beyond what the context allows.
    let mut out = Vec::with_capacity(opts.max_new_tokens.min(4096));
    let started = Instant::now();
    let mut prefill_time = Duration::ZERO;
    let mut next_input: Vec<u32> = prompt.to_vec();
    while out.len() < opts.max_new_tokens {
        let logits = b.to_f32(&model.forward(&next_input, &mut state, Logits::Last)?)?;
        if out.is_empty() {
            prefill_time = started.elapsed();
        }
        vt_core::backend::check_finite(&logits)?;
        let id = sampler.sample(&logits);
        out.push(id);
        if on_token(id).is_break() || opts.stop_token_ids.contains(&id) {
            break;
        }
        next_input = vec![id];
    }
    Ok(Generation { token_ids: out, prefill_time, decode_time: started.elapsed() - prefill_time })
}
