//! Primitive ops: what a model graph is made of, each a single call a backend must provide.
//! Activations are contiguous row-major tensors of `activation_dtype()`.

use super::Device;
use crate::tensor::Tensor;
use crate::weights::{Linear, MoeExperts, Router};
use crate::Result;

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

/// Inputs of the gated delta rule for `t` tokens.
pub struct GdnInputs<'a, B: Device> {
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

/// Shapes of one gated-delta-rule call (a single sequence), as `GdnInputs::dims` (check.rs) finds them.
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnMode {
    /// Chunked (WY) form, for prefill.
    Chunked,
    /// One token at a time, for decode.
    Recurrent,
}

pub trait Ops: Device {
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
        super::composed::concat_rows(self, parts)
    }
    /// Rotary embedding of `x` `[t, heads, head_dim]` for positions `start..start+t`.
    fn rope(&self, x: &Tensor<Self>, start: usize, rope: &Rope) -> Result<Tensor<Self>>;

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
    /// Builds now, in `experts.resident`, the state this backend's MoE ops derive from the experts
    /// for a single-token step (their first call would build it): a recorder cannot build it, so
    /// it must be built before a step is recorded. Default: nothing is derived.
    fn prepare_experts(&self, experts: &MoeExperts<Self>) -> Result<()> {
        let _ = experts;
        Ok(())
    }
}
