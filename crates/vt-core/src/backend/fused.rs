//! Fused ops: steps made of primitive ops that a backend may run as fewer, faster launches. Each
//! has a composed default in `composed.rs`, so a new backend can leave them all out.

use super::{composed, AttentionParams, KvOps, KvSeq, NormKind, Rope};
use crate::tensor::Tensor;
use crate::weights::{Linear, MoeExperts, Router};
use crate::Result;

/// One decode token of a Gated DeltaNet mixer for each of `n` sequences: its convolution step and
/// the gated delta rule.
pub struct GdnStep<'a, B: super::Device> {
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
pub struct GdnState<'a, B: super::Device> {
    /// The convolution's previous inputs, `[channels, kernel - 1]` in `activation_dtype`.
    pub conv: &'a mut Tensor<B>,
    /// The recurrent state, f32 `[value_heads, key_dim, value_dim]`.
    pub recurrent: &'a mut Tensor<B>,
}

/// The shared expert of an MoE block: SwiGLU `down(silu(gate x) * up x)`, times
/// `sigmoid(gate_proj x)` where the model gates it.
pub struct SharedExpert<'a, B: super::Device> {
    pub gate: &'a Linear<B>,
    pub up: &'a Linear<B>,
    pub down: &'a Linear<B>,
    /// `[1, hidden]`.
    pub gate_proj: Option<&'a Linear<B>>,
}

pub trait FusedOps: KvOps {
    /// `linear(x, w)` for each of `ws`: projections that read one input (a backend may stream
    /// them in one pass).
    fn linear_many(&self, x: &Tensor<Self>, ws: &[&Linear<Self>]) -> Result<Vec<Tensor<Self>>> {
        composed::linear_many(self, x, ws)
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
        composed::add_rms_norm(self, x, y, w, eps, kind)
    }

    /// A whole MoE block: routed experts plus the shared expert, if any.
    fn moe_block(
        &self,
        x: &Tensor<Self>,
        router: &Router<Self>,
        experts: &MoeExperts<Self>,
        shared: Option<&SharedExpert<'_, Self>>,
    ) -> Result<Tensor<Self>> {
        composed::moe_block(self, x, router, experts, shared)
    }

    /// The `table` rows `[vocab, hidden]` of each row's greedy pick of `logits` `[rows, n]`
    /// (`argmax_rows` without masks; `n` at most `vocab`) -> `[rows, hidden]`: the next input of
    /// a chain of greedy drafts, picked where the logits are, so the chain reads no picks back
    /// between its steps.
    fn embed_argmax(&self, table: &Tensor<Self>, logits: &Tensor<Self>) -> Result<Tensor<Self>> {
        composed::embed_argmax(self, table, logits)
    }

    /// One decode token of a Gated DeltaNet mixer for each of `states.len()` sequences (row `i`
    /// of `step`'s inputs is sequence `i`'s): the convolution step (updating `states[i].conv`)
    /// and the recurrent gated delta rule (updating `states[i].recurrent`) ->
    /// `[n, value_heads, value_dim]`.
    fn gated_delta_step(&self, step: &GdnStep<'_, Self>, states: &mut [GdnState<'_, Self>]) -> Result<Tensor<Self>> {
        composed::gated_delta_step(self, step, states)
    }

    /// Several single-token steps of each sequence in one call (a verification's positions):
    /// `waves[j]` sequences, the first `waves[j]` of `states`, step at their `j`-th position
    /// (`waves` non-increasing, `waves[0] == states.len()`), wave after wave. `step`'s rows are
    /// the waves' rows in order (wave 0's `waves[0]` rows, then wave 1's, ...), and each computes
    /// exactly what `gated_delta_step` there would -> `[rows, value_heads, value_dim]`. `firsts`
    /// is empty or holds an entry per sequence: where it is `Some`, the sequence's states after
    /// its first position are also written there, exactly (what a verification rolls back to when
    /// it keeps only that position).
    fn gated_delta_waves(
        &self,
        step: &GdnStep<'_, Self>,
        waves: &[usize],
        states: &mut [GdnState<'_, Self>],
        firsts: &mut [Option<GdnState<'_, Self>>],
    ) -> Result<Tensor<Self>> {
        composed::gated_delta_waves(self, step, waves, states, firsts, |s, st| self.gated_delta_step(s, st))
    }

    /// Attention of one new token for each of `seqs.len()` rows in one pool layer (the same
    /// `layer` in each): row `i` of `q` `[n, q_heads, head_dim]` and of `k`, `v` `[n, kv_heads,
    /// head_dim]` sits at position `seqs[i].start`. Rotates q and k at those positions (`rope`),
    /// then writes and attends as `attention` does for each row in turn -> `[n, q_heads,
    /// head_dim]`. Rows may be one sequence's consecutive positions (a verification's, given in
    /// position order, with the sequence's table): each sees the ones before it. No two rows may
    /// write one place of the pool.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        rope: &Rope,
        pool: &mut Self::KvPool,
        seqs: &[KvSeq<'_>],
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        composed::attention_decode(self, q, k, v, rope, pool, seqs, params)
    }
}
