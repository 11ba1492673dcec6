//! Every composed default of the layer traits, written with the primitive ops: what a backend
//! gets for a method it does not override, and what a fusing backend falls back to where its
//! fused kernel does not fit.

use super::sample::{check_picks, sample_row, SampleRow};
use super::{check, AttentionParams, Device, GateAct, GdnInputs, GdnMode, GdnState, GdnStep, KvOps, KvSeq};
use super::{FusedOps, NormKind, Ops};
use super::{Rope, SharedExpert};
use crate::tensor::Tensor;
use crate::weights::{Linear, MoeExperts, Router};
use crate::Result;

/// The log-probabilities of one generated token: its own and the `top` most likely ones (most
/// likely first), from the model's raw logits (before penalties, biases and grammar masks).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `log_softmax(row)[chosen]` and the `k` largest entries of it (ties: lower id first; NaNs
/// never count), the reference `Device::top_logprobs_rows` computes per row.
pub fn token_logprobs(row: &[f32], chosen: u32, k: usize) -> TokenLogprobs {
    let values = || row.iter().copied().filter(|v| !v.is_nan());
    let max = values().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + values().map(|l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in row.iter().enumerate().filter(|(_, l)| !l.is_nan()) {
        if top.len() < k || top.last().is_some_and(|&(_, m)| l > m) {
            let at = top.partition_point(|&(_, m)| m >= l);
            top.insert(at, (i as u32, l));
            top.truncate(k);
        }
    }
    let logprob = row.get(chosen as usize).map_or(f32::NEG_INFINITY, |&l| l - lse);
    TokenLogprobs { logprob, top: top.into_iter().map(|(i, l)| (i, l - lse)).collect() }
}

/// `Device::top_logprobs_rows` from the rows read back.
pub fn top_logprobs_rows<B: Device>(b: &B, x: &Tensor<B>, chosen: &[u32], k: usize) -> Result<Vec<TokenLogprobs>> {
    check_chosen(x, chosen)?;
    Ok(top_logprobs_host(&b.to_f32(x)?, x.last_dim(), chosen, k))
}

/// An error unless `x` has rows of some values and `chosen` holds an id per row.
pub fn check_chosen<B: Device>(x: &Tensor<B>, chosen: &[u32]) -> Result<()> {
    if x.last_dim() == 0 || chosen.len() != x.rows() {
        return Err(crate::Error::input(format!(
            "top_logprobs_rows: {} chosen ids for logits {:?}",
            chosen.len(),
            x.shape()
        )));
    }
    Ok(())
}

/// `Device::top_logprobs_rows` of the host rows `data` (`width` values each), checked.
pub fn top_logprobs_host(data: &[f32], width: usize, chosen: &[u32], k: usize) -> Vec<TokenLogprobs> {
    data.chunks(width).zip(chosen).map(|(row, &c)| token_logprobs(row, c, k)).collect()
}

/// What `Device::sample_rows` gives: a pick per `SampleRow`, and their logprobs where asked.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub picks: Vec<Pick>,
    pub logprobs: Option<Vec<TokenLogprobs>>,
}

/// `Device::sample_rows` from the rows read back.
pub fn sample_rows<B: Device>(b: &B, x: &Tensor<B>, picks: &[SampleRow<'_>], top: Option<usize>) -> Result<Sampled> {
    check_picks(x.rows(), x.last_dim(), picks)?;
    Ok(sample_host(&b.to_f32(x)?, x.last_dim(), picks, top))
}

/// `Device::sample_rows` over the host rows `data` (`width` values each), its picks checked.
pub fn sample_host(data: &[f32], width: usize, picks: &[SampleRow<'_>], top: Option<usize>) -> Sampled {
    let row = |s: &SampleRow<'_>| &data[s.row * width..(s.row + 1) * width];
    let picks_out: Vec<Pick> = picks
        .iter()
        .map(|s| Pick { id: sample_row(row(s), s), finite: row(s).iter().all(|v| v.is_finite()) })
        .collect();
    let logprobs = top.map(|k| picks.iter().zip(&picks_out).map(|(s, p)| token_logprobs(row(s), p.id, k)).collect());
    Sampled { picks: picks_out, logprobs }
}

/// One row's greedy pick (`Device::argmax_rows`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    pub id: u32,
    /// Whether every value of the row, allowed or not, is finite. A NaN or an infinity means the
    /// weights or the configuration are broken: the row's `id` is then no token to send.
    pub finite: bool,
}

/// Words of an allowed-token bitset per row of `width` logits (`Device::argmax_rows`): token `i`
/// is bit `i % 32` of word `i / 32`.
pub fn mask_words(width: usize) -> usize {
    width.div_ceil(32)
}

/// `Device::argmax_rows` from the rows read back.
pub fn argmax_rows<B: Device>(b: &B, x: &Tensor<B>, allowed: Option<&[u32]>) -> Result<Vec<Pick>> {
    check_allowed(x, allowed)?;
    Ok(argmax_host(&b.to_f32(x)?, x.last_dim(), allowed))
}

/// `Device::argmax_rows` of the host rows `data` (`width` values each), `allowed` checked.
pub fn argmax_host(data: &[f32], width: usize, allowed: Option<&[u32]>) -> Vec<Pick> {
    let words = mask_words(width);
    data.chunks(width)
        .enumerate()
        .map(|(r, row)| {
            let finite = row.iter().all(|v| v.is_finite());
            let id = match allowed {
                None => argmax(row),
                Some(bits) => masked_argmax(row, &bits[r * words..(r + 1) * words]),
            };
            Pick { id: id as u32, finite }
        })
        .collect()
}

/// An error unless `x` has rows of some values and `allowed`, if given, holds `mask_words` per row.
pub fn check_allowed<B: Device>(x: &Tensor<B>, allowed: Option<&[u32]>) -> Result<()> {
    let width = x.last_dim();
    if width == 0 {
        return Err(crate::Error::input(format!("argmax_rows: rows of no values {:?}", x.shape())));
    }
    match allowed {
        Some(bits) if bits.len() != x.rows() * mask_words(width) => Err(crate::Error::input(format!(
            "argmax_rows: {} mask words for logits {:?} ({} per row)",
            bits.len(),
            x.shape(),
            mask_words(width)
        ))),
        _ => Ok(()),
    }
}

/// `argmax` of `row` with the tokens whose bit in `allowed` is 0 read as -inf (a grammar's mask).
pub fn masked_argmax(row: &[f32], allowed: &[u32]) -> usize {
    let value = |i: usize| if allowed[i / 32] >> (i % 32) & 1 == 1 { row[i] } else { f32::NEG_INFINITY };
    (0..row.len()).fold(0, |best, i| if value(i) > value(best) { i } else { best })
}

/// The index of the largest value of `row`, the first on ties; a NaN never wins, except at index
/// 0, where it is never displaced (the greedy rule: vt's sampler, and every `argmax_rows`).
/// An empty row gives 0.
pub fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
}

/// An error when `logits` hold a NaN or an infinity: a broken model or checkpoint must fail the
/// request, not pass for a token (an all-NaN row's argmax is 0).
pub fn check_finite(logits: &[f32]) -> Result<()> {
    match logits.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(crate::Error::NonFinite(format!("logit {} at vocabulary index {i}: {BROKEN}", logits[i]))),
    }
}

/// Why logits are not finite, as the errors say it.
const BROKEN: &str = "the weights or the configuration are broken";

/// The error for a row `Device::argmax_rows` found not finite (it reads back only the flag).
pub fn non_finite_row() -> crate::Error {
    crate::Error::NonFinite(format!("a logit is NaN or infinite: {BROKEN}"))
}

/// `Ops::concat_rows` through the host.
pub fn concat_rows<B: Device>(b: &B, parts: &[&Tensor<B>]) -> Result<Tensor<B>> {
    let width = parts.first().map_or(0, |p| p.last_dim());
    if let Some(p) = parts.iter().find(|p| p.last_dim() != width) {
        return Err(crate::Error::backend(
            b.name(),
            format!("concat_rows: width {} differs from {width}", p.last_dim()),
        ));
    }
    let mut data = Vec::new();
    for p in parts {
        data.extend(b.to_f32(p)?);
    }
    b.from_f32(&[data.len() / width.max(1), width], &data)
}

/// `FusedOps::embed_argmax`: the picks read back, then their rows.
pub fn embed_argmax<B: Ops>(b: &B, table: &Tensor<B>, logits: &Tensor<B>) -> Result<Tensor<B>> {
    check::embed_argmax(b, table, logits)?;
    let ids: Vec<u32> = b.argmax_rows(logits, None)?.iter().map(|p| p.id).collect();
    b.embedding(table, &ids)
}

/// `FusedOps::linear_many`: one `linear` per weight.
pub fn linear_many<B: Ops>(b: &B, x: &Tensor<B>, ws: &[&Linear<B>]) -> Result<Vec<Tensor<B>>> {
    ws.iter().map(|w| b.linear(x, w)).collect()
}

/// `FusedOps::add_rms_norm`: `add`, then `rms_norm`.
pub fn add_rms_norm<B: Ops>(
    b: &B,
    x: &Tensor<B>,
    y: &Tensor<B>,
    w: &Tensor<B>,
    eps: f32,
    kind: NormKind,
) -> Result<(Tensor<B>, Tensor<B>)> {
    let sum = b.add(x, y)?;
    let normed = b.rms_norm(&sum, w, eps, kind)?;
    Ok((sum, normed))
}

/// `FusedOps::moe_block` from the primitive ops.
pub fn moe_block<B: FusedOps>(
    b: &B,
    x: &Tensor<B>,
    router: &Router<B>,
    experts: &MoeExperts<B>,
    shared: Option<&SharedExpert<'_, B>>,
) -> Result<Tensor<B>> {
    let routed = b.moe(x, router, experts)?;
    match shared {
        Some(s) => add_shared_expert(b, x, &routed, s),
        None => Ok(routed),
    }
}

/// `routed` plus the shared expert `s` of `x`: the SwiGLU of its gate and up projections (read in
/// one `linear_many` with its gate row) through its down projection, times its sigmoid gate where
/// it has one.
pub fn add_shared_expert<B: FusedOps>(
    b: &B,
    x: &Tensor<B>,
    routed: &Tensor<B>,
    s: &SharedExpert<'_, B>,
) -> Result<Tensor<B>> {
    let inputs: Vec<&Linear<B>> = [s.gate, s.up].into_iter().chain(s.gate_proj).collect();
    let proj = b.linear_many(x, &inputs)?;
    let mut y = b.linear(&b.swiglu(&proj[0], &proj[1])?, s.down)?;
    if let Some(g) = proj.get(2) {
        y = b.gate(&y, g, GateAct::Sigmoid)?;
    }
    b.add(routed, &y)
}

/// Sequence `i`'s part of `x`, whose first dimension is `n` sequences, as `[1, ..]`; `None` where
/// `x` is all of it (`n` = 1).
fn seq_part<B: Ops>(b: &B, x: &Tensor<B>, i: usize, n: usize) -> Result<Option<Tensor<B>>> {
    if n == 1 {
        return Ok(None);
    }
    let per = x.rows() / n;
    let mut shape = x.shape().to_vec();
    shape[0] = 1;
    Ok(Some(b.slice_rows(x, i * per, per)?.reshape(&shape)?))
}

/// Whether every tensor's first dimension is `n` (a part per sequence).
fn per_seq<B: Device>(n: usize, ts: &[&Tensor<B>]) -> bool {
    n > 0 && ts.iter().all(|t| t.shape().first() == Some(&n))
}

/// `FusedOps::gated_delta_step` from the primitive ops, a sequence at a time.
pub fn gated_delta_step<B: Ops>(b: &B, s: &GdnStep<'_, B>, states: &mut [GdnState<'_, B>]) -> Result<Tensor<B>> {
    let op = "gated_delta_step";
    let n = states.len();
    if !per_seq(n, &[s.qkv, s.a, s.b]) {
        return Err(crate::Error::input(format!(
            "{op}: {n} sequences with qkv {:?}, a {:?}, b {:?} (a row each)",
            s.qkv.shape(),
            s.a.shape(),
            s.b.shape()
        )));
    }
    let key_total = s.key_heads * s.key_dim;
    let parts = states
        .iter_mut()
        .enumerate()
        .map(|(i, st)| {
            let (x, a, beta) = (seq_part(b, s.qkv, i, n)?, seq_part(b, s.a, i, n)?, seq_part(b, s.b, i, n)?);
            let (x, a, beta) = (x.as_ref().unwrap_or(s.qkv), a.as_ref().unwrap_or(s.a), beta.as_ref().unwrap_or(s.b));
            let qkv = b.causal_conv1d(x, s.conv, st.conv)?;
            let q = b.narrow_cols(&qkv, 0, key_total)?.reshape(&[1, s.key_heads, s.key_dim])?;
            let k = b.narrow_cols(&qkv, key_total, key_total)?.reshape(&[1, s.key_heads, s.key_dim])?;
            let v = b.narrow_cols(&qkv, 2 * key_total, s.value_heads * s.value_dim)?.reshape(&[
                1,
                s.value_heads,
                s.value_dim,
            ])?;
            let inputs = GdnInputs { q: &q, k: &k, v: &v, a, b: beta, a_log: s.a_log, dt_bias: s.dt_bias };
            b.gated_delta_rule(&inputs, st.recurrent, GdnMode::Recurrent)
        })
        .collect::<Result<Vec<_>>>()?;
    stack_rows(b, parts)
}

/// `FusedOps::gated_delta_waves` as a call of `step` (a `gated_delta_step`) per wave, the states
/// copied to `firsts` after the first.
pub fn gated_delta_waves<'s, B: Ops>(
    b: &B,
    s: &GdnStep<'_, B>,
    waves: &[usize],
    states: &mut [GdnState<'s, B>],
    firsts: &mut [Option<GdnState<'_, B>>],
    mut step: impl FnMut(&GdnStep<'_, B>, &mut [GdnState<'s, B>]) -> Result<Tensor<B>>,
) -> Result<Tensor<B>> {
    check::gdn_waves(b, waves, states, firsts, s)?;
    let mut parts = Vec::with_capacity(waves.len());
    let mut row = 0;
    for (j, &n) in waves.iter().enumerate() {
        parts.push(match waves {
            [_] => step(s, states)?,
            _ => {
                let (qkv, a, beta) =
                    (b.slice_rows(s.qkv, row, n)?, b.slice_rows(s.a, row, n)?, b.slice_rows(s.b, row, n)?);
                step(&GdnStep { qkv: &qkv, a: &a, b: &beta, ..*s }, &mut states[..n])?
            }
        });
        if j == 0 {
            // Copies a recorder keeps (`copy_many` may stage a table it cannot).
            for (st, f) in states.iter().zip(firsts.iter_mut()) {
                if let Some(f) = f {
                    b.copy_into(st.conv, f.conv)?;
                    b.copy_into(st.recurrent, f.recurrent)?;
                }
            }
        }
        row += n;
    }
    stack_rows(b, parts)
}

/// `FusedOps::attention_decode` from `rope` and `attention`, a sequence at a time.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode<B: KvOps>(
    b: &B,
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    rope: &Rope,
    pool: &mut B::KvPool,
    seqs: &[KvSeq<'_>],
    params: &AttentionParams,
) -> Result<Tensor<B>> {
    let op = "attention_decode";
    let n = seqs.len();
    if !per_seq(n, &[q, k, v]) || seqs.iter().any(|s| s.layer != seqs[0].layer) {
        return Err(crate::Error::input(format!(
            "{op}: {n} sequences, q {:?}, k {:?}, v {:?} (a row each, one pool layer)",
            q.shape(),
            k.shape(),
            v.shape()
        )));
    }
    let parts = seqs
        .iter()
        .enumerate()
        .map(|(i, seq)| {
            let (qi, ki, vi) = (seq_part(b, q, i, n)?, seq_part(b, k, i, n)?, seq_part(b, v, i, n)?);
            let qi = b.rope(qi.as_ref().unwrap_or(q), seq.start, rope)?;
            let ki = b.rope(ki.as_ref().unwrap_or(k), seq.start, rope)?;
            b.attention(&qi, &ki, vi.as_ref().unwrap_or(v), pool, *seq, params)
        })
        .collect::<Result<Vec<_>>>()?;
    stack_rows(b, parts)
}

/// `parts` (`[rows_i, width]`) stacked by rows: the one part itself, uncopied, or `concat_rows`.
pub fn stack_rows<B: Ops>(b: &B, mut parts: Vec<Tensor<B>>) -> Result<Tensor<B>> {
    match parts.len() {
        1 => parts.pop().ok_or_else(|| crate::Error::input("no rows to stack")),
        _ => b.concat_rows(&parts.iter().collect::<Vec<_>>()),
    }
}

#[cfg(test)]
mod tests {
    use super::{argmax, masked_argmax};

    #[test]
    fn argmax_takes_the_first_largest_and_skips_nan_after_the_first_value() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[-inf, -inf, -inf]), 0);
        assert_eq!(argmax(&[-inf, -1.0, -inf]), 1);
        assert_eq!(argmax(&[0.5, nan, 0.7, nan]), 2);
        assert_eq!(argmax(&[nan, 5.0, 9.0]), 0);
        assert_eq!(argmax(&[2.0, inf, inf]), 1);
        assert_eq!(argmax(&[]), 0);
    }

    /// A masked row's pick is `argmax` of the row with the disallowed tokens at -inf, as the
    /// host path (`TokenMask::apply`, then the sampler) picks it; bits past word 0 count.
    #[test]
    fn masked_argmax_is_argmax_with_disallowed_tokens_at_minus_inf() {
        let nan = f32::NAN;
        let mut row: Vec<f32> = (0..40).map(|i| (i % 7) as f32).collect();
        row[3] = nan;
        for allowed in [[u32::MAX, u32::MAX], [0b1010, 0], [0, 1 << 5], [1 << 3 | 1 << 9, 0], [0, 0]] {
            let masked: Vec<f32> = (0..row.len())
                .map(|i| if allowed[i / 32] >> (i % 32) & 1 == 1 { row[i] } else { f32::NEG_INFINITY })
                .collect();
            assert_eq!(masked_argmax(&row, &allowed), argmax(&masked), "{allowed:?}");
        }
        assert_eq!(masked_argmax(&row, &[0, 1 << 5]), 37);
    }
}
