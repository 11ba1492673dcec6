//! Reading a checkpoint's tensors into backend weights, checking each against the spec.

use std::cell::Cell;

use vt_core::checkpoint::{Checkpoint, TensorRef};
use vt_core::{Backend, DType, Error, Expert, Linear, MoeExperts, Nvfp4, Result, Tensor, Weight, NVFP4_GROUP};

use crate::quant::{is_activation_scale, QuantConfig};

/// Random weights at the shapes config.json implies, generated on the backend, instead of a
/// checkpoint's tensors (benchmarks: `vt bench --load-format dummy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DummyWeights {
    pub seed: u64,
    /// Projections and experts in NVFP4, as NVFP4 checkpoints store them (routers, gates, the
    /// embeddings and the LM head stay bf16).
    pub nvfp4: bool,
}

impl DummyWeights {
    /// A seed per tensor name (FNV-1a), so every tensor gets its own values.
    fn seed(&self, name: &str) -> u64 {
        name.bytes().fold(0xcbf2_9ce4_8422_2325 ^ self.seed, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
    }

    fn quantizes(&self, module: &str) -> bool {
        let keep = [".gate", "shared_expert_gate", "in_proj_a", "in_proj_b", "g_proj", "embed_tokens", "lm_head"];
        self.nvfp4 && !keep.iter().any(|k| module.ends_with(k))
    }
}

/// Tensor access under the checkpoint's text-model prefix (`model.` or `model.language_model.`).
pub struct Loader<'a, B: Backend> {
    pub ckpt: &'a Checkpoint,
    pub backend: &'a B,
    /// Prefix of the decoder's tensors, e.g. `model.language_model.`.
    pub prefix: String,
    /// The quantization config, when the checkpoint has one.
    quant: Option<QuantConfig>,
    /// Told `(bytes read, bytes to read)` after every tensor.
    progress: &'a dyn Fn(u64, u64),
    bytes_read: Cell<u64>,
    total: u64,
    /// Set: every tensor is made up (`has` is true for any name).
    dummy: Option<DummyWeights>,
}

/// Checkpoint tensors the text model reads: not the vision tower, W4A4 activation scales, or the
/// multi-token-prediction layer unless config.json has one (`mtp`).
fn is_read(name: &str, mtp: bool) -> bool {
    !((name.starts_with("mtp.") && !mtp) || name.starts_with("model.visual.") || is_activation_scale(name))
}

impl<'a, B: Backend> Loader<'a, B> {
    pub fn new(ckpt: &'a Checkpoint, backend: &'a B, progress: &'a dyn Fn(u64, u64)) -> Result<Self> {
        let prefix = ["model.language_model.", "model."]
            .into_iter()
            .find(|p| ckpt.tensors.contains(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| Error::MissingTensor {
                name: "model.embed_tokens.weight (or model.language_model.embed_tokens.weight)".into(),
                dir: ckpt.dir.clone(),
            })?;
        let mtp = ckpt.config.opt_usize("mtp_num_hidden_layers")?.unwrap_or(0) > 0;
        let total = ckpt
            .tensors
            .names()
            .filter(|n| is_read(n, mtp))
            .map(|n| ckpt.tensors.get(n).map_or(0, |t| t.bytes.len() as u64))
            .sum();
        Ok(Loader {
            ckpt,
            backend,
            prefix: prefix.to_string(),
            quant: QuantConfig::from_checkpoint(ckpt)?,
            progress,
            bytes_read: Cell::new(0),
            total,
            dummy: None,
        })
    }

    /// A loader that makes every tensor up; `ckpt` needs only its config.
    pub fn dummy(ckpt: &'a Checkpoint, backend: &'a B, dummy: DummyWeights, progress: &'a dyn Fn(u64, u64)) -> Self {
        Loader {
            ckpt,
            backend,
            prefix: "model.".into(),
            quant: None,
            progress,
            bytes_read: Cell::new(0),
            total: 0,
            dummy: Some(dummy),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.dummy.is_some() || self.ckpt.tensors.contains(name)
    }

    pub fn get(&self, name: &str) -> Result<TensorRef<'a>> {
        self.ckpt.tensors.get(name)
    }

    /// A float tensor of exactly `shape`, uploaded in its stored dtype.
    pub fn float(&self, name: &str, shape: &[usize]) -> Result<Tensor<B>> {
        if let Some(d) = &self.dummy {
            return self.backend.random(DType::BF16, shape, d.seed(name), 0.1);
        }
        let t = self.get(name)?;
        check_float(&t)?;
        // Some checkpoints keep singleton dimensions (e.g. conv1d's [C, 1, K]); compare numel-wise
        // only when the squeezed shapes agree.
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if t.shape != shape && squeeze(t.shape) != squeeze(shape) {
            return Err(Error::tensor(name, format!("expected shape {shape:?} from config.json, found {:?}", t.shape)));
        }
        self.upload(t.dtype, shape, t.bytes)
    }

    /// Copies stored bytes to the backend and reports progress.
    pub(crate) fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<B>> {
        let t = self.backend.upload(dtype, shape, bytes)?;
        self.count_read(bytes.len());
        Ok(t)
    }

    pub(crate) fn count_read(&self, bytes: usize) {
        self.bytes_read.set(self.bytes_read.get() + bytes as u64);
        (self.progress)(self.bytes_read.get(), self.total);
    }

    /// The matrix `[out, in]` of module `base` in its stored form: quantized as the checkpoint's
    /// config says, or dense.
    pub fn weight(&self, base: &str, out: usize, inp: usize) -> Result<Weight<B>> {
        if let Some(d) = &self.dummy {
            return self.dummy_weight(d, base, out, inp);
        }
        let quantized = match &self.quant {
            Some(q) => q.weight(self, base, out, inp)?,
            None => None,
        };
        let w = match quantized {
            Some(w) => w,
            None => Weight::Dense(self.float(&format!("{base}.weight"), &[out, inp])?),
        };
        w.validate(base)?;
        Ok(w)
    }

    /// Random values of about a trained layer's scale (|w| ~ 1/sqrt(in)).
    fn dummy_weight(&self, d: &DummyWeights, base: &str, out: usize, inp: usize) -> Result<Weight<B>> {
        let (b, seed) = (self.backend, d.seed(base));
        let w = if d.quantizes(base) && inp.is_multiple_of(NVFP4_GROUP) {
            Weight::Nvfp4(Nvfp4::new(
                b,
                base,
                b.random(DType::F4x2, &[out, inp], seed, 1.0)?,
                b.random(DType::F8E4M3, &[out, inp / NVFP4_GROUP], seed ^ 1, 1.0)?,
                0.5 / (inp as f32).sqrt(),
            )?)
        } else {
            Weight::Dense(b.random(DType::BF16, &[out, inp], seed, (3.0 / inp as f32).sqrt())?)
        };
        w.validate(base)?;
        Ok(w)
    }

    pub fn linear(&self, base: &str, out: usize, inp: usize) -> Result<Linear<B>> {
        Linear::new(self.backend, self.weight(base, out, inp)?)
    }

    /// Routed experts stored per expert (`{base}.{e}.gate_proj.weight`, ...) or stacked
    /// (`{base}.gate_up_proj` `[E, 2I, H]`, `{base}.down_proj` `[E, H, I]`).
    pub fn experts(&self, base: &str, num: usize, hidden: usize, inter: usize) -> Result<MoeExperts<B>> {
        let stacked = format!("{base}.gate_up_proj");
        let experts = if self.dummy.is_none() && self.has(&stacked) {
            let gate_up = self.get(&stacked)?;
            if gate_up.dtype == DType::U8 {
                let why = "vt reads NVFP4 experts per expert (`experts.{e}.gate_proj`, ...), as compressed-tensors and ModelOpt export them";
                return Err(Error::tensor(stacked, format!("stacked NVFP4 experts are not supported: {why}")));
            }
            let down = self.get(&format!("{base}.down_proj"))?;
            check_float(&gate_up)?;
            check_float(&down)?;
            for (t, want) in [(&gate_up, [num, 2 * inter, hidden]), (&down, [num, hidden, inter])] {
                if t.shape != want {
                    return Err(Error::tensor(
                        t.name,
                        format!("expected shape {want:?} from config.json, found {:?}", t.shape),
                    ));
                }
            }
            let (gu_bytes, d_bytes) = (gate_up.bytes.len() / num, down.bytes.len() / num);
            let half = gu_bytes / 2;
            (0..num)
                .map(|e| {
                    let gu = &gate_up.bytes[e * gu_bytes..(e + 1) * gu_bytes];
                    let d = &down.bytes[e * d_bytes..(e + 1) * d_bytes];
                    Ok(Expert {
                        gate: Weight::Dense(self.upload(gate_up.dtype, &[inter, hidden], &gu[..half])?),
                        up: Weight::Dense(self.upload(gate_up.dtype, &[inter, hidden], &gu[half..])?),
                        down: Weight::Dense(self.upload(down.dtype, &[hidden, inter], d)?),
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..num)
                .map(|e| {
                    Ok(Expert {
                        gate: self.weight(&format!("{base}.{e}.gate_proj"), inter, hidden)?,
                        up: self.weight(&format!("{base}.{e}.up_proj"), inter, hidden)?,
                        down: self.weight(&format!("{base}.{e}.down_proj"), hidden, inter)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        MoeExperts::new(self.backend, base, experts, hidden, inter)
    }
}

fn check_float(t: &TensorRef) -> Result<()> {
    if matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
        Ok(())
    } else {
        Err(Error::tensor(t.name, format!("expected a BF16, F16 or F32 tensor, found {}", t.dtype)))
    }
}
