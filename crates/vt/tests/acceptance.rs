//! Speculative decoding's acceptance rule (`Sampler::verify`) on a fixed distribution: whatever
//! the drafter's distribution q, the emitted tokens are distributed as the target's p, with
//! every sampling parameter applied to p; the acceptance rate is sum(min(p, q)).
//!
//! Test arithmetic: N draws, counts over the k tokens p allows; Pearson's statistic has k - 1
//! degrees of freedom. With k = 4, P(chi2_3 > 35) = erfc(sqrt(17.5)) + sqrt(70 / pi) e^-17.5
//! ~ 1.3e-7, so a correct rule fails this (fixed-seed) test with that probability, while a rule
//! that emitted q's draws unchanged scores in the thousands (checked below, so the test has the
//! power to see it).

use vt::{Sampler, SamplingParams};

const LOGITS: [f32; 6] = [1.0, 3.0, 2.9, 0.5, -1.0, 0.2];
const N: usize = 200_000;
const CHI2_3_LIMIT: f64 = 35.0;

/// Temperature 0.8, top-k 4, repetition penalty 1.3 on token 2 (the prompt's).
fn params(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_k: 4, repetition_penalty: 1.3, seed, ..Default::default() }
}

/// p, worked out here from the parameters: token 2's logit becomes 2.9 / 1.3, top-4 keeps
/// tokens 1, 2, 0, 3, weights exp((l - 3) / 0.8).
fn target() -> [f64; 6] {
    let mut l: Vec<f64> = LOGITS.iter().map(|&x| x as f64).collect();
    l[2] /= 1.3;
    let mut p = [0.0; 6];
    for t in [0, 1, 2, 3] {
        p[t] = ((l[t] - 3.0) / 0.8).exp();
    }
    let total: f64 = p.iter().sum();
    p.map(|w| w / total)
}

/// A small generator for the drafter's draws, apart from the sampler's.
struct Lcg(u64);

impl Lcg {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    fn draw(&mut self, q: &[f32]) -> u32 {
        let mut r = self.unit();
        for (i, &w) in q.iter().enumerate() {
            r -= w as f64;
            if r < 0.0 {
                return i as u32;
            }
        }
        q.len() as u32 - 1
    }
}

/// Pearson's statistic of `counts` against `p` over the tokens p allows.
fn chi2(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    (counts.iter().zip(p))
        .filter(|(_, &p)| p > 0.0)
        .map(|(&c, &p)| {
            let e = n as f64 * p;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// Emitted-token counts and acceptances over N verifications at `logits` of drafts drawn by
/// `draft`, whose distribution the rule is told as `q` (`None`: a point mass).
fn verify_many(logits: &[f32], mut draft: impl FnMut() -> u32, q: Option<&[f32]>) -> ([usize; 6], usize, [usize; 6]) {
    let (mut emitted, mut drafted, mut accepted) = ([0; 6], [0; 6], 0);
    for i in 0..N {
        let mut s = Sampler::new(params(i as u64), &[2]).unwrap();
        let x = draft();
        drafted[x as usize] += 1;
        let v = s.verify(logits, x, q);
        assert!(!v.accepted || v.token == x);
        emitted[v.token as usize] += 1;
        accepted += usize::from(v.accepted);
    }
    (emitted, accepted, drafted)
}

#[test]
fn sampled_drafts_leave_the_target_distribution() {
    let p = target();
    // q puts mass where p has none (tokens 4, 5) and too much on token 2.
    let q: [f32; 6] = [0.1, 0.2, 0.35, 0.05, 0.2, 0.1];
    let mut rng = Lcg(11);
    let (emitted, accepted, drafted) = verify_many(&LOGITS, || rng.draw(&q), Some(&q));
    assert_eq!((emitted[4], emitted[5]), (0, 0), "tokens outside top-k were emitted: {emitted:?}");
    let stat = chi2(&emitted, &p);
    assert!(stat < CHI2_3_LIMIT, "emitted {emitted:?} against p {p:?}: chi2 {stat}");
    assert!(chi2(&drafted, &p) > 100.0 * CHI2_3_LIMIT, "the drafts alone are far from p: the test can tell");
    // Acceptance: sum(min(p, q)), within 6 standard deviations of a binomial.
    let a: f64 = p.iter().zip(&q).map(|(&p, &q)| p.min(q as f64)).sum();
    let sd = (a * (1.0 - a) / N as f64).sqrt();
    let got = accepted as f64 / N as f64;
    assert!((got - a).abs() < 6.0 * sd, "acceptance {got}, expected {a} (sd {sd})");
}

#[test]
fn deterministic_drafts_leave_the_target_distribution() {
    // A drafter that always proposes token 2 (probs None: a point mass).
    let p = target();
    let (emitted, accepted, _) = verify_many(&LOGITS, || 2, None);
    let stat = chi2(&emitted, &p);
    assert!(stat < CHI2_3_LIMIT, "emitted {emitted:?} against p {p:?}: chi2 {stat}");
    let (a, sd) = (p[2], (p[2] * (1.0 - p[2]) / N as f64).sqrt());
    assert!((accepted as f64 / N as f64 - a).abs() < 6.0 * sd, "accepted {accepted} of {N}, expected p(2) = {a}");
}

/// Under a grammar the engine verifies a row's logits with the disallowed tokens at -inf
/// (`TokenMask::apply`), and a draft the grammar forbids, drawn from q, is still verified at its
/// row (rejected there): the output is distributed as the masked p. Sampling that row afresh
/// instead, as if the draft had not been made, would not be: q's mass on forbidden tokens would
/// skip the residual's correction.
#[test]
fn drafts_a_grammar_forbids_leave_the_masked_distribution() {
    let mut masked = LOGITS;
    (masked[0], masked[3]) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    // p: top-4 keeps the four allowed tokens, token 2's logit is 2.9 / 1.3 (as `target`).
    let mut l: Vec<f64> = masked.iter().map(|&x| x as f64).collect();
    l[2] /= 1.3;
    let w: Vec<f64> = l.iter().map(|&l| ((l - 3.0) / 0.8).exp()).collect();
    let total: f64 = w.iter().sum();
    let p: Vec<f64> = w.iter().map(|w| w / total).collect();
    let q: [f32; 6] = [0.1, 0.2, 0.35, 0.05, 0.2, 0.1];
    let mut rng = Lcg(5);
    let (emitted, _, _) = verify_many(&masked, || rng.draw(&q), Some(&q));
    assert_eq!((emitted[0], emitted[3]), (0, 0), "forbidden tokens were emitted: {emitted:?}");
    let stat = chi2(&emitted, &p);
    assert!(stat < CHI2_3_LIMIT, "emitted {emitted:?} against p {p:?}: chi2 {stat}");
    // The rule that drops a forbidden draft and samples its row afresh.
    let mut afresh = [0; 6];
    for i in 0..N {
        let mut s = Sampler::new(params(i as u64), &[2]).unwrap();
        let x = rng.draw(&q);
        let token = if [0, 3].contains(&x) { s.sample(&masked) } else { s.verify(&masked, x, Some(&q)).token };
        afresh[token as usize] += 1;
    }
    assert!(chi2(&afresh, &p) > 10.0 * CHI2_3_LIMIT, "the test can tell: {afresh:?}");
}

#[test]
fn greedy_accepts_exactly_the_argmax() {
    let mut s = Sampler::new(SamplingParams { presence_penalty: 0.5, ..Default::default() }, &[]).unwrap();
    let v = s.verify(&LOGITS, 1, None);
    assert!(v.accepted && v.token == 1);
    // Token 1 is now penalized by 0.5: 2.5 < 2.9, so a draft of 1 is rejected for 2.
    let v = s.verify(&LOGITS, 1, Some(&[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]));
    assert!(!v.accepted && v.token == 2, "{v:?}");
}
