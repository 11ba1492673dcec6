//! Token generation for one sequence: prefill, then decode step by step.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use vt_core::{Backend, Error, Result};
use vt_models::{Logits, Model};

use crate::engine::{Engine, EngineConfig, Event, Request};
use crate::sampling::{Sampler, SamplingParams};
use crate::speculative::DrafterKind;

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
    /// Speculative decoding's drafts verified, and accepted (zeros without it).
    pub drafts: (u64, u64),
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
    Ok(Generation { token_ids: out, prefill_time, decode_time: started.elapsed() - prefill_time, drafts: (0, 0) })
}

/// `generate_with` through an engine of this one sequence, which verifies up to
/// `speculative_tokens` tokens per step drafted by `drafter` (the model's MTP layer, or prompt
/// lookup): the same tokens (its prompt runs in one chunk, as `generate_with`'s), in fewer steps
/// where the drafts are right.
pub fn generate_speculative<B: Backend>(
    model: Model<B>,
    prompt: &[u32],
    opts: &GenerateOptions,
    speculative_tokens: usize,
    drafter: DrafterKind,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation>
where
    Model<B>: Send,
{
    let max_context = prompt.len() + opts.max_new_tokens;
    let chunk = prompt.len().max(1 + speculative_tokens);
    // The pool holds this sequence and its state before a verification; nothing more.
    let bytes = model.pool_config(1, max_context, chunk).bytes + model.pool_config(1, 0, chunk).bytes;
    let config = EngineConfig {
        max_seqs: 1,
        max_batch_tokens: chunk,
        max_queue: 0,
        memory_budget: Some(bytes),
        max_context,
        prefix_cache: false,
        speculative_tokens,
        drafter,
        ..Default::default()
    };
    let mut engine = Engine::new(model, config)?;
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let sink = events.clone();
    let req = Request {
        prompt: prompt.to_vec(),
        max_tokens: opts.max_new_tokens,
        sampling: opts.sampling.clone(),
        stop_token_ids: opts.stop_token_ids.clone(),
        ..Default::default()
    };
    let cancel = engine
        .add(req, Box::new(move |e| sink.lock().map(|mut v| v.push(e)).is_ok()))
        .map_err(|e| Error::input(e.to_string()))?;
    let started = Instant::now();
    let (mut out, mut prefill_time) = (Vec::new(), None);
    while engine.has_work() {
        engine.step();
        let drained: Vec<Event> = events.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default();
        for e in drained {
            match e {
                Event::Token(id) => {
                    prefill_time.get_or_insert_with(|| started.elapsed());
                    out.push(id);
                    if on_token(id).is_break() {
                        cancel.cancel();
                    }
                }
                Event::Failed(msg) => return Err(Error::input(msg)),
                Event::Logprobs(_) | Event::Done(_) => {}
            }
        }
    }
    let prefill_time = prefill_time.unwrap_or_else(|| started.elapsed());
    let decode_time = started.elapsed() - prefill_time;
    Ok(Generation { token_ids: out, prefill_time, decode_time, drafts: engine.speculation_stats() })
}
