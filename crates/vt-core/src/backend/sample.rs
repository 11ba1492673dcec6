//! Sampling a token from a row of logits, defined once: `Device::sample_rows` draws with it (a
//! device backend where the logits are, vt-cpu and the composed default on the host), and vt's
//! `Sampler` builds its arguments and verifies drafts with it.
//!
//! A draw, in order: the grammar's mask (a disallowed token reads as -inf); the sparse
//! adjustments (`LogitAdjust`: logit bias, repetition penalty, presence and frequency penalties);
//! at temperature 0 the argmax of that (`argmax`); otherwise the weights
//! `exp((l - max) / temperature)`, filtered to the top k and top p of the ranking (adjusted logit
//! descending, lower id first on ties) and to weights of at least `min_p`, and one of them drawn
//! by walking the kept tokens in id order to the first whose running sum of weights exceeds
//! `uniform` times their total. Walking in id order rather than in rank order makes the draw a
//! prefix sum over the row, which a device computes without sorting the vocabulary.

use super::composed::argmax;

/// One token's adjustments, applied in field order to its logit: `bias` added; where `repeated`
/// is 1, the repetition penalty (a positive logit divided by it, a negative one multiplied);
/// `penalty` subtracted. The layout is the CUDA kernel's (kernels/sample.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitAdjust {
    pub token: u32,
    /// OpenAI's `logit_bias`.
    pub bias: f32,
    /// The presence penalty plus the frequency penalty times the times the token was generated.
    pub penalty: f32,
    /// 1 where the token was seen (prompt or output) and the repetition penalty applies, else 0.
    pub repeated: u32,
}

/// How one pick is drawn from row `row` of the logits (`Device::sample_rows`).
#[derive(Clone, Copy, Debug)]
pub struct SampleRow<'a> {
    pub row: usize,
    /// 0 takes the argmax of the adjusted, masked row.
    pub temperature: f32,
    /// Keep the `top_k` first of the ranking; 0 keeps all.
    pub top_k: usize,
    /// Keep the shortest prefix of the ranking whose weight reaches `top_p` of what top-k kept.
    pub top_p: f32,
    /// Keep weights of at least `min_p` (the most likely token weighs 1).
    pub min_p: f32,
    /// What `LogitAdjust::repeated` applies.
    pub repetition_penalty: f32,
    /// At most one per token, in increasing token order; tokens outside the row are ignored.
    pub adjust: &'a [LogitAdjust],
    /// A grammar's mask, `mask_words(width)` words (token i: bit i % 32 of word i / 32).
    pub allowed: Option<&'a [u32]>,
    /// The draw, in [0, 1), from the sequence's seeded generator.
    pub uniform: f64,
}

impl SampleRow<'_> {
    /// A pick from row `row` at `temperature` with `uniform`, nothing cut, adjusted or masked.
    pub fn plain(row: usize, temperature: f32, uniform: f64) -> Self {
        SampleRow {
            row,
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            adjust: &[],
            allowed: None,
            uniform,
        }
    }
}

/// Applies `adjust` (as `LogitAdjust` says) to `row`.
pub fn adjust_logits(row: &mut [f32], adjust: &[LogitAdjust], repetition_penalty: f32) {
    for a in adjust {
        if let Some(l) = row.get_mut(a.token as usize) {
            *l = adjusted(*l, a, repetition_penalty);
        }
    }
}

/// One logit after its adjustment (kernels/sample.cu's `sample_adjusted` does the same steps).
fn adjusted(l: f32, a: &LogitAdjust, repetition_penalty: f32) -> f32 {
    let mut l = l + a.bias;
    if a.repeated != 0 {
        l = if l > 0.0 { l / repetition_penalty } else { l * repetition_penalty };
    }
    l - a.penalty
}

/// The filters of a draw at a positive temperature.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Filters {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
}

/// The tokens a draw from the adjusted row `row` chooses among at `f`, in id order, with their
/// weights (unnormalised, the most likely token's 1, none 0). Never empty: a row with no finite
/// maximum (every token masked) gives its `argmax` alone.
pub fn candidates(row: &[f32], f: &Filters) -> Vec<(u32, f64)> {
    let top = argmax(row);
    let max = row.get(top).copied().unwrap_or(f32::NAN);
    if !max.is_finite() {
        return vec![(top as u32, 1.0)];
    }
    let weight = |l: f32| ((l - max) / f.temperature).exp() as f64;
    let mut keep = vec![true; row.len()];
    if f.top_k > 0 || f.top_p < 1.0 {
        // The ranking: larger logit first, lower id first on ties (a stable sort).
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        let mut ranked = if f.top_k > 0 { &order[..f.top_k.min(order.len())] } else { &order[..] };
        if f.top_p < 1.0 {
            let total: f64 = ranked.iter().map(|&i| weight(row[i as usize])).sum();
            let target = f.top_p as f64 * total;
            let mut acc = 0.0;
            let end = ranked.iter().position(|&i| {
                acc += weight(row[i as usize]);
                acc >= target
            });
            ranked = &ranked[..end.map_or(ranked.len(), |e| e + 1)];
        }
        keep.fill(false);
        ranked.iter().for_each(|&i| keep[i as usize] = true);
    }
    let kept: Vec<(u32, f64)> = (row.iter().zip(keep).enumerate())
        .filter(|(_, (_, k))| *k)
        .map(|(i, (&l, _))| (i as u32, weight(l)))
        .filter(|&(_, w)| w > 0.0 && w >= f.min_p as f64)
        .collect();
    if kept.is_empty() {
        return vec![(top as u32, 1.0)];
    }
    kept
}

/// The token of `cands` (in id order) whose running sum of weights first exceeds `uniform` times
/// their total; the last one where rounding leaves none.
pub fn draw(cands: &[(u32, f64)], uniform: f64) -> u32 {
    let target = uniform * cands.iter().map(|c| c.1).sum::<f64>();
    let mut acc = 0.0;
    for &(id, w) in cands {
        acc += w;
        if acc > target {
            return id;
        }
    }
    cands.last().map_or(0, |c| c.0)
}

/// `row` masked by `allowed` (disallowed tokens at -inf) and adjusted: what a draw ranks.
pub fn prepared(row: &[f32], allowed: Option<&[u32]>, adjust: &[LogitAdjust], repetition_penalty: f32) -> Vec<f32> {
    let mut row = row.to_vec();
    if let Some(bits) = allowed {
        for (i, l) in row.iter_mut().enumerate() {
            if bits[i / 32] >> (i % 32) & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    adjust_logits(&mut row, adjust, repetition_penalty);
    row
}

/// The token `s` draws from `raw`, its row of logits: the reference of `Device::sample_rows`.
pub fn sample_row(raw: &[f32], s: &SampleRow<'_>) -> u32 {
    let row = prepared(raw, s.allowed, s.adjust, s.repetition_penalty);
    if s.temperature == 0.0 {
        return argmax(&row) as u32;
    }
    let f = Filters { temperature: s.temperature, top_k: s.top_k, top_p: s.top_p, min_p: s.min_p };
    draw(&candidates(&row, &f), s.uniform)
}

/// An error naming what is wrong with `picks` for `rows` rows of `width` logits, before a
/// backend reads anything.
pub fn check_picks(rows: usize, width: usize, picks: &[SampleRow<'_>]) -> crate::Result<()> {
    let bad = |i: usize, what: String| Err(crate::Error::input(format!("sample_rows: pick {i}: {what}")));
    if width == 0 {
        return Err(crate::Error::input("sample_rows: rows of no values"));
    }
    for (i, s) in picks.iter().enumerate() {
        if s.row >= rows {
            return bad(i, format!("row {} of {rows}", s.row));
        }
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return bad(i, format!("temperature {}", s.temperature));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0 && (0.0..=1.0).contains(&s.min_p)) {
            return bad(i, format!("top_p {} or min_p {}", s.top_p, s.min_p));
        }
        if !(s.repetition_penalty.is_finite() && s.repetition_penalty > 0.0) {
            return bad(i, format!("repetition penalty {}", s.repetition_penalty));
        }
        if !(0.0..1.0).contains(&s.uniform) {
            return bad(i, format!("uniform {} outside [0, 1)", s.uniform));
        }
        if s.adjust.windows(2).any(|w| w[0].token >= w[1].token) {
            return bad(i, "adjustments not in increasing token order".into());
        }
        if s.adjust.iter().any(|a| !(a.bias.is_finite() && a.penalty.is_finite())) {
            return bad(i, "an adjustment is not finite".into());
        }
        if let Some(bits) = s.allowed {
            if bits.len() != super::mask_words(width) {
                return bad(i, format!("{} mask words for rows of {width}", bits.len()));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROW: [f32; 6] = [1.0, 3.0, 2.9, 0.5, -1.0, 0.2];

    fn pick(uniform: f64) -> SampleRow<'static> {
        SampleRow::plain(0, 1.0, uniform)
    }

    /// The draws of `s` at `N` evenly spread uniforms, counted per token; against `p` (worked
    /// out in f64 in the test) by Pearson's statistic. Evenly spread uniforms make the counts
    /// N p to within one per token (each token owns an interval of the uniforms), so the
    /// statistic of a correct rule is at most about sum 1 / (N p) per token: the bound 1 is
    /// loose by orders of magnitude, while a wrong distribution scores about N times its squared
    /// error (N = 100000: a 1% error in one probability already scores ~10).
    fn chi_square(s: &SampleRow<'_>, p: &[f64]) -> f64 {
        const N: usize = 100_000;
        let mut counts = vec![0usize; ROW.len()];
        for j in 0..N {
            let u = (j as f64 + 0.5) / N as f64;
            counts[sample_row(&ROW, &SampleRow { uniform: u, ..*s }) as usize] += 1;
        }
        let mut stat = 0.0;
        for (t, &c) in counts.iter().enumerate() {
            let want = N as f64 * p[t];
            if p[t] == 0.0 {
                assert_eq!(c, 0, "token {t} is never drawn: {counts:?}");
            } else {
                stat += (c as f64 - want).powi(2) / want;
            }
        }
        stat
    }

    /// `exp((l - max) / t)` over `keep`, normalised.
    fn expected(l: &[f64], t: f64, keep: &[usize]) -> Vec<f64> {
        let max = keep.iter().map(|&i| l[i]).fold(f64::NEG_INFINITY, f64::max);
        let mut p = vec![0.0; l.len()];
        keep.iter().for_each(|&i| p[i] = ((l[i] - max) / t).exp());
        let total: f64 = p.iter().sum();
        p.iter().map(|w| w / total).collect()
    }

    #[test]
    fn each_parameter_draws_its_distribution() {
        let l: Vec<f64> = ROW.iter().map(|&v| v as f64).collect();
        let all = [0, 1, 2, 3, 4, 5];
        let s = pick(0.0);
        // At temperature 0.7 the ranking is 1, 2, 0, 3, 5, 4 with weights 1, 0.867, 0.057,
        // 0.028, 0.018, 0.003: top_p 0.9 of the total 1.974 keeps 1 and 2 (1.867 >= 1.777).
        let adjust = [
            LogitAdjust { token: 1, bias: 0.0, penalty: 0.0, repeated: 1 },
            LogitAdjust { token: 2, bias: 0.0, penalty: 0.7, repeated: 0 },
            LogitAdjust { token: 4, bias: 3.5, penalty: 0.0, repeated: 0 },
        ];
        // Repetition 1.5 on token 1 (3 -> 2), 0.7 off token 2 (-> 2.2), bias 3.5 on token 4 (-> 2.5).
        let mut adj = l.clone();
        (adj[1], adj[2], adj[4]) = (2.0, 2.9 - 0.7, 2.5);
        let mask = [0b10_1110u32]; // tokens 1, 2, 3, 5
        let cases: Vec<(&str, SampleRow<'_>, Vec<f64>)> = vec![
            ("temperature 1", s, expected(&l, 1.0, &all)),
            ("temperature 0.7", SampleRow { temperature: 0.7, ..s }, expected(&l, 0.7, &all)),
            ("top_k 3", SampleRow { top_k: 3, ..s }, expected(&l, 1.0, &[1, 2, 0])),
            ("top_p 0.9", SampleRow { temperature: 0.7, top_p: 0.9, ..s }, expected(&l, 0.7, &[1, 2])),
            // Weights at temperature 1: token 0 exp(-2) = 0.135, token 3 exp(-2.5) = 0.082.
            ("min_p 0.1", SampleRow { min_p: 0.1, ..s }, expected(&l, 1.0, &[0, 1, 2])),
            ("mask", SampleRow { allowed: Some(&mask), ..s }, expected(&l, 1.0, &[1, 2, 3, 5])),
            ("adjustments", SampleRow { adjust: &adjust, repetition_penalty: 1.5, ..s }, expected(&adj, 1.0, &all)),
            (
                "all together",
                SampleRow {
                    top_k: 3,
                    top_p: 0.95,
                    min_p: 0.15,
                    allowed: Some(&mask),
                    adjust: &adjust,
                    repetition_penalty: 1.5,
                    ..s
                },
                // Adjusted and masked: 1 -> 2.0, 2 -> 2.2, 3 -> 0.5, 5 -> 0.2, weights 0.819,
                // 1, 0.183, 0.135: top 3 drops 5; 0.95 of their 2.001 is 1.901, past 2 and 1
                // (1.819): 3 stays, and min_p 0.15 keeps it (0.183).
                expected(&adj, 1.0, &[1, 2, 3]),
            ),
        ];
        for (name, s, p) in cases {
            let stat = chi_square(&s, &p);
            assert!(stat < 1.0, "{name}: chi-square {stat} against {p:?}");
        }
        // The statistic sees a wrong distribution: top_k 3's draws against temperature 1's.
        assert!(chi_square(&SampleRow { top_k: 3, ..s }, &expected(&l, 1.0, &all)) > 1000.0);
    }

    #[test]
    fn greedy_is_the_adjusted_masked_argmax() {
        let s = SampleRow { temperature: 0.0, ..pick(0.5) };
        assert_eq!(sample_row(&ROW, &s), 1);
        let adjust = [LogitAdjust { token: 1, bias: 0.0, penalty: 0.2, repeated: 0 }];
        assert_eq!(sample_row(&ROW, &SampleRow { adjust: &adjust, ..s }), 2, "3.0 - 0.2 < 2.9");
        assert_eq!(sample_row(&ROW, &SampleRow { allowed: Some(&[0b1001]), ..s }), 0);
        assert_eq!(sample_row(&ROW, &SampleRow { allowed: Some(&[0]), ..pick(0.5) }), 0, "nothing allowed: argmax");
    }

    #[test]
    fn the_draw_walks_the_kept_tokens_in_id_order() {
        // Weights 1, 1, 1 over tokens 0, 2, 4 (equal logits, others masked): thirds of [0, 1).
        let row = [0.0, 9.0, 0.0, 9.0, 0.0];
        let s = SampleRow { allowed: Some(&[0b10101]), ..pick(0.0) };
        let at = |u: f64| sample_row(&row, &SampleRow { uniform: u, ..s });
        assert_eq!([at(0.0), at(0.33), at(0.34), at(0.66), at(0.67), at(0.999)], [0, 0, 2, 2, 4, 4]);
        assert_eq!(draw(&[(3, 0.0), (5, 2.0)], 0.0), 5, "a zero weight is never drawn");
    }

    #[test]
    fn top_k_ties_keep_the_lower_ids() {
        let row = [1.0, 2.0, 2.0, 2.0, 0.0];
        let f = Filters { temperature: 1.0, top_k: 2, top_p: 1.0, min_p: 0.0 };
        assert_eq!(candidates(&row, &f).iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn bad_picks_are_named() {
        let ok = pick(0.5);
        assert!(check_picks(1, 6, &[ok]).is_ok());
        let adj = [LogitAdjust { token: 2, bias: 0.0, penalty: 0.0, repeated: 0 }; 2];
        for (bad, what) in [
            (SampleRow { row: 1, ..ok }, "row 1 of 1"),
            (SampleRow { uniform: 1.0, ..ok }, "uniform"),
            (SampleRow { top_p: 0.0, ..ok }, "top_p"),
            (SampleRow { temperature: f32::NAN, ..ok }, "temperature"),
            (SampleRow { adjust: &adj, ..ok }, "increasing"),
            (SampleRow { allowed: Some(&[0, 0]), ..ok }, "mask words"),
        ] {
            let e = check_picks(1, 6, &[ok, bad]).unwrap_err().to_string();
            assert!(e.contains("pick 1") && e.contains(what), "{e}");
        }
    }
}
