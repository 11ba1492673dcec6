//! vt-cpu: the reference backend. Every op plainly written in f32, parallel over rows and heads
//! with rayon; weights read in their stored dtype; every buffer from an accounted allocator with
//! an optional placement-arena mode (see `alloc.rs`).

mod alloc;
pub mod ops;

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use vt_core::backend::prelude::*;
use vt_core::backend::{check, composed, Pick, SampleRow, Sampled, TokenLogprobs};
use vt_core::{
    AttentionParams, DType, Error, GateAct, GdnInputs, GdnMode, KvLayout, KvSeq, Linear, MemoryStats, MoeExperts,
    NormKind, Result, Rope, Router, Tensor,
};

pub use alloc::{AllocMode, CpuBuffer};
pub use ops::attention::{CpuKvPool, KV_BLOCK};
pub use ops::moe::CpuExpertTable;

use alloc::{Allocator, HostMemory};
use ops::rows::RowSource;

/// Source of instance ids; ids only distinguish instances, nothing is keyed by them globally.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// The CPU backend. Clones share one allocator (one "device").
#[derive(Clone)]
pub struct CpuBackend {
    alloc: Arc<Allocator>,
    id: u64,
    /// Bytes `to_f32` has copied out, by every clone.
    read_back: Arc<AtomicUsize>,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::with_mode(AllocMode::System)
    }

    pub fn with_mode(mode: AllocMode) -> Self {
        CpuBackend {
            alloc: Arc::new(Allocator::new(mode, HostMemory)),
            id: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            read_back: Arc::default(),
        }
    }

    /// Bytes `to_f32` has copied out so far, by this backend and its clones: what a device
    /// backend would move to the host. The picking ops (`argmax_rows`, `top_logprobs_rows`,
    /// `sample_rows`) read the logits where they are, as a device backend does, and add nothing.
    pub fn bytes_read_back(&self) -> usize {
        self.read_back.load(Ordering::Relaxed)
    }

    pub fn alloc_mode(&self) -> AllocMode {
        self.alloc.mode()
    }

    fn f32_tensor(&self, shape: &[usize], data: &[f32]) -> Result<Tensor<Self>> {
        let mut buf = CpuBuffer::new(&self.alloc, data.len() * 4)?;
        buf.f32s_mut().copy_from_slice(data);
        Ok(Tensor::from_parts(buf, DType::F32, shape.to_vec()))
    }

    /// The experts' table (ops/moe.rs), built into their resident slot on first use.
    fn expert_table<'e>(&self, experts: &'e MoeExperts<Self>) -> Result<&'e CpuExpertTable> {
        experts.resident.get_or_try_init(self, || ops::moe::build_table(&self.alloc, experts))
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

fn err(reason: impl Into<String>) -> Error {
    Error::backend("cpu", reason)
}

/// The values of a float tensor where they are (f32), or decoded (other float dtypes).
fn values<'a>(t: &'a Tensor<CpuBackend>, op: &str) -> Result<Cow<'a, [f32]>> {
    match t.dtype() {
        DType::F32 => Ok(Cow::Borrowed(t.buffer().f32s())),
        _ => small_f32(t, op).map(Cow::Owned),
    }
}

/// The f32 data of an activation tensor, or an error naming the op.
fn f32s<'a>(t: &'a Tensor<CpuBackend>, op: &str) -> Result<&'a [f32]> {
    if t.dtype() != DType::F32 {
        return Err(err(format!("{op}: expected an F32 activation, found {} {:?}", t.dtype(), t.shape())));
    }
    Ok(t.buffer().f32s())
}

/// A small float tensor (norm weight, bias) decoded to f32.
fn small_f32(t: &Tensor<CpuBackend>, op: &str) -> Result<Vec<f32>> {
    if !t.dtype().is_float() {
        return Err(err(format!("{op}: expected a float tensor, found {}", t.dtype())));
    }
    let mut out = vec![0.0; t.numel()];
    vt_core::dtype::decode_into(t.dtype(), t.buffer().bytes(), &mut out);
    Ok(out)
}

impl Device for CpuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn instance_id(&self) -> u64 {
        self.id
    }

    fn activation_dtype(&self) -> DType {
        DType::F32
    }

    fn memory(&self) -> MemoryStats {
        self.alloc.stats()
    }

    fn buffer_addr(&self, buf: &CpuBuffer) -> usize {
        buf.addr()
    }

    fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<Self>> {
        check::upload(self, dtype, shape, bytes)?;
        let mut buf = CpuBuffer::new(&self.alloc, bytes.len())?;
        buf.bytes_mut().copy_from_slice(bytes);
        Ok(Tensor::from_parts(buf, dtype, shape.to_vec()))
    }

    fn from_f32(&self, shape: &[usize], data: &[f32]) -> Result<Tensor<Self>> {
        check::from_f32(self, shape, data)?;
        self.f32_tensor(shape, data)
    }

    fn zeros_f32(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        let n: usize = shape.iter().product();
        Ok(Tensor::from_parts(CpuBuffer::new(&self.alloc, n * 4)?, DType::F32, shape.to_vec()))
    }

    fn zeros(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        self.zeros_f32(shape)
    }

    fn zero(&self, t: &mut Tensor<Self>) -> Result<()> {
        t.buffer_mut().bytes_mut().fill(0);
        Ok(())
    }

    fn copy_into(&self, src: &Tensor<Self>, dst: &mut Tensor<Self>) -> Result<()> {
        check::copy_into(self, src, dst)?;
        dst.buffer_mut().bytes_mut().copy_from_slice(src.buffer().bytes());
        Ok(())
    }

    fn to_f32(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        let out = small_f32(t, "to_f32")?;
        self.read_back.fetch_add(out.len() * 4, Ordering::Relaxed);
        Ok(out)
    }

    fn argmax_rows(&self, x: &Tensor<Self>, allowed: Option<&[u32]>) -> Result<Vec<Pick>> {
        composed::check_allowed(x, allowed)?;
        Ok(composed::argmax_host(&values(x, "argmax_rows")?, x.last_dim(), allowed))
    }

    fn top_logprobs_rows(&self, x: &Tensor<Self>, chosen: &[u32], k: usize) -> Result<Vec<TokenLogprobs>> {
        composed::check_chosen(x, chosen)?;
        Ok(composed::top_logprobs_host(&values(x, "top_logprobs_rows")?, x.last_dim(), chosen, k))
    }

    fn sample_rows(&self, x: &Tensor<Self>, picks: &[SampleRow<'_>], top: Option<usize>) -> Result<Sampled> {
        vt_core::backend::sample::check_picks(x.rows(), x.last_dim(), picks)?;
        Ok(composed::sample_host(&values(x, "sample_rows")?, x.last_dim(), picks, top))
    }
}

impl Ops for CpuBackend {
    fn embedding(&self, table: &Tensor<Self>, ids: &[u32]) -> Result<Tensor<Self>> {
        let (_, hidden) = check::embedding(self, table, ids)?;
        let row = table.dtype().bytes_for(hidden).ok_or_else(|| err("embedding: bad table dtype"))?;
        let mut out = vec![0.0f32; ids.len() * hidden];
        for (o, &id) in out.chunks_exact_mut(hidden).zip(ids) {
            let id = id as usize;
            vt_core::dtype::decode_into(table.dtype(), &table.buffer().bytes()[id * row..(id + 1) * row], o);
        }
        self.f32_tensor(&[ids.len(), hidden], &out)
    }

    fn rms_norm(&self, x: &Tensor<Self>, w: &Tensor<Self>, eps: f32, kind: NormKind) -> Result<Tensor<Self>> {
        check::rms_norm(self, x, w)?;
        let w = small_f32(w, "rms_norm")?;
        let mut out = vec![0.0; x.numel()];
        ops::norm::rms_norm(f32s(x, "rms_norm")?, &w, eps, kind, &mut out);
        self.f32_tensor(x.shape(), &out)
    }

    fn rms_norm_gated(&self, x: &Tensor<Self>, z: &Tensor<Self>, w: &Tensor<Self>, eps: f32) -> Result<Tensor<Self>> {
        check::rms_norm_gated(self, x, z, w)?;
        let w = small_f32(w, "rms_norm_gated")?;
        let mut out = vec![0.0; x.numel()];
        ops::norm::rms_norm_gated(f32s(x, "rms_norm_gated")?, f32s(z, "rms_norm_gated")?, &w, eps, &mut out);
        self.f32_tensor(x.shape(), &out)
    }

    fn linear(&self, x: &Tensor<Self>, w: &Linear<Self>) -> Result<Tensor<Self>> {
        let (n, k) = check::linear(self, x, w)?;
        let t = x.rows();
        // SAFETY: the rows belong to `w`, borrowed for the whole call.
        let y = unsafe { ops::matmul::matmul(f32s(x, "linear")?, t, k, RowSource::of(&w.weight), n) };
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("checked non-scalar") = n;
        self.f32_tensor(&shape, &y)
    }

    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        check::same_shape(self, "add", a, b)?;
        let out: Vec<f32> = f32s(a, "add")?.iter().zip(f32s(b, "add")?).map(|(x, y)| x + y).collect();
        self.f32_tensor(a.shape(), &out)
    }

    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>> {
        check::same_shape(self, "swiglu", gate, up)?;
        let out: Vec<f32> =
            f32s(gate, "swiglu")?.iter().zip(f32s(up, "swiglu")?).map(|(&g, &u)| ops::norm::silu(g) * u).collect();
        self.f32_tensor(gate.shape(), &out)
    }

    fn gate(&self, x: &Tensor<Self>, g: &Tensor<Self>, act: GateAct) -> Result<Tensor<Self>> {
        let per = check::gate(self, x, g)?;
        let (xs, gs) = (f32s(x, "gate")?, f32s(g, "gate")?);
        let f = match act {
            GateAct::Sigmoid => ops::norm::sigmoid,
            GateAct::Softplus => ops::norm::softplus,
        };
        let out: Vec<f32> = xs.iter().enumerate().map(|(i, &v)| v * f(gs[i / per])).collect();
        self.f32_tensor(x.shape(), &out)
    }

    fn narrow_cols(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        check::narrow_cols(self, x, start, len)?;
        let width = x.last_dim();
        let out: Vec<f32> =
            f32s(x, "narrow_cols")?.chunks_exact(width).flat_map(|r| r[start..start + len].iter().copied()).collect();
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("non-scalar") = len;
        self.f32_tensor(&shape, &out)
    }

    fn slice_rows(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        check::slice_rows(self, x, start, len)?;
        let width = x.last_dim();
        let data = &f32s(x, "slice_rows")?[start * width..(start + len) * width];
        self.f32_tensor(&[len, width], data)
    }

    fn concat_rows(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        let (rows, width) = check::concat_rows(self, parts)?;
        let mut data = Vec::with_capacity(rows * width);
        for p in parts {
            data.extend_from_slice(f32s(p, "concat_rows")?);
        }
        self.f32_tensor(&[rows, width], &data)
    }

    fn rope(&self, x: &Tensor<Self>, start: usize, rope: &Rope) -> Result<Tensor<Self>> {
        let (_, heads, dim) = check::rope(self, x, rope)?;
        let mut out = vec![0.0; x.numel()];
        ops::rope::rope(f32s(x, "rope")?, heads, dim, start, rope, &mut out);
        self.f32_tensor(x.shape(), &out)
    }

    fn causal_conv1d(&self, x: &Tensor<Self>, w: &Tensor<Self>, state: &mut Tensor<Self>) -> Result<Tensor<Self>> {
        let (channels, kernel) = check::causal_conv1d(self, x, w, state)?;
        let w = small_f32(w, "causal_conv1d")?;
        let t = x.rows();
        let out = ops::conv::causal_conv1d_silu(
            f32s(x, "causal_conv1d")?,
            t,
            channels,
            &w,
            kernel,
            state.buffer_mut().f32s_mut(),
        );
        self.f32_tensor(x.shape(), &out)
    }

    fn gated_delta_rule(
        &self,
        inp: &GdnInputs<'_, Self>,
        state: &mut Tensor<Self>,
        mode: GdnMode,
    ) -> Result<Tensor<Self>> {
        let op = "gated_delta_rule";
        let d = inp.dims(self, state)?;
        let (a_log, dt_bias) = (small_f32(inp.a_log, op)?, small_f32(inp.dt_bias, op)?);
        let (q, k, v, a, b) =
            (f32s(inp.q, op)?, f32s(inp.k, op)?, f32s(inp.v, op)?, f32s(inp.a, op)?, f32s(inp.b, op)?);
        let s = state.buffer_mut().f32s_mut();
        let out = match mode {
            GdnMode::Chunked => ops::gdn::gated_delta_rule_chunked(&d, q, k, v, a, b, &a_log, &dt_bias, s),
            GdnMode::Recurrent => ops::gdn::gated_delta_rule_recurrent(&d, q, k, v, a, b, &a_log, &dt_bias, s),
        };
        self.f32_tensor(&[d.t, d.value_heads, d.value_dim], &out)
    }

    fn moe(&self, x: &Tensor<Self>, router: &Router<Self>, experts: &MoeExperts<Self>) -> Result<Tensor<Self>> {
        check::moe(self, x, router, experts)?;
        let logits = self.linear(x, &router.weight)?;
        let bias = router.correction_bias.as_ref().map(|b| small_f32(b, "moe")).transpose()?;
        let table = self.expert_table(experts)?;
        let out =
            ops::moe::moe(f32s(x, "moe")?, x.rows(), logits.buffer().f32s(), router, bias.as_deref(), experts, table);
        self.f32_tensor(x.shape(), &out)
    }

    fn prepare_experts(&self, experts: &MoeExperts<Self>) -> Result<()> {
        self.expert_table(experts).map(|_| ())
    }
}

impl KvOps for CpuBackend {
    type KvPool = CpuKvPool;

    fn kv_block_size(&self) -> usize {
        KV_BLOCK
    }

    fn new_kv_pool(&self, layers: &[KvLayout]) -> Result<CpuKvPool> {
        Ok(CpuKvPool::new(self.alloc.clone(), layers))
    }

    fn copy_kv_block(&self, pool: &mut CpuKvPool, layer: usize, src: u32, dst: u32) -> Result<()> {
        pool.copy_block(layer, src, dst)
    }

    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        pool: &mut CpuKvPool,
        seq: KvSeq<'_>,
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        let op = "attention";
        let shape = check::attention(self, q, k, v, params)?;
        let layout = pool.layout(seq.layer, op)?;
        if (layout.kv_heads, layout.head_dim) != (shape.kv_heads, shape.head_dim) {
            return Err(err(format!(
                "{op}: k {:?} for a pool layer of {} kv heads x {}",
                k.shape(),
                layout.kv_heads,
                layout.head_dim
            )));
        }
        check::kv_table(self, op, &seq, shape.t, KV_BLOCK, layout.blocks, params.window)?;
        let out = ops::attention::attention(f32s(q, op)?, f32s(k, op)?, f32s(v, op)?, &shape, pool, seq, params)?;
        self.f32_tensor(q.shape(), &out)
    }
}

/// The reference runs every fused op composed.
impl FusedOps for CpuBackend {}

/// Steps are not recorded: the host runs each op as it is called.
impl StepRecording for CpuBackend {
    type StepGraph = ();
}
