//! The dense SwiGLU feed-forward block (dense layers, and the MoE block's shared expert).

use vt_core::{Backend, Linear, Result, Tensor};

use super::layer::linear_bytes;
use crate::loader::Loader;

pub(super) struct Mlp<B: Backend> {
    pub(super) gate: Linear<B>,
    pub(super) up: Linear<B>,
    pub(super) down: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// `gate_proj`, `up_proj` and `down_proj` under `p`, `h` wide with `inter` hidden units.
    pub(super) fn load(ld: &Loader<B>, p: &str, h: usize, inter: usize) -> Result<Self> {
        Ok(Mlp {
            gate: ld.linear(&format!("{p}.gate_proj"), inter, h)?,
            up: ld.linear(&format!("{p}.up_proj"), inter, h)?,
            down: ld.linear(&format!("{p}.down_proj"), h, inter)?,
        })
    }

    /// Bytes of weights one token reads.
    pub(super) fn weight_bytes(&self) -> usize {
        linear_bytes(&self.gate) + linear_bytes(&self.up) + linear_bytes(&self.down)
    }

    /// `down(silu(gate x) * up x)`.
    pub(super) fn forward(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
        let act = b.swiglu(&b.linear(x, &self.gate)?, &b.linear(x, &self.up)?)?;
        b.linear(&act, &self.down)
    }
}
