//! The dense SwiGLU feed-forward block (dense layers, and the MoE block's shared expert).

use std::ops::Range;

use vt_core::{Backend, Linear, Result, Tensor};

use super::layer::linear_bytes;
use crate::loader::Loader;
use crate::split::Shard;

pub(super) struct Mlp<B: Backend> {
    pub(super) gate: Linear<B>,
    pub(super) up: Linear<B>,
    pub(super) down: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// `gate_proj`, `up_proj` and `down_proj` under `p`, `h` wide with `inter` hidden units, of
    /// which `shard` holds `hidden_units` (rows of gate and up, columns of down); `None` where that
    /// is none of them (fewer units than ranks: the rank adds nothing to the block).
    pub(super) fn load(ld: &Loader<B>, p: &str, h: usize, inter: usize, shard: &Shard) -> Result<Option<Self>> {
        let part = hidden_units(ld, shard, inter);
        if part.is_empty() {
            return Ok(None);
        }
        let rows = |name: &str| ld.linear_rows(&format!("{p}.{name}"), [inter, h], std::slice::from_ref(&part));
        Ok(Some(Mlp {
            gate: rows("gate_proj")?,
            up: rows("up_proj")?,
            down: ld.linear_cols(&format!("{p}.down_proj"), [h, inter], part.clone())?,
        }))
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

/// `shard`'s part of a feed-forward block's `inter` hidden units: an even split of the units a cut
/// can fall between (`Loader::split_unit`: NVFP4 groups, FP8 blocks), the last one possibly short.
pub(super) fn hidden_units<B: Backend>(ld: &Loader<B>, shard: &Shard, inter: usize) -> Range<usize> {
    let unit = ld.split_unit().max(1);
    let r = shard.even(inter.div_ceil(unit));
    (r.start * unit).min(inter)..(r.end * unit).min(inter)
}
