//! One decoder layer: a mixer (attention or Gated DeltaNet) and a feed-forward block (dense or
//! MoE), each behind its RMSNorm; the config's `layer_types` and MoE frequency pick the kinds.

use vt_core::{Backend, Linear, Result, Tensor};

use super::attention::Attention;
use super::delta_net::DeltaNet;
use super::mlp::Mlp;
use super::moe::MoeBlock;
use crate::loader::Loader;
use crate::spec::{FfnSpec, LayerSpec, MixerSpec};
use crate::split::Shard;

pub(super) enum Mixer<B: Backend> {
    Attention(Attention<B>),
    DeltaNet(DeltaNet<B>),
}

// One per layer, never moved after loading: the larger MoE variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub(super) enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Moe(MoeBlock<B>),
    /// A tensor-parallel rank that holds none of a dense block's hidden units: adds nothing.
    Idle,
}

pub(super) struct Layer<B: Backend> {
    pub(super) input_norm: Tensor<B>,
    pub(super) mixer: Mixer<B>,
    pub(super) post_norm: Tensor<B>,
    pub(super) ffn: Ffn<B>,
}

impl<B: Backend> Layer<B> {
    /// The layer at prefix `p` (`{model prefix}layers.{i}`) of a model of width `h`, as much of
    /// it as `shard` holds.
    pub(super) fn load(ld: &Loader<B>, ls: &LayerSpec, p: &str, h: usize, shard: &Shard) -> Result<Self> {
        let mixer = match &ls.mixer {
            MixerSpec::Attention(s) => Mixer::Attention(Attention::load(ld, s, p, h, shard)?),
            MixerSpec::DeltaNet(s) => Mixer::DeltaNet(DeltaNet::load(ld, s, p, h, shard)?),
        };
        let ffn = match &ls.ffn {
            FfnSpec::Dense { intermediate } => {
                Mlp::load(ld, &format!("{p}.mlp"), h, *intermediate, shard)?.map_or(Ffn::Idle, Ffn::Dense)
            }
            FfnSpec::Moe(m) => Ffn::Moe(MoeBlock::load(ld, m, &format!("{p}.mlp"), h, shard)?),
        };
        Ok(Layer {
            input_norm: ld.float(&format!("{p}.input_layernorm.weight"), &[h])?,
            mixer,
            post_norm: ld.float(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            ffn,
        })
    }

    /// Bytes of weights one decode token reads.
    pub(super) fn weight_bytes(&self) -> usize {
        let mixer = match &self.mixer {
            Mixer::Attention(a) => a.weight_bytes(),
            Mixer::DeltaNet(d) => d.weight_bytes(),
        };
        let ffn = match &self.ffn {
            Ffn::Dense(m) => m.weight_bytes(),
            Ffn::Moe(m) => m.weight_bytes(),
            Ffn::Idle => 0,
        };
        tensor_bytes(&self.input_norm) + tensor_bytes(&self.post_norm) + mixer + ffn
    }
}

impl<B: Backend> Ffn<B> {
    pub(super) fn forward(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
        match self {
            Ffn::Dense(m) => m.forward(b, x),
            Ffn::Moe(m) => m.forward(b, x),
            Ffn::Idle => b.zeros(x.shape()),
        }
    }
}

/// Bytes a tensor's values take.
pub(super) fn tensor_bytes<B: Backend>(t: &Tensor<B>) -> usize {
    t.dtype().bytes_for(t.numel()).unwrap_or(0)
}

/// Bytes a linear layer's weight takes where it lives.
pub(super) fn linear_bytes<B: Backend>(l: &Linear<B>) -> usize {
    l.weight.resident_bytes()
}
