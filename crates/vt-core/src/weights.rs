//! Typed weights. Backends implement ops over these, never over a model's layer.
//!
//! Every weight kind that a backend may derive state from (a repacked layout, a table of expert
//! pointers) owns a `ResidentSlot<B>`; see `resident.rs` and docs/lifetime.md.

use crate::backend::Device;
use crate::resident::ResidentSlot;
use crate::tensor::Tensor;
use crate::{DType, Error, Result};

/// NVFP4 weight `[n, k]`: e2m1 codes, one fp8 e4m3 scale per 16 inputs, one f32 multiplier.
/// `W[i, j] = e2m1(codes[i, j]) * f8(scales[i, j / 16]) * global_scale`.
pub struct Nvfp4<B: Device> {
    /// `F4x2`, logical shape `[n, k]` (bytes `[n, k / 2]`, even element in the low nibble).
    pub codes: Tensor<B>,
    /// `F8E4M3`, shape `[n, k / 16]`.
    pub scales: Tensor<B>,
    /// Per-tensor multiplier (compressed-tensors' global scale is its reciprocal).
    pub global_scale: f32,
}

pub const NVFP4_GROUP: usize = 16;

/// A matrix `[out, in]` in its stored form.
pub enum Weight<B: Device> {
    /// bf16, f16 or f32 `[out, in]`.
    Dense(Tensor<B>),
    Nvfp4(Nvfp4<B>),
}

impl<B: Device> Weight<B> {
    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        let shape = match self {
            Weight::Dense(t) => t.shape(),
            Weight::Nvfp4(q) => q.codes.shape(),
        };
        (shape[0], shape[1])
    }

    /// The buffer the weight's values live in (the codes for NVFP4): what a slot is keyed to.
    pub fn storage_addr(&self, backend: &B) -> usize {
        match self {
            Weight::Dense(t) => backend.buffer_addr(t.buffer()),
            Weight::Nvfp4(q) => backend.buffer_addr(q.codes.buffer()),
        }
    }

    /// Bytes resident for this weight (codes + scales for NVFP4).
    pub fn resident_bytes(&self) -> usize {
        let bytes = |t: &Tensor<B>| t.dtype().bytes_for(t.numel()).unwrap_or(0);
        match self {
            Weight::Dense(t) => bytes(t),
            Weight::Nvfp4(q) => bytes(&q.codes) + bytes(&q.scales) + std::mem::size_of::<f32>(),
        }
    }

    /// Checks a 2-D matrix and, for NVFP4, the code/scale agreement; `name` is for the error.
    pub fn validate(&self, name: &str) -> Result<()> {
        match self {
            Weight::Dense(t) => {
                if t.shape().len() != 2 || !t.dtype().is_float() || t.dtype() == DType::F8E4M3 {
                    return Err(Error::tensor(
                        name,
                        format!("expected a 2-D bf16/f16/f32 matrix, found {} {:?}", t.dtype(), t.shape()),
                    ));
                }
            }
            Weight::Nvfp4(q) => {
                let (n, k) = (q.codes.shape()[0], q.codes.shape()[1]);
                if k % NVFP4_GROUP != 0 {
                    return Err(Error::tensor(
                        name,
                        format!("NVFP4 input size {k} is not a multiple of {NVFP4_GROUP}"),
                    ));
                }
                if q.scales.shape() != [n, k / NVFP4_GROUP] || q.scales.dtype() != DType::F8E4M3 {
                    return Err(Error::tensor(
                        name,
                        format!(
                            "NVFP4 scales must be F8_E4M3 [{n}, {}], found {} {:?}",
                            k / NVFP4_GROUP,
                            q.scales.dtype(),
                            q.scales.shape()
                        ),
                    ));
                }
                if !q.global_scale.is_finite() {
                    return Err(Error::tensor(name, format!("NVFP4 global scale {} is not finite", q.global_scale)));
                }
            }
        }
        Ok(())
    }
}

/// A linear layer without bias: `y = x W^T`.
pub struct Linear<B: Device> {
    pub weight: Weight<B>,
    pub resident: ResidentSlot<B>,
}

impl<B: Device> Linear<B> {
    /// Validates the weight first (`Weight::validate`): kernels read codes and scales as the
    /// shapes say, so a malformed NVFP4 weight would send them past its scales.
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
/// (expert tables, repacked layouts) in `resident`.
pub struct MoeExperts<B: Device> {
    pub experts: Vec<Expert<B>>,
    pub hidden: usize,
    pub intermediate: usize,
    pub resident: ResidentSlot<B>,
}

impl<B: Device> MoeExperts<B> {
    /// Checks every expert's shapes against `hidden` and `intermediate`; `name` is for errors.
    pub fn new(backend: &B, name: &str, experts: Vec<Expert<B>>, hidden: usize, intermediate: usize) -> Result<Self> {
        let Some(first) = experts.first() else {
            return Err(Error::tensor(name, "an MoE layer needs at least one expert"));
        };
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
        let resident = ResidentSlot::new(backend, first.gate.storage_addr(backend));
        Ok(MoeExperts { experts, hidden, intermediate, resident })
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
