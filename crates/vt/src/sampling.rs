//! Choosing the next token from logits: penalties, then greedy or seeded sampling with
//! top-k / top-p / min-p filtering (vt-core's `backend::sample` defines the draw). Everything is
//! per request, and reproducible from the seed.

use std::collections::{BTreeMap, HashMap};

use vt_core::backend::sample::{candidates, draw, prepared, sample_row, Filters};
pub use vt_core::backend::{token_logprobs, LogitAdjust, SampleRow, TokenLogprobs};
use vt_core::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of tokens seen in the prompt or output; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Added to the logits of the given tokens before anything else (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// `base` with the fields a checkpoint's `generation_config.json` sets (`do_sample: false` is
    /// greedy); `base` itself where the file is absent. Values out of range are an error naming
    /// the file and field.
    pub fn from_generation_config(dir: &std::path::Path, base: SamplingParams) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(base);
        }
        let cfg = vt_core::checkpoint::Config::from_file(&path)?;
        let f32_field = |field: &str, default: f32| Ok::<_, Error>(cfg.opt_f64(field)?.map_or(default, |v| v as f32));
        let mut p = SamplingParams {
            temperature: f32_field("temperature", base.temperature)?,
            top_k: cfg.opt_usize("top_k")?.unwrap_or(base.top_k),
            top_p: f32_field("top_p", base.top_p)?,
            min_p: f32_field("min_p", base.min_p)?,
            repetition_penalty: f32_field("repetition_penalty", base.repetition_penalty)?,
            ..base
        };
        if cfg.get("do_sample").and_then(|v| v.as_bool()) == Some(false) {
            p.temperature = 0.0;
        }
        p.validate().map_err(|e| cfg.error("sampling defaults", e.to_string()))?;
        Ok(p)
    }

    /// An error naming the first out-of-range field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, want: &str, got: f32| Err(Error::input(format!("{field} must be {want}, got {got}")));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", "a finite number >= 0", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "in (0, 1]", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "in [0, 1]", self.min_p);
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", "a finite number > 0", self.repetition_penalty);
        }
        for (field, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(field, "in [-2, 2]", v);
            }
        }
        if let Some(&(_, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad("logit_bias", "in [-100, 100]", b);
        }
        Ok(())
    }
}

/// The sampling state of one sequence: its parameters, random stream and the tokens it has seen.
/// Its draws are vt-core's (`vt_core::backend::sample`), on the host (`sample`, `verify`) or
/// where the logits are (`pick`, for `Device::sample_rows`).
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// How often each token was generated.
    generated: HashMap<u32, u32>,
    /// The logit adjustments of the bias and the penalties as of the tokens seen so far, by token.
    adjust: Vec<LogitAdjust>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Result<Self> {
        params.validate()?;
        let mut adjust: BTreeMap<u32, LogitAdjust> = BTreeMap::new();
        let none = |token| LogitAdjust { token, bias: 0.0, penalty: 0.0, repeated: 0 };
        for &(token, bias) in &params.logit_bias {
            adjust.entry(token).or_insert(none(token)).bias += bias;
        }
        if params.repetition_penalty != 1.0 {
            for &token in prompt {
                adjust.entry(token).or_insert(none(token)).repeated = 1;
            }
        }
        Ok(Sampler {
            rng: SplitMix64(params.seed),
            params,
            generated: HashMap::new(),
            adjust: adjust.into_values().collect(),
        })
    }

    /// Picks the next token from `logits` (one row, `[vocab]`) and records it as generated.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let uniform = self.uniform();
        let id = sample_row(logits, &self.pick(0, None, uniform));
        self.accept(id)
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether `sample` is the plain argmax of the logits (greedy, no penalty): then the token can
    /// be picked where the logits are (`Backend::argmax_rows`) and given to `accept`.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 && self.adjust.is_empty() && !self.penalizes()
    }

    /// Whether tokens generated from now on change the logits (a penalty is on).
    fn penalizes(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// The next draw of this sequence's generator where it samples (0 when greedy, which draws
    /// nothing): what `pick` takes.
    pub fn uniform(&mut self) -> f64 {
        if self.params.temperature > 0.0 {
            self.rng.next_f64()
        } else {
            0.0
        }
    }

    /// How `Device::sample_rows` draws this sequence's next token from row `row` of the logits,
    /// under a grammar's mask `allowed`, with `uniform` (from `Sampler::uniform`). Give the token
    /// it picks to `accept`.
    pub fn pick<'a>(&'a self, row: usize, allowed: Option<&'a [u32]>, uniform: f64) -> SampleRow<'a> {
        let p = &self.params;
        SampleRow {
            row,
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            adjust: &self.adjust,
            allowed,
            uniform,
        }
    }

    /// Records `id`, picked elsewhere, as generated; returns it.
    pub fn accept(&mut self, id: u32) -> u32 {
        let n = self.generated.entry(id).or_default();
        *n += 1;
        let n = *n;
        if self.penalizes() {
            let p = &self.params;
            let penalty = p.presence_penalty + p.frequency_penalty * n as f32;
            let repeated = u32::from(p.repetition_penalty != 1.0);
            match self.adjust.binary_search_by_key(&id, |a| a.token) {
                Ok(i) => self.adjust[i] = LogitAdjust { penalty, repeated, ..self.adjust[i] },
                Err(i) => self.adjust.insert(i, LogitAdjust { token: id, bias: 0.0, penalty, repeated }),
            }
        }
        id
    }

    /// Speculative decoding's acceptance rule at one position. `draft` was proposed from `q`, the
    /// drafter's distribution over the vocabulary (`None`: picked deterministically, a point
    /// mass). With `p` the distribution `sample` draws from for `logits` (every parameter
    /// applied, penalties as of the tokens generated so far), `draft` is accepted with
    /// probability min(1, p(draft) / q(draft)); otherwise the token is drawn from
    /// norm(max(0, p - q)). Either way the token is distributed exactly as `sample`'s would be
    /// (greedy: the argmax, accepted when it is the draft), and is recorded as generated.
    pub fn verify(&mut self, logits: &[f32], draft: u32, q: Option<&[f32]>) -> Verdict {
        let p = &self.params;
        let row = prepared(logits, None, &self.adjust, p.repetition_penalty);
        if p.temperature == 0.0 {
            let id = vt_core::argmax(&row) as u32;
            return Verdict { token: self.accept(id), accepted: id == draft };
        }
        let f = Filters { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p };
        let cands = candidates(&row, &f);
        let total: f64 = cands.iter().map(|c| c.1).sum();
        let q_of = |id: u32| match q {
            Some(q) => q.get(id as usize).map_or(0.0, |&v| v as f64),
            None => f64::from(u8::from(id == draft)),
        };
        let p_draft = cands.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1 / total);
        let q_draft = q_of(draft);
        if p_draft > 0.0 && (p_draft >= q_draft || self.rng.next_f64() * q_draft < p_draft) {
            return Verdict { token: self.accept(draft), accepted: true };
        }
        // Outside the candidates p is 0, so the residual lives on them.
        let residual: Vec<(u32, f64)> =
            cands.iter().map(|&(id, w)| (id, (w / total - q_of(id)).max(0.0))).filter(|c| c.1 > 0.0).collect();
        let id = draw(if residual.is_empty() { &cands } else { &residual }, self.rng.next_f64());
        Verdict { token: self.accept(id), accepted: false }
    }
}

/// What `Sampler::verify` decided at one position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The token emitted there: the draft, or the replacement drawn instead.
    pub token: u32,
    pub accepted: bool,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p, &[]).unwrap()
    }

    fn draws(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = sampler(p);
        (0..n).map(|_| s.sample(logits)).collect()
    }

    const LOGITS: [f32; 5] = [1.0, 3.0, 2.9, 0.5, -1.0];

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(sampler(SamplingParams::greedy()).sample(&[0.0, 2.0, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let p = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
        let a = draws(p.clone(), &LOGITS, 64);
        assert_eq!(a, draws(p.clone(), &LOGITS, 64));
        assert_ne!(a, draws(SamplingParams { seed: 8, ..p }, &LOGITS, 64));
    }

    #[test]
    fn filters_keep_only_the_allowed_tokens() {
        let hot = SamplingParams { temperature: 5.0, ..Default::default() };
        let only = |p: SamplingParams| {
            let mut d = draws(p, &LOGITS, 200);
            d.sort_unstable();
            d.dedup();
            d
        };
        assert_eq!(only(SamplingParams { top_k: 2, ..hot.clone() }), vec![1, 2]);
        assert_eq!(only(SamplingParams { top_k: 1, ..hot.clone() }), vec![1]);
        // At temperature 5 token 1 alone is ~26% of the mass: top_p 0.2 keeps just it.
        assert_eq!(only(SamplingParams { top_p: 0.2, ..hot.clone() }), vec![1]);
        // Relative to the top token: token 0 weighs exp(-2/5) = 0.67, token 3 exp(-2.5/5) = 0.61.
        assert_eq!(only(SamplingParams { min_p: 0.64, ..hot.clone() }), vec![0, 1, 2]);
        assert_eq!(only(hot).len(), 5);
    }

    #[test]
    fn penalties_push_generated_tokens_down() {
        let mut s = sampler(SamplingParams { presence_penalty: 0.5, ..Default::default() });
        assert_eq!(s.sample(&LOGITS), 1);
        assert_eq!(s.sample(&LOGITS), 2, "3.0 - 0.5 < 2.9");
        let mut s = sampler(SamplingParams { frequency_penalty: 0.06, ..Default::default() });
        assert_eq!(s.sample(&LOGITS), 1);
        assert_eq!(s.sample(&LOGITS), 1, "3.0 - 0.06 > 2.9");
        assert_eq!(s.sample(&LOGITS), 2, "3.0 - 0.12 < 2.9");
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.2, ..Default::default() }, &[1]).unwrap();
        assert_eq!(s.sample(&LOGITS), 2, "the prompt's token 1 counts as seen: 3.0 / 1.2 < 2.9");
    }

    /// A token of the prompt that is generated again is penalised once, not once per source.
    #[test]
    fn repetition_penalty_applies_once_per_token() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.4, ..Default::default() }, &[0]).unwrap();
        // 3.0 / 1.4 = 2.14 > 2.0 every time; twice divided it would be 1.53.
        assert_eq!([s.sample(&[3.0, 2.0]), s.sample(&[3.0, 2.0]), s.sample(&[3.0, 2.0])], [0, 0, 0]);
    }

    /// The seeded generator's draws through every filter have the filtered distribution.
    /// Temperature 0.8 over LOGITS: ranking 1, 2, 0, 3, 4 with weights 1, exp(-0.125),
    /// exp(-2.5), exp(-3.125), exp(-5); top_k 4 drops 4; top_p 0.99 keeps the other four (the
    /// first three hold 0.978 of them); min_p 0.05 drops 3 (0.044). Pearson's statistic over
    /// the 3 tokens has 2 degrees of freedom: P(chi2_2 > 32) = exp(-16) = 1.1e-7 for a correct
    /// sampler (a fixed seed: it passes or fails for good), while dropping token 0 or keeping
    /// token 3 moves the counts by thousands of standard deviations.
    #[test]
    fn seeded_draws_have_the_filtered_distribution() {
        const N: usize = 200_000;
        let p = SamplingParams { temperature: 0.8, top_k: 4, min_p: 0.05, top_p: 0.99, seed: 11, ..Default::default() };
        let w = [(-2.0f64 / 0.8).exp(), 1.0, (-0.1f64 / 0.8).exp()];
        let total: f64 = w.iter().sum();
        let mut counts = [0usize; 5];
        draws(p, &LOGITS, N).iter().for_each(|&t| counts[t as usize] += 1);
        assert_eq!(counts[3] + counts[4], 0, "{counts:?}");
        let stat: f64 =
            (0..3).map(|t| (counts[t] as f64 - N as f64 * w[t] / total).powi(2) / (N as f64 * w[t] / total)).sum();
        assert!(stat < 32.0, "chi-square {stat}: {counts:?}");
    }

    #[test]
    fn logit_bias_moves_tokens() {
        let mut s = sampler(SamplingParams { logit_bias: vec![(4, 100.0)], ..Default::default() });
        assert!(!s.is_greedy());
        assert_eq!(s.sample(&LOGITS), 4);
    }

    #[test]
    fn logprobs_are_log_softmax_and_sorted() {
        let lp = token_logprobs(&LOGITS, 0, 3);
        let lse = LOGITS.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
        assert!((lp.logprob as f64 - (1.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 0]);
        assert!((lp.top[0].1 as f64 - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(token_logprobs(&[1.0, 1.0, 1.0], 2, 2).top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn out_of_range_parameters_are_errors() {
        for p in [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 2.0, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { presence_penalty: 3.0, ..Default::default() },
            SamplingParams { logit_bias: vec![(1, 101.0)], ..Default::default() },
        ] {
            assert!(Sampler::new(p, &[]).is_err());
        }
    }

    /// A checkpoint's generation_config.json sets the defaults it names; `do_sample: false` is
    /// greedy; a value out of range is an error naming the file; no file keeps the base.
    #[test]
    fn defaults_from_generation_config() {
        let dir = std::env::temp_dir().join(format!("vt-genconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = SamplingParams { temperature: 1.0, ..Default::default() };
        assert_eq!(SamplingParams::from_generation_config(&dir, base.clone()).unwrap(), base);
        let write = |v: &str| std::fs::write(dir.join("generation_config.json"), v).unwrap();
        write(r#"{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 1}"#);
        let p = SamplingParams::from_generation_config(&dir, base.clone()).unwrap();
        assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p), (0.6, 0.95, 20, 0.0));
        write(r#"{"do_sample": false, "temperature": 0.6}"#);
        assert_eq!(SamplingParams::from_generation_config(&dir, base.clone()).unwrap().temperature, 0.0);
        write(r#"{"top_p": 7}"#);
        let err = SamplingParams::from_generation_config(&dir, base).unwrap_err().to_string();
        assert!(err.contains("generation_config.json") && err.contains("top_p"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
