//! Typed weights. Backends implement ops over these, never over a model's layer.
//!
//! Every weight kind that a backend may derive state from (a repacked layout, a table of expert
//! pointers) owns a `ResidentSlot<B>`; see `resident.rs` and docs/lifetime.md.

use crate::backend::Device;
use crate::quant::{self, Fp8Block, Nvfp4, Quantized};
use crate::resident::ResidentSlot;
use crate::tensor::Tensor;
use crate::{DType, Error, Result};

/// A matrix `[out, in]` in its stored form.
pub enum Weight<B: Device> {
    /// bf16, f16 or f32 `[out, in]`.
    Dense(Tensor<B>),
    Nvfp4(Nvfp4<B>),
    Fp8(Fp8Block<B>),
}

/// A weight as format-independent code sees it.
enum Form<'a, B: Device> {
    Dense(&'a Tensor<B>),
    Quantized(&'a dyn Quantized<B>),
}

impl<B: Device> Weight<B> {
    /// Each format is registered here once.
    fn form(&self) -> Form<'_, B> {
        match self {
            Weight::Dense(t) => Form::Dense(t),
            Weight::Nvfp4(q) => Form::Quantized(q),
            Weight::Fp8(q) => Form::Quantized(q),
        }
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        match self.form() {
            Form::Dense(t) => (t.shape()[0], t.shape()[1]),
            Form::Quantized(q) => q.dims(),
        }
    }

    /// The buffer the weight's values live in (a quantized weight's codes): what a slot is keyed to.
    pub fn storage_addr(&self, backend: &B) -> usize {
        let values = match self.form() {
            Form::Dense(t) => t,
            Form::Quantized(q) => q.values(),
        };
        backend.buffer_addr(values.buffer())
    }

    /// Bytes resident for this weight (values and scales for a quantized one).
    pub fn resident_bytes(&self) -> usize {
        match self.form() {
            Form::Dense(t) => quant::bytes(t),
            Form::Quantized(q) => q.resident_bytes(),
        }
    }

    /// Checks a 2-D matrix, and a quantized weight's parts against each other; `name` is for the
    /// error.
    pub fn validate(&self, name: &str) -> Result<()> {
        match self.form() {
            Form::Quantized(q) => q.validate(name),
            Form::Dense(t) if t.shape().len() != 2 || !t.dtype().is_float() || t.dtype() == DType::F8E4M3 => Err(
                Error::tensor(name, format!("expected a 2-D bf16/f16/f32 matrix, found {} {:?}", t.dtype(), t.shape())),
            ),
            Form::Dense(_) => Ok(()),
        }
    }
}

/// A linear layer without bias: `y = x W^T`.
pub struct Linear<B: Device> {
    pub weight: Weight<B>,
    pub resident: ResidentSlot<B>,
}

impl<B: Device> Linear<B> {
    /// Validates the weight first (`Weight::validate`): kernels read codes and scales as the
    /// shapes say, so a malformed quantized weight would send them past its scales.
    pub fn new(backend: &B, weight: Weight<B>) -> Result<Self> {
        weight.validate("linear weight")?;
        let resident = ResidentSlot::new(backend, weight.storage_addr(backend));
        Ok(Linear { weight, resident })
    }

    pub fn out_features(&self) -> usize {
        self.weight.dims().0
    }

    pub fn in_features(&self) -> usize {
        self.weight.dims().1
    }
}

/// One routed expert: SwiGLU `down(silu(gate x) * up x)`.
pub struct Expert<B: Device> {
    /// `[intermediate, hidden]`.
    pub gate: Weight<B>,
    /// `[intermediate, hidden]`.
    pub up: Weight<B>,
    /// `[hidden, intermediate]`.
    pub down: Weight<B>,
}

/// The routed experts of one MoE layer, with the state a backend derives from all of them
/// (expert tables, repacked layouts) in `resident`: all of the layer's, or under expert
/// parallelism one rank's part, experts `first..first + experts.len()` of the `routed` its router
/// chooses among.
pub struct MoeExperts<B: Device> {
    pub experts: Vec<Expert<B>>,
    pub hidden: usize,
    pub intermediate: usize,
    pub resident: ResidentSlot<B>,
    /// The layer's index of `experts[0]`.
    pub first: usize,
    /// How many experts the router chooses among (the layer's).
    pub routed: usize,
}

impl<B: Device> MoeExperts<B> {
    /// Checks every expert's shapes against `hidden` and `intermediate` (`name` is for errors),
    /// then stores them as the backend keeps experts (`Device::expert_parts`).
    pub fn new(backend: &B, name: &str, experts: Vec<Expert<B>>, hidden: usize, intermediate: usize) -> Result<Self> {
        if experts.is_empty() {
            return Err(Error::tensor(name, "an MoE layer needs at least one expert"));
        }
        for (e, ex) in experts.iter().enumerate() {
            for (part, w, want) in [
                ("gate", &ex.gate, (intermediate, hidden)),
                ("up", &ex.up, (intermediate, hidden)),
                ("down", &ex.down, (hidden, intermediate)),
            ] {
                let what = format!("{name}.{e}.{part}");
                w.validate(&what)?;
                if w.dims() != want {
                    return Err(Error::tensor(
                        what,
                        format!("expected shape {:?}, found {:?}", [want.0, want.1], [w.dims().0, w.dims().1]),
                    ));
                }
            }
        }
        let experts = backend.expert_parts(experts)?;
        let Some(first) = experts.first() else {
            return Err(Error::tensor(name, "the backend kept none of the layer's experts"));
        };
        let resident = ResidentSlot::new(backend, first.gate.storage_addr(backend));
        let routed = experts.len();
        Ok(MoeExperts { experts, hidden, intermediate, resident, first: 0, routed })
    }

    /// These experts as experts `first..` of a layer of `routed` (a rank's part under expert
    /// parallelism): a token's choices outside them add nothing here.
    pub fn part_of(mut self, first: usize, routed: usize, name: &str) -> Result<Self> {
        if first + self.experts.len() > routed {
            return Err(Error::tensor(
                name,
                format!("experts {first}..{} of a layer of {routed}", first + self.experts.len()),
            ));
        }
        (self.first, self.routed) = (first, routed);
        Ok(self)
    }

    /// Whether these are all of the layer's experts.
    pub fn is_whole(&self) -> bool {
        self.first == 0 && self.routed == self.experts.len()
    }
}

/// How router logits become expert choices and weights.
#[derive(Clone, Debug, PartialEq)]
pub enum RouterKind {
    /// Softmax over all experts in f32, top-k, optionally renormalised over the chosen k.
    Softmax { top_k: usize, renormalize: bool },
    /// Optional tanh softcap `c * tanh(logit / c)`, sigmoid scores, top-k chosen on
    /// `score + correction_bias`, weights = the chosen unbiased scores (renormalised if asked),
    /// times `routed_scaling`.
    Sigmoid { top_k: usize, softcap: Option<f32>, renormalize: bool, routed_scaling: f32 },
}

impl RouterKind {
    pub fn top_k(&self) -> usize {
        match self {
            RouterKind::Softmax { top_k, .. } | RouterKind::Sigmoid { top_k, .. } => *top_k,
        }
    }
}

pub struct Router<B: Device> {
    /// `[num_experts, hidden]`.
    pub weight: Linear<B>,
    pub kind: RouterKind,
    /// f32 `[num_experts]`, added to the scores for selection only (sigmoid routers).
    pub correction_bias: Option<Tensor<B>>,
}
