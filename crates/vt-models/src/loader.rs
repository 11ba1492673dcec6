//! Reading a checkpoint's tensors into backend weights, checking each against the spec.

use std::cell::{Cell, RefCell};
use std::ops::Range;

use vt_core::checkpoint::{Checkpoint, TensorRef};
use vt_core::{Backend, DType, Error, Expert, Linear, MoeExperts, Nvfp4, Result, Tensor, Weight, NVFP4_GROUP};

use crate::quant::{is_activation_scale, QuantConfig};

/// Random weights at the shapes config.json implies, generated on the backend, instead of a
/// checkpoint's tensors (benchmarks: `vt bench --load-format dummy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DummyWeights {
    pub seed: u64,
    /// Which of them are NVFP4.
    pub nvfp4: DummyNvfp4,
}

/// Which modules random weights make NVFP4: NVFP4 checkpoints differ in what they quantize.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DummyNvfp4 {
    /// None: every weight bf16.
    Off,
    /// Every projection and expert; the routers, gates, GDN's in_proj_a/b, the embeddings and the
    /// LM head stay bf16.
    Projections,
    /// The routed experts of the model's layers only, as NVIDIA's ModelOpt exports of Qwen3.5 store
    /// them (attention, the delta net, the shared experts and the MTP layer bf16).
    RoutedExperts,
}

impl DummyWeights {
    /// A seed per tensor name (FNV-1a), so every tensor gets its own values.
    fn seed(&self, name: &str) -> u64 {
        name.bytes().fold(0xcbf2_9ce4_8422_2325 ^ self.seed, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
    }

    fn quantizes(&self, module: &str) -> bool {
        let keep = [".gate", "shared_expert_gate", "in_proj_a", "in_proj_b", "g_proj", "embed_tokens", "lm_head"];
        match self.nvfp4 {
            DummyNvfp4::Off => false,
            DummyNvfp4::Projections => !keep.iter().any(|k| module.ends_with(k)),
            DummyNvfp4::RoutedExperts => module.contains(".experts.") && !module.starts_with("mtp."),
        }
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
    /// Set while a tensor-parallel rank loads its part of one weight: what `place` keeps.
    cut: RefCell<Option<Cut>>,
}

/// A rank's part of a weight of logical shape `[out, inp]`: the rows of `rows` (ranges of output
/// features, concatenated in order) and, where set, the columns `cols` (input features). Every
/// tensor the weight is stored as (values, block scales) is cut in proportion: a stored value
/// that covers several logical ones (NVFP4's 2 codes a byte and scale per 16 inputs, FP8's
/// block scales) is kept whole, so a cut must fall on such a boundary.
#[derive(Clone, Debug)]
pub struct Cut {
    /// The weight's name, for errors.
    pub name: String,
    pub out: usize,
    pub inp: usize,
    pub rows: Vec<Range<usize>>,
    pub cols: Option<Range<usize>>,
}

impl Cut {
    /// Rows kept in all.
    fn rows_kept(&self) -> usize {
        self.rows.iter().map(ExactSizeIterator::len).sum()
    }

    /// Whether the cut keeps everything (one rank).
    fn is_whole(&self) -> bool {
        matches!(self.rows.as_slice(), [r] if *r == (0..self.out))
            && self.cols.as_ref().is_none_or(|c| *c == (0..self.inp))
    }

    /// The shape the cut leaves of `[out, inp]`.
    fn shape(&self) -> [usize; 2] {
        [self.rows_kept(), self.cols.as_ref().map_or(self.inp, ExactSizeIterator::len)]
    }
}

/// `r`, a range of `logical` indices, as a range of a stored dimension of `stored` values, each
/// covering `logical.div_ceil(stored)` logical ones (the last possibly fewer).
fn stored_range(r: &Range<usize>, logical: usize, stored: usize, what: &str) -> Result<Range<usize>> {
    if stored == logical {
        return Ok(r.clone());
    }
    let per = logical.div_ceil(stored.max(1));
    if stored == 0 || !r.start.is_multiple_of(per) || !(r.end.is_multiple_of(per) || r.end == logical) {
        return Err(Error::tensor(
            what,
            format!(
                "tensor parallelism cannot keep {r:?} of its {logical}: it is stored as one value per {per} \
                 (a rank's part must start and end on such a block; try fewer ranks)"
            ),
        ));
    }
    Ok(r.start / per..r.end.div_ceil(per))
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
            cut: RefCell::new(None),
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
            cut: RefCell::new(None),
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
            let cut = self.cut.borrow().as_ref().map(Cut::shape);
            let kept = match (cut, shape) {
                (Some([rows, _]), [_]) => vec![rows],
                (Some([rows, cols]), _) => vec![rows, cols],
                (None, _) => shape.to_vec(),
            };
            return self.backend.random(DType::BF16, &kept, d.seed(name), 0.1);
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

    /// Copies stored bytes to the backend (a rank's cut of them, while one is set) and reports
    /// progress.
    pub(crate) fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<B>> {
        let t = self.place(dtype, shape, bytes)?;
        self.count_read(bytes.len());
        Ok(t)
    }

    /// Copies stored bytes to the backend, keeping only the current cut (rows, and columns, of a
    /// `[rows, cols]` or `[rows]` tensor): whole rows straight from the mapped file, a column
    /// range row by row into a buffer of the kept part only.
    pub(crate) fn place(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<B>> {
        let cut = self.cut.borrow();
        let Some(cut) = cut.as_ref().filter(|c| !c.is_whole()) else { return self.backend.upload(dtype, shape, bytes) };
        let what = format!("{} ({dtype} {shape:?} of [{}, {}])", cut.name, cut.out, cut.inp);
        let (rows, cols) = match *shape {
            [r] => (r, 1),
            [r, c] => (r, c),
            _ => return Err(Error::tensor(what, "only 1-D and 2-D tensors are split between ranks")),
        };
        let row_bytes = bytes.len() / rows.max(1);
        let row_ranges = cut.rows.iter().map(|r| stored_range(r, cut.out, rows, &what)).collect::<Result<Vec<_>>>()?;
        let col_range = match (&cut.cols, shape.len()) {
            (Some(c), 2) => stored_range(c, cut.inp, cols, &what)?,
            _ => 0..cols,
        };
        let (b0, b1) = (col_range.start * row_bytes, col_range.end * row_bytes);
        if !b0.is_multiple_of(cols) || !b1.is_multiple_of(cols) {
            return Err(Error::tensor(what, format!("columns {col_range:?} do not start and end on a byte")));
        }
        let (b0, b1) = (b0 / cols, b1 / cols);
        let kept_rows: usize = row_ranges.iter().map(ExactSizeIterator::len).sum();
        let mut kept = Vec::with_capacity(kept_rows * (b1 - b0));
        for r in &row_ranges {
            if b0 == 0 && b1 == row_bytes {
                kept.extend_from_slice(&bytes[r.start * row_bytes..r.end * row_bytes]);
            } else {
                for row in r.clone() {
                    kept.extend_from_slice(&bytes[row * row_bytes + b0..row * row_bytes + b1]);
                }
            }
        }
        let kept_shape = match shape.len() {
            1 => vec![kept_rows],
            _ => vec![kept_rows, col_range.len()],
        };
        self.backend.upload(dtype, &kept_shape, &kept)
    }

    /// `load()` with `cut` set: a rank's part of one weight.
    pub fn with_cut<T>(&self, cut: Cut, load: impl FnOnce() -> Result<T>) -> Result<T> {
        let before = self.cut.replace(Some(cut));
        let out = load();
        self.cut.replace(before);
        out
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

    /// Random values of about a trained layer's scale (|w| ~ 1/sqrt(in)), at a rank's cut of
    /// `[out, inp]` while one is set.
    fn dummy_weight(&self, d: &DummyWeights, base: &str, out: usize, inp: usize) -> Result<Weight<B>> {
        let (b, seed) = (self.backend, d.seed(base));
        let [out, inp] = self.cut.borrow().as_ref().map_or([out, inp], Cut::shape);
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

    /// A rank's output rows of `base` `[out, inp]` (the ranges of `rows`, concatenated).
    pub fn linear_rows(&self, base: &str, [out, inp]: [usize; 2], rows: &[Range<usize>]) -> Result<Linear<B>> {
        let cut = Cut { name: base.into(), out, inp, rows: rows.to_vec(), cols: None };
        self.with_cut(cut, || self.linear(base, out, inp))
    }

    /// A rank's input columns `cols` of `base` `[out, inp]`, every row.
    pub fn linear_cols(&self, base: &str, [out, inp]: [usize; 2], cols: Range<usize>) -> Result<Linear<B>> {
        let cut = Cut { name: base.into(), out, inp, rows: std::iter::once(0..out).collect(), cols: Some(cols) };
        self.with_cut(cut, || self.linear(base, out, inp))
    }

    /// A rank's rows (`rows`, concatenated) of the float tensor `name` of `shape` (1-D or 2-D).
    pub fn float_rows(&self, name: &str, shape: &[usize], rows: &[Range<usize>]) -> Result<Tensor<B>> {
        let cut = Cut {
            name: name.into(),
            out: shape[0],
            inp: shape.get(1).copied().unwrap_or(1),
            rows: rows.to_vec(),
            cols: None,
        };
        self.with_cut(cut, || self.float(name, shape))
    }

    /// The smallest number of a weight's input features a rank's cut can start at: one NVFP4
    /// scale group, one FP8 block (rows and columns), else one.
    pub fn split_unit(&self) -> usize {
        match (&self.dummy, &self.quant) {
            (Some(d), _) if d.nvfp4 != DummyNvfp4::Off => NVFP4_GROUP,
            (Some(_), _) | (None, None) => 1,
            (None, Some(q)) => q.split_unit(),
        }
    }

    /// Routed experts stored per expert (`{base}.{e}.gate_proj.weight`, ...) or stacked
    /// (`{base}.gate_up_proj` `[E, 2I, H]`, `{base}.down_proj` `[E, H, I]`): experts `ids` of the
    /// layer's `num`, and of each the hidden units `part` of its `inter` (a tensor- or
    /// expert-parallel rank's part; `0..num` and `0..inter` for all).
    pub fn experts(
        &self,
        base: &str,
        [num, hidden, inter]: [usize; 3],
        ids: Range<usize>,
        part: Range<usize>,
    ) -> Result<MoeExperts<B>> {
        let rows = |out, inp| Cut { name: base.into(), out, inp, rows: vec![part.clone()], cols: None };
        let cols = |out, inp| Cut {
            name: base.into(),
            out,
            inp,
            rows: std::iter::once(0..out).collect(),
            cols: Some(part.clone()),
        };
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
            ids.clone()
                .map(|e| {
                    let gu = &gate_up.bytes[e * gu_bytes..(e + 1) * gu_bytes];
                    let d = &down.bytes[e * d_bytes..(e + 1) * d_bytes];
                    let up_rows = |bytes| {
                        self.with_cut(rows(inter, hidden), || self.upload(gate_up.dtype, &[inter, hidden], bytes))
                    };
                    Ok(Expert {
                        gate: Weight::Dense(up_rows(&gu[..half])?),
                        up: Weight::Dense(up_rows(&gu[half..])?),
                        down: Weight::Dense(
                            self.with_cut(cols(hidden, inter), || self.upload(down.dtype, &[hidden, inter], d))?,
                        ),
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            ids.clone()
                .map(|e| {
                    let up_rows = |name| {
                        self.with_cut(rows(inter, hidden), || self.weight(&format!("{base}.{e}.{name}"), inter, hidden))
                    };
                    Ok(Expert {
                        gate: up_rows("gate_proj")?,
                        up: up_rows("up_proj")?,
                        down: self.with_cut(cols(hidden, inter), || {
                            self.weight(&format!("{base}.{e}.down_proj"), hidden, inter)
                        })?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        MoeExperts::new(self.backend, base, experts, hidden, part.len())?.part_of(ids.start, num, base)
    }
}

fn check_float(t: &TensorRef) -> Result<()> {
    if matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
        Ok(())
    } else {
        Err(Error::tensor(t.name, format!("expected a BF16, F16 or F32 tensor, found {}", t.dtype)))
    }
}
