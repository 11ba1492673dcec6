//! The sparse MoE block: router, routed experts and the optional (sigmoid-gated) shared expert.

use vt_core::{Backend, Error, GateAct, Linear, MoeExperts, Result, Router, Tensor};

use super::layer::linear_bytes;
use super::mlp::{hidden_units, Mlp};
use crate::loader::Loader;
use crate::spec::{MoeSpec, SharedExpert};
use crate::split::Shard;

pub(super) struct MoeBlock<B: Backend> {
    router: Router<B>,
    /// `None` on a tensor-parallel rank that holds none of the experts' hidden units.
    pub(super) experts: Option<MoeExperts<B>>,
    shared: Option<Mlp<B>>,
    shared_gate: Option<Linear<B>>,
}

impl<B: Backend> MoeBlock<B> {
    /// The `mlp` module at `p` (a layer's `{prefix}.mlp`) of a model of width `h`: the router
    /// whole, `shard`'s part of the routed experts (its experts whole under expert parallelism,
    /// else its hidden units of every expert) and its hidden units of the shared expert.
    pub(super) fn load(ld: &Loader<B>, m: &MoeSpec, p: &str, h: usize, shard: &Shard) -> Result<Self> {
        let correction_bias = if m.correction_bias {
            let names = [format!("{p}.experts.e_score_correction_bias"), format!("{p}.gate.e_score_correction_bias")];
            let name = names
                .iter()
                .find(|n| ld.has(n))
                .ok_or_else(|| Error::MissingTensor { name: names.join(" or "), dir: ld.ckpt.dir.clone() })?;
            Some(ld.float(name, &[m.num_experts])?)
        } else {
            None
        };
        let router = Router {
            weight: ld.linear(&format!("{p}.gate"), m.num_experts, h)?,
            kind: m.router.clone(),
            correction_bias,
        };
        let (ids, part) = match shard.expert_parallel {
            true => (shard.even(m.num_experts), 0..m.intermediate),
            false => (0..m.num_experts, hidden_units(ld, shard, m.intermediate)),
        };
        let dims = [m.num_experts, h, m.intermediate];
        let experts = (!ids.is_empty() && !part.is_empty())
            .then(|| ld.experts(&format!("{p}.experts"), dims, ids, part))
            .transpose()?;
        let (shared, shared_gate) = match m.shared {
            SharedExpert::None => (None, None),
            SharedExpert::Plain { intermediate } | SharedExpert::SigmoidGated { intermediate } => {
                let singular = format!("{p}.shared_expert");
                let plural = format!("{p}.shared_experts");
                let base = first_present(ld, &[singular.as_str(), plural.as_str()], ".gate_proj.weight")
                    .unwrap_or(singular.as_str())
                    .to_string();
                let shared = Mlp::load(ld, &base, h, intermediate, shard)?;
                let gate = match m.shared {
                    SharedExpert::SigmoidGated { .. } if shared.is_some() => {
                        Some(ld.linear(&format!("{p}.shared_expert_gate"), 1, h)?)
                    }
                    _ => None,
                };
                (shared, gate)
            }
        };
        Ok(MoeBlock { router, experts, shared, shared_gate })
    }

    /// Bytes of weights one token reads: the router, the routed top-k experts and the shared
    /// expert.
    pub(super) fn weight_bytes(&self) -> usize {
        let expert = (self.experts.iter().flat_map(|x| x.experts.first()))
            .map(|e| e.gate.resident_bytes() + e.up.resident_bytes() + e.down.resident_bytes())
            .sum::<usize>();
        linear_bytes(&self.router.weight)
            + self.router.kind.top_k() * expert
            + self.shared.as_ref().map_or(0, Mlp::weight_bytes)
            + self.shared_gate.as_ref().map_or(0, linear_bytes)
    }

    pub(super) fn forward(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
        let shared = self.shared.as_ref().map(|s| vt_core::SharedExpert {
            gate: &s.gate,
            up: &s.up,
            down: &s.down,
            gate_proj: self.shared_gate.as_ref(),
        });
        match (&self.experts, &self.shared) {
            (Some(experts), _) => b.moe_block(x, &self.router, experts, shared.as_ref()),
            // A rank with no part of the routed experts: its part of the shared expert, or nothing.
            (None, Some(s)) => {
                let y = s.forward(b, x)?;
                match &self.shared_gate {
                    Some(g) => b.gate(&y, &b.linear(x, g)?, GateAct::Sigmoid),
                    None => Ok(y),
                }
            }
            (None, None) => b.zeros(x.shape()),
        }
    }
}

/// The first of `candidates` present in the checkpoint (name variants seen in the wild).
fn first_present<'n, B: Backend>(ld: &Loader<B>, candidates: &[&'n str], probe: &str) -> Option<&'n str> {
    candidates.iter().copied().find(|c| ld.has(&format!("{c}{probe}")))
}
