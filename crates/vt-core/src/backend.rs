//! The Backend trait: memory, transfers and every op the model graphs need.
//!
//! Activations are contiguous row-major tensors of `activation_dtype()` (f32 on the CPU reference).
//! Composite, performance-critical steps (attention with its cache, the gated delta rule, the MoE
//! block) are single methods so a backend can fuse them; vt-cpu's versions are the reference.
//! Every op checks its shapes and returns an `Error` naming the mismatch, never panics.

use crate::tensor::Tensor;
use crate::weights::{Linear, MoeExperts, Router};
use crate::{DType, Result};

/// Memory a backend instance has handed out and not yet been given back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub bytes_live: usize,
    pub blocks_live: usize,
    pub peak_bytes: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `x / rms(x) * w`.
    Plain,
    /// `x / rms(x) * (1 + w)` (Qwen3.5's zero-centred norm weights).
    UnitOffset,
}

impl NormKind {
    /// What is added to the weight before it scales the normalised value.
    pub fn weight_offset(self) -> f32 {
        match self {
            NormKind::Plain => 0.0,
            NormKind::UnitOffset => 1.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateAct {
    Sigmoid,
    Softplus,
}

/// Rotary embedding over the first `rotary_dim` features of each head, NeoX layout (halves).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// `rotary_dim / 2` inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_scaling: f32,
}

impl Rope {
    pub fn rotary_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct AttentionParams {
    pub scale: f32,
    /// Sliding window: a query at position p sees keys at positions `p - window < j <= p`.
    pub window: Option<usize>,
}

/// Inputs of the gated delta rule for `t` tokens.
pub struct GdnInputs<'a, B: Backend> {
    /// `[t, key_heads, key_dim]`, not yet l2-normalised.
    pub q: &'a Tensor<B>,
    /// `[t, key_heads, key_dim]`, not yet l2-normalised.
    pub k: &'a Tensor<B>,
    /// `[t, value_heads, value_dim]`.
    pub v: &'a Tensor<B>,
    /// `[t, value_heads]`: decay input, `g = -exp(a_log) * softplus(a + dt_bias)`.
    pub a: &'a Tensor<B>,
    /// `[t, value_heads]`: `beta = sigmoid(b)`.
    pub b: &'a Tensor<B>,
    /// `[value_heads]`.
    pub a_log: &'a Tensor<B>,
    /// `[value_heads]`.
    pub dt_bias: &'a Tensor<B>,
}

/// One decode token of a Gated DeltaNet mixer for each of `n` sequences: its convolution step and
/// the gated delta rule.
pub struct GdnStep<'a, B: Backend> {
    /// `[n, 2 * key_heads * key_dim + value_heads * value_dim]`: the q, k and v channels before
    /// the convolution, a row per sequence.
    pub qkv: &'a Tensor<B>,
    /// Depthwise convolution weight `[channels, kernel]`.
    pub conv: &'a Tensor<B>,
    /// `[n, value_heads]`, `[n, value_heads]`, `[value_heads]`, `[value_heads]`: as in `GdnInputs`.
    pub a: &'a Tensor<B>,
    pub b: &'a Tensor<B>,
    pub a_log: &'a Tensor<B>,
    pub dt_bias: &'a Tensor<B>,
    pub key_heads: usize,
    pub key_dim: usize,
    pub value_heads: usize,
    pub value_dim: usize,
}

/// One sequence's Gated DeltaNet state.
pub struct GdnState<'a, B: Backend> {
    /// The convolution's previous inputs, `[channels, kernel - 1]` in `activation_dtype`.
    pub conv: &'a mut Tensor<B>,
    /// The recurrent state, f32 `[value_heads, key_dim, value_dim]`.
    pub recurrent: &'a mut Tensor<B>,
}

/// The shared expert of an MoE block: SwiGLU `down(silu(gate x) * up x)`, times
/// `sigmoid(gate_proj x)` where the model gates it.
pub struct SharedExpert<'a, B: Backend> {
    pub gate: &'a Linear<B>,
    pub up: &'a Linear<B>,
    pub down: &'a Linear<B>,
    /// `[1, hidden]`.
    pub gate_proj: Option<&'a Linear<B>>,
}

/// Shapes of one gated-delta-rule call (a single sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    /// Tokens in this call.
    pub t: usize,
    /// Query/key heads (`linear_num_key_heads`).
    pub key_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of `key_heads`.
    pub value_heads: usize,
    /// Query/key head dimension (`linear_key_head_dim`).
    pub key_dim: usize,
    /// Value head dimension (`linear_value_head_dim`).
    pub value_dim: usize,
}

impl<B: Backend> GdnInputs<'_, B> {
    /// The call's shapes, after checking every input against each other and against `state`
    /// (f32 `[value_heads, key_dim, value_dim]`); the error names every shape involved.
    pub fn dims(&self, state: &Tensor<B>, backend: &'static str) -> Result<GdnDims> {
        let bad = || {
            crate::Error::backend(
                backend,
                format!(
                    "gated_delta_rule: q {:?}, k {:?}, v {:?}, a {:?}, b {:?}, a_log {:?}, dt_bias {:?}, state {} {:?}",
                    self.q.shape(),
                    self.k.shape(),
                    self.v.shape(),
                    self.a.shape(),
                    self.b.shape(),
                    self.a_log.shape(),
                    self.dt_bias.shape(),
                    state.dtype(),
                    state.shape()
                ),
            )
        };
        let (&[t, key_heads, key_dim], &[tv, value_heads, value_dim]) = (self.q.shape(), self.v.shape()) else {
            return Err(bad());
        };
        let ok = self.k.shape() == self.q.shape()
            && tv == t
            && key_heads > 0
            && value_heads % key_heads == 0
            && self.a.numel() == t * value_heads
            && self.b.numel() == t * value_heads
            && self.a_log.numel() == value_heads
            && self.dt_bias.numel() == value_heads
            && state.shape() == [value_heads, key_dim, value_dim]
            && state.dtype() == DType::F32;
        if !ok {
            return Err(bad());
        }
        Ok(GdnDims { t, key_heads, value_heads, key_dim, value_dim })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnMode {
    /// Chunked (WY) form, for prefill.
    Chunked,
    /// One token at a time, for decode.
    Recurrent,
}

pub trait Backend: Clone + Send + Sync + Sized + 'static {
    type Buffer: Send + Sync + 'static;
    /// Key/value cache of one attention layer for one sequence.
    type KvCache: Send + Sync + 'static;
    /// A recorded decode step that can run again (a CUDA graph); `()` where steps are not recorded.
    type StepGraph: Send + 'static;

    fn name(&self) -> &'static str;
    /// Distinct for every backend instance in the process.
    fn instance_id(&self) -> u64;
    fn activation_dtype(&self) -> DType;
    fn memory(&self) -> MemoryStats;
    /// Address of a buffer's first byte (device address on a GPU).
    fn buffer_addr(&self, buf: &Self::Buffer) -> usize;

    // ---- transfers ----
    /// Copies stored bytes in as they are (weights keep their dtype).
    fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<Self>>;
    /// An activation tensor (of `activation_dtype`) from f32 values.
    #[allow(clippy::wrong_self_convention)] // the backend makes it: `self` is where it lives
    fn from_f32(&self, shape: &[usize], data: &[f32]) -> Result<Tensor<Self>>;
    /// An f32 tensor of zeros (recurrent state).
    fn zeros_f32(&self, shape: &[usize]) -> Result<Tensor<Self>>;
    /// Zeros in `activation_dtype` (convolution state).
    fn zeros(&self, shape: &[usize]) -> Result<Tensor<Self>>;
    /// Sets every element of `t` to zero where it is (a sequence state emptied for reuse keeps
    /// its storage, and so what was recorded over it).
    fn zero(&self, t: &mut Tensor<Self>) -> Result<()>;
    fn to_f32(&self, t: &Tensor<Self>) -> Result<Vec<f32>>;
    /// `argmax` of each row of `x` (greedy decoding's token per row). A backend may pick on the
    /// device and read back only the indices; the default reads the rows back.
    fn argmax_rows(&self, x: &Tensor<Self>) -> Result<Vec<u32>> {
        argmax_rows_composed(self, x)
    }

    // ---- ops ----
    /// Rows of `table` `[vocab, hidden]` for `ids` -> `[ids.len(), hidden]`.
    fn embedding(&self, table: &Tensor<Self>, ids: &[u32]) -> Result<Tensor<Self>>;
    /// RMSNorm over the last dimension, `w` `[last]`.
    fn rms_norm(&self, x: &Tensor<Self>, w: &Tensor<Self>, eps: f32, kind: NormKind) -> Result<Tensor<Self>>;
    /// `rmsnorm(x) * w * silu(z)` over the last dimension (plain `w`).
    fn rms_norm_gated(&self, x: &Tensor<Self>, z: &Tensor<Self>, w: &Tensor<Self>, eps: f32) -> Result<Tensor<Self>>;
    /// `x [.., in] -> [.., out]`.
    fn linear(&self, x: &Tensor<Self>, w: &Linear<Self>) -> Result<Tensor<Self>>;
    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `silu(gate) * up`, elementwise.
    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>>;
    /// `x * act(g)`: `g` has x's element count (per element) or `[rows, groups]` with `x`'s last
    /// dimension a multiple of `groups` (one gate per group of consecutive features).
    fn gate(&self, x: &Tensor<Self>, g: &Tensor<Self>, act: GateAct) -> Result<Tensor<Self>>;
    /// Columns `start..start+len` of `x` viewed as `[rows, last_dim]`.
    fn narrow_cols(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>>;
    /// Rows `start..start+len` of `x` viewed as `[rows, last_dim]`.
    fn slice_rows(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>>;
    /// `parts` (each `[rows_i, width]`) stacked into `[sum rows_i, width]`: how a batched step
    /// gathers per-sequence results. The default round-trips through the host; backends override it.
    fn concat_rows(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        let width = parts.first().map_or(0, |p| p.last_dim());
        if let Some(p) = parts.iter().find(|p| p.last_dim() != width) {
            return Err(crate::Error::backend(
                self.name(),
                format!("concat_rows: width {} differs from {width}", p.last_dim()),
            ));
        }
        let mut data = Vec::new();
        for p in parts {
            data.extend(self.to_f32(p)?);
        }
        self.from_f32(&[data.len() / width.max(1), width], &data)
    }
    /// Rotary embedding of `x` `[t, heads, head_dim]` for positions `start..start+t`.
    fn rope(&self, x: &Tensor<Self>, start: usize, rope: &Rope) -> Result<Tensor<Self>>;

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Result<Self::KvCache>;
    /// Empties `cache` (no positions), as `new_kv_cache` made it except that it may keep its
    /// storage (a recorded step over it then stays valid).
    fn kv_clear(&self, cache: &mut Self::KvCache) -> Result<()>;
    /// Appends `k`, `v` `[t, kv_heads, head_dim]` to `cache`, then causal (optionally windowed)
    /// GQA attention of `q` `[t, q_heads, head_dim]` over everything cached -> `[t, q_heads, head_dim]`.
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        cache: &mut Self::KvCache,
        params: &AttentionParams,
    ) -> Result<Tensor<Self>>;

    /// Depthwise causal conv1d with silu over `x` `[t, channels]`, weight `[channels, kernel]`,
    /// continuing from and updating `state` `[channels, kernel - 1]` (the previous inputs).
    fn causal_conv1d(&self, x: &Tensor<Self>, w: &Tensor<Self>, state: &mut Tensor<Self>) -> Result<Tensor<Self>>;
    /// The gated delta rule with l2-normalised q, k and `1/sqrt(key_dim)` scaling; `state` f32
    /// `[value_heads, key_dim, value_dim]` is read and updated. Value head `h` uses key head
    /// `h / (value_heads / key_heads)`. Returns `[t, value_heads, value_dim]`.
    fn gated_delta_rule(
        &self,
        inputs: &GdnInputs<'_, Self>,
        state: &mut Tensor<Self>,
        mode: GdnMode,
    ) -> Result<Tensor<Self>>;

    /// Routed experts of one MoE layer for `x` `[t, hidden]` (no shared expert).
    fn moe(&self, x: &Tensor<Self>, router: &Router<Self>, experts: &MoeExperts<Self>) -> Result<Tensor<Self>>;

    // ---- composites with a composed default (a backend overrides them to fuse) ----
    /// `linear(x, w)` for each of `ws`: projections that read one input (a backend may stream
    /// them in one pass).
    fn linear_many(&self, x: &Tensor<Self>, ws: &[&Linear<Self>]) -> Result<Vec<Tensor<Self>>> {
        ws.iter().map(|w| self.linear(x, w)).collect()
    }

    /// `x + y` and its RMSNorm: a residual update and the norm that follows it.
    fn add_rms_norm(
        &self,
        x: &Tensor<Self>,
        y: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        kind: NormKind,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let sum = self.add(x, y)?;
        let normed = self.rms_norm(&sum, w, eps, kind)?;
        Ok((sum, normed))
    }

    /// A whole MoE block: routed experts plus the shared expert, if any.
    fn moe_block(
        &self,
        x: &Tensor<Self>,
        router: &Router<Self>,
        experts: &MoeExperts<Self>,
        shared: Option<&SharedExpert<'_, Self>>,
    ) -> Result<Tensor<Self>> {
        moe_block_composed(self, x, router, experts, shared)
    }

    /// One decode token of a Gated DeltaNet mixer for each of `states.len()` sequences (row `i`
    /// of `step`'s inputs is sequence `i`'s): the convolution step (updating `states[i].conv`)
    /// and the recurrent gated delta rule (updating `states[i].recurrent`) ->
    /// `[n, value_heads, value_dim]`.
    fn gated_delta_step(&self, step: &GdnStep<'_, Self>, states: &mut [GdnState<'_, Self>]) -> Result<Tensor<Self>> {
        gated_delta_step_composed(self, step, states)
    }

    /// Attention of one new token for each of `caches.len()` sequences: row `i` of `q`
    /// `[n, q_heads, head_dim]` and of `k`, `v` `[n, kv_heads, head_dim]` sits at position
    /// `positions[i]`, the length of `caches[i]`. Rotates q and k at those positions (`rope`),
    /// appends k and v to each cache and attends as `attention` does -> `[n, q_heads, head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        rope: &Rope,
        positions: &[usize],
        caches: &mut [&mut Self::KvCache],
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        attention_decode_composed(self, q, k, v, rope, positions, caches, params)
    }

    // ---- recorded decode steps (optional; the model uses them where `recorder` gives one) ----
    /// A backend that records the ops queued on it, instead of running them, for one step of `ids`
    /// new tokens at position `pos`: ops read the ids and the position from device memory that
    /// `replay` fills, so the recording runs any later step of that shape. Memory it allocates
    /// belongs to the recording; attention on it leaves the caches' lengths alone (the step has
    /// not run; `replay` advances them). `None` where this backend does not record.
    fn recorder(&self, ids: usize, pos: usize) -> Result<Option<Self>> {
        let _ = (ids, pos);
        Ok(None)
    }
    /// Whether this instance is a recorder (derived weight state must not be built on one).
    fn is_recording(&self) -> bool {
        false
    }
    /// Ends `recorder`'s recording and makes it runnable.
    fn finish_recording(&self, recorder: Self) -> Result<Self::StepGraph> {
        drop(recorder);
        Err(crate::Error::backend(self.name(), "this backend does not record steps"))
    }
    /// Queues a recorded step for `ids` at position `pos` over the attention `caches` it was
    /// recorded with (in the order the step uses them), which it advances as the step does.
    /// `Ok(false)`, with nothing queued, where the recording no longer fits them (a cache's storage
    /// moved or is full): run the step without it.
    fn replay(
        &self,
        graph: &mut Self::StepGraph,
        ids: &[u32],
        pos: usize,
        caches: &mut [&mut Self::KvCache],
    ) -> Result<bool> {
        let _ = (graph, ids, pos, caches);
        Err(crate::Error::backend(self.name(), "this backend does not record steps"))
    }
    /// Moves `cache`'s storage now, if it must, so that it holds `positions` positions without
    /// moving again (before recording, so that replays can follow it for a while).
    fn kv_reserve(&self, cache: &mut Self::KvCache, positions: usize) -> Result<()> {
        let _ = (cache, positions);
        Ok(())
    }

    /// Random contents at `shape` (dummy weights for benchmarks); values as `random::random_bytes`
    /// gives them. The default generates on the host and uploads.
    fn random(&self, dtype: DType, shape: &[usize], seed: u64, scale: f32) -> Result<Tensor<Self>> {
        let bytes = crate::random::random_bytes(dtype, shape.iter().product(), seed, scale)?;
        self.upload(dtype, shape, &bytes)
    }
}

/// `Backend::argmax_rows` from the rows read back (the default, and a device backend's fallback).
pub fn argmax_rows_composed<B: Backend>(b: &B, x: &Tensor<B>) -> Result<Vec<u32>> {
    let width = x.last_dim();
    if width == 0 {
        return Err(crate::Error::input(format!("argmax_rows: rows of no values {:?}", x.shape())));
    }
    Ok(b.to_f32(x)?.chunks(width).map(|row| argmax(row) as u32).collect())
}

/// The index of the largest value of `row`, the first on ties; a NaN never wins, except at index
/// 0, where it is never displaced (the greedy rule: vt's sampler, and every `argmax_rows`).
/// An empty row gives 0.
pub fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
}

/// `Backend::moe_block` from the primitive ops (the default, and a fused backend's fallback).
pub fn moe_block_composed<B: Backend>(
    b: &B,
    x: &Tensor<B>,
    router: &Router<B>,
    experts: &MoeExperts<B>,
    shared: Option<&SharedExpert<'_, B>>,
) -> Result<Tensor<B>> {
    let routed = b.moe(x, router, experts)?;
    let Some(s) = shared else { return Ok(routed) };
    let mut y = b.linear(&b.swiglu(&b.linear(x, s.gate)?, &b.linear(x, s.up)?)?, s.down)?;
    if let Some(g) = s.gate_proj {
        y = b.gate(&y, &b.linear(x, g)?, GateAct::Sigmoid)?;
    }
    b.add(&routed, &y)
}

/// Sequence `i`'s part of `x`, whose first dimension is `n` sequences, as `[1, ..]`; `None` where
/// `x` is all of it (`n` = 1).
fn seq_part<B: Backend>(b: &B, x: &Tensor<B>, i: usize, n: usize) -> Result<Option<Tensor<B>>> {
    if n == 1 {
        return Ok(None);
    }
    let per = x.rows() / n;
    let mut shape = x.shape().to_vec();
    shape[0] = 1;
    Ok(Some(b.slice_rows(x, i * per, per)?.reshape(&shape)?))
}

/// Whether every tensor's first dimension is `n` (a part per sequence).
fn per_seq<B: Backend>(n: usize, ts: &[&Tensor<B>]) -> bool {
    n > 0 && ts.iter().all(|t| t.shape().first() == Some(&n))
}

/// `Backend::gated_delta_step` from the primitive ops, a sequence at a time (the default, and a
/// fused backend's fallback).
pub fn gated_delta_step_composed<B: Backend>(
    b: &B,
    s: &GdnStep<'_, B>,
    states: &mut [GdnState<'_, B>],
) -> Result<Tensor<B>> {
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

/// `Backend::attention_decode` from `rope` and `attention`, a sequence at a time (the default,
/// and a fused backend's fallback).
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_composed<B: Backend>(
    b: &B,
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    rope: &Rope,
    positions: &[usize],
    caches: &mut [&mut B::KvCache],
    params: &AttentionParams,
) -> Result<Tensor<B>> {
    let op = "attention_decode";
    let n = caches.len();
    if positions.len() != n || !per_seq(n, &[q, k, v]) {
        return Err(crate::Error::input(format!(
            "{op}: {n} caches, {} positions, q {:?}, k {:?}, v {:?} (a row each)",
            positions.len(),
            q.shape(),
            k.shape(),
            v.shape()
        )));
    }
    let parts = caches
        .iter_mut()
        .zip(positions)
        .enumerate()
        .map(|(i, (cache, &pos))| {
            let (qi, ki, vi) = (seq_part(b, q, i, n)?, seq_part(b, k, i, n)?, seq_part(b, v, i, n)?);
            let qi = b.rope(qi.as_ref().unwrap_or(q), pos, rope)?;
            let ki = b.rope(ki.as_ref().unwrap_or(k), pos, rope)?;
            b.attention(&qi, &ki, vi.as_ref().unwrap_or(v), cache, params)
        })
        .collect::<Result<Vec<_>>>()?;
    stack_rows(b, parts)
}

/// `parts` (`[rows_i, width]`) stacked by rows: the one part itself, uncopied, or `concat_rows`.
pub fn stack_rows<B: Backend>(b: &B, mut parts: Vec<Tensor<B>>) -> Result<Tensor<B>> {
    match parts.len() {
        1 => parts.pop().ok_or_else(|| crate::Error::input("no rows to stack")),
        _ => b.concat_rows(&parts.iter().collect::<Vec<_>>()),
    }
}

#[cfg(test)]
mod tests {
    use super::argmax;

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
}
