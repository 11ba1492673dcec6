//! Token generation for one sequence: prefill, then decode step by step.

use std::time::{Duration, Instant};

use vt_core::{Backend, Error, Result};
use vt_models::{Logits, Model};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    pub seed: u64,
    /// Stop after emitting one of these (it is included in the output).
    pub stop_token_ids: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_new_tokens: 16, temperature: 0.0, seed: 0, stop_token_ids: Vec::new() }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated ids only.
    pub token_ids: Vec<u32>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

pub fn generate<B: Backend>(model: &Model<B>, prompt: &[u32], opts: &GenerateOptions) -> Result<Generation> {
    if !(opts.temperature >= 0.0 && opts.temperature.is_finite()) {
        return Err(Error::input(format!("temperature must be a finite number >= 0, got {}", opts.temperature)));
    }
    let b = model.backend();
    let mut state = model.new_state()?;
    let mut rng = SplitMix64(opts.seed);
    let mut out = Vec::with_capacity(opts.max_new_tokens);
    let started = Instant::now();
    let mut prefill_time = Duration::ZERO;
    let mut next_input: Vec<u32> = prompt.to_vec();
    while out.len() < opts.max_new_tokens {
        let logits = b.to_f32(&model.forward(&next_input, &mut state, Logits::Last)?)?;
        if out.is_empty() {
            prefill_time = started.elapsed();
        }
        let id = pick(&logits, opts.temperature, &mut rng);
        out.push(id);
        if opts.stop_token_ids.contains(&id) {
            break;
        }
        next_input = vec![id];
    }
    Ok(Generation { token_ids: out, prefill_time, decode_time: started.elapsed() - prefill_time })
}

fn pick(logits: &[f32], temperature: f32, rng: &mut SplitMix64) -> u32 {
    let argmax = logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best });
    if temperature == 0.0 {
        return argmax as u32;
    }
    let max = logits[argmax];
    let weights: Vec<f64> = logits.iter().map(|&l| (((l - max) / temperature) as f64).exp()).collect();
    let mut r = rng.next_f64() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        r -= w;
        if r <= 0.0 {
            return i as u32;
        }
    }
    argmax as u32
}

/// A small seeded generator: sampling must be reproducible from `seed` alone.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}
