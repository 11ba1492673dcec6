//! `CudaBackend`: the Backend trait on one CUDA device and one stream per backend instance.
//!
//! Every op queues work on the stream and returns at once; only `to_f32` waits (logits come back
//! once per step). Kernel arguments are device addresses (`u64`), `i32`/`i64` counts and `f32`
//! scalars, in the order of each kernel's C signature (quoted at every launch).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;
use vt_core::backend::prelude::*;
use vt_core::{
    AttentionParams, DType, GateAct, GdnDims, GdnInputs, GdnMode, GdnState, GdnStep, Linear, MemoryStats, MoeExperts,
    NormKind, Result, Rope, Router, SharedExpert, Tensor, Weight,
};

use crate::alloc::{AllocMode, Allocator, CudaBuffer};
use crate::blas::Gemm;
use crate::capture::Recording;
use crate::error::{check, driver_err, err};
use crate::kernels::Kernels;
use crate::kv::CudaKvCache;
use crate::launch::{act, grid1, i32_of, launched, Overlapped, MAX_SHARED};
use crate::limits::{ARGMAX_LOADS, CONV_MAX_K};
use crate::record::CudaStepGraph;
use crate::rope::rope_freqs;
use crate::weight::{float_code, WeightDesc};

/// Source of instance ids; ids only distinguish instances, nothing is keyed by them globally.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// Threads of an `argmax_part` block.
const ARGMAX_THREADS: usize = 256;

struct Inner {
    id: u64,
    kernels: Arc<Kernels>,
    gemm: Arc<Gemm>,
    alloc: Arc<Allocator>,
    /// Set on a recorder (record.rs): its ops are captured, not run.
    recording: Option<Recording>,
}

/// The CUDA backend. Clones share one device context, stream, allocator and kernels.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let Some(l) = s.last_mut() {
        *l = last;
    }
    s
}

impl CudaBackend {
    /// A backend on device 0 with the system allocator.
    pub fn new() -> Result<Self> {
        Self::with_mode(AllocMode::System)
    }

    /// A backend on device 0: its own stream, allocator (in `mode`) and freshly compiled kernels.
    pub fn with_mode(mode: AllocMode) -> Result<Self> {
        let ctx = CudaContext::new(0).map_err(|e| driver_err("opening CUDA device 0", e))?;
        let stream = ctx.new_stream().map_err(|e| driver_err("creating a stream", e))?;
        let alloc = Arc::new(Allocator::new(mode, stream));
        let kernels = Kernels::load(&ctx)?;
        let gemm = Gemm::new(&alloc)?;
        let id = NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed);
        let inner = Inner { id, kernels: Arc::new(kernels), gemm: Arc::new(gemm), alloc, recording: None };
        Ok(CudaBackend { inner: Arc::new(inner) })
    }

    /// The recording a recorder holds.
    pub(crate) fn recording(&self) -> Option<&Recording> {
        self.inner.recording.as_ref()
    }

    pub fn alloc_mode(&self) -> AllocMode {
        self.inner.alloc.mode()
    }

    pub(crate) fn k(&self) -> &Kernels {
        &self.inner.kernels
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.inner.alloc.stream()
    }

    pub(crate) fn alloc(&self) -> &Arc<Allocator> {
        &self.inner.alloc
    }

    pub(crate) fn gemm(&self) -> &Gemm {
        &self.inner.gemm
    }

    /// Waits for every op queued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream().synchronize().map_err(|e| driver_err("synchronize", e))
    }

    /// `(free, total)` device bytes as the driver reports them (`cuMemGetInfo`).
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        self.stream().context().mem_get_info().map_err(|e| driver_err("cuMemGetInfo", e))
    }

    pub(crate) fn buffer(&self, len: usize) -> Result<CudaBuffer> {
        CudaBuffer::new(&self.inner.alloc, len)
    }

    /// An uninitialised tensor the next kernel fills.
    pub(crate) fn empty(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<Self>> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes_for(n).ok_or_else(|| err(format!("{dtype} {shape:?} has no byte size")))?;
        Ok(Tensor::from_parts(self.buffer(bytes)?, dtype, shape.to_vec()))
    }

    fn zeroed(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<Self>> {
        let mut t = self.empty(dtype, shape)?;
        self.zero(&mut t)?;
        Ok(t)
    }

    pub(crate) fn copy_in<T>(&self, dst: &CudaBuffer, src: &[T]) -> Result<()> {
        self.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: `dst` holds `size_of_val(src)` bytes (callers size it so); a pageable source is
        // staged before the call returns, so `src` may go away afterwards.
        unsafe { result::memcpy_htod_async(dst.ptr(), src, self.stream().cu_stream()) }
            .map_err(|e| driver_err("host-to-device copy", e))
    }

    /// Fills `dst` from the start of `src` once the stream has run everything queued before, and
    /// waits for it (a recorder runs nothing, so it has nothing to read back).
    pub(crate) fn copy_out<T>(&self, dst: &mut [T], src: &CudaBuffer, op: &str) -> Result<()> {
        check(self.recording().is_none(), op, || "a recorder runs nothing to read back".into())?;
        check(std::mem::size_of_val(dst) <= src.len(), op, || {
            format!("{} bytes from a buffer of {}", std::mem::size_of_val(dst), src.len())
        })?;
        self.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: `src` holds at least `size_of_val(dst)` bytes (checked); we wait for the copy
        // below, so `dst` outlives it.
        unsafe { result::memcpy_dtoh_async(dst, src.ptr(), self.stream().cu_stream()) }
            .map_err(|e| driver_err("device-to-host copy", e))?;
        self.synchronize()
    }

    /// A small host array (ids, tables) in device memory.
    pub(crate) fn upload_slice<T>(&self, src: &[T]) -> Result<CudaBuffer> {
        let buf = self.buffer(std::mem::size_of_val(src))?;
        self.copy_in(&buf, src)?;
        Ok(buf)
    }

    /// Elementwise `out = f(a, b)` over bf16 tensors of one shape (add, swiglu).
    fn binary(&self, a: &Tensor<Self>, b: &Tensor<Self>, op: &str) -> Result<Tensor<Self>> {
        check(a.shape() == b.shape(), op, || format!("{:?} vs {:?}", a.shape(), b.shape()))?;
        let (pa, pb) = (act(a, op)?, act(b, op)?);
        let out = self.empty(DType::BF16, a.shape())?;
        let (po, n) = (out.buffer().ptr(), a.numel() as i64);
        let f = if op == "add" { &self.k().add } else { &self.k().swiglu };
        let mut l = self.stream().launch_builder(f);
        l.arg(&po).arg(&pa).arg(&pb).arg(&n);
        // SAFETY: add/swiglu(bf16* out, const bf16* a, const bf16* b, long long n); all three
        // hold n bf16 values (same shape, checked).
        launched(unsafe { l.launch(grid1(a.numel())) }, op)?;
        Ok(out)
    }
}

impl Device for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn instance_id(&self) -> u64 {
        self.inner.id
    }

    fn activation_dtype(&self) -> DType {
        DType::BF16
    }

    fn memory(&self) -> MemoryStats {
        self.inner.alloc.stats()
    }

    fn buffer_addr(&self, buf: &CudaBuffer) -> usize {
        buf.ptr() as usize
    }

    fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<Self>> {
        let numel: usize = shape.iter().product();
        check(dtype.bytes_for(numel) == Some(bytes.len()), "upload", || {
            format!("{} bytes do not hold {dtype} {shape:?}", bytes.len())
        })?;
        Ok(Tensor::from_parts(self.upload_slice(bytes)?, dtype, shape.to_vec()))
    }

    fn from_f32(&self, shape: &[usize], data: &[f32]) -> Result<Tensor<Self>> {
        check(shape.iter().product::<usize>() == data.len(), "from_f32", || {
            format!("{} values for shape {shape:?}", data.len())
        })?;
        let host: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok(Tensor::from_parts(self.upload_slice(&host)?, DType::BF16, shape.to_vec()))
    }

    fn zeros_f32(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        self.zeroed(DType::F32, shape)
    }

    fn zeros(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        self.zeroed(DType::BF16, shape)
    }

    fn zero(&self, t: &mut Tensor<Self>) -> Result<()> {
        self.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: the block holds `len` bytes, which `t` owns (`&mut`); the memset is ordered on
        // our stream after every earlier use of them.
        unsafe { result::memset_d8_async(t.buffer().ptr(), 0, t.buffer().len(), self.stream().cu_stream()) }
            .map_err(|e| driver_err("memset", e))
    }

    fn to_f32(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        check(t.dtype().is_float(), "to_f32", || format!("expected a float tensor, found {}", t.dtype()))?;
        let mut bytes = vec![0u8; t.dtype().bytes_for(t.numel()).unwrap_or(0)];
        self.copy_out(&mut bytes, t.buffer(), "to_f32")?;
        let mut out = vec![0.0; t.numel()];
        vt_core::dtype::decode_into(t.dtype(), &bytes, &mut out);
        Ok(out)
    }

    /// Greedy picks on the device, many blocks per bf16 row (kernels/elementwise.cu); only the
    /// indices are read back.
    fn argmax_rows(&self, x: &Tensor<Self>) -> Result<Vec<u32>> {
        let (rows, n) = (x.rows(), x.last_dim());
        if x.dtype() != DType::BF16 || n == 0 || rows == 0 {
            return vt_core::backend::composed::argmax_rows(self, x);
        }
        // Before the launch: a recorder would keep the kernels in its recording.
        check(self.recording().is_none(), "argmax_rows", || "a recorder runs nothing to read back".into())?;
        // Slices of ARGMAX_THREADS x ARGMAX_LOADS values: a vocabulary-wide row spreads over
        // about one wave of blocks, each thread with a single round of loads.
        let parts = n.div_ceil(ARGMAX_THREADS * ARGMAX_LOADS).clamp(1, 256);
        let (candidates, ids) = (self.buffer(rows * parts * 8)?, self.buffer(rows * 4)?);
        let (pv, px, ni) = (candidates.ptr(), x.buffer().ptr(), i32_of(n, "row width")?);
        let (pi, pout, parts_i) = (pv + (rows * parts * 4) as u64, ids.ptr(), parts as i32);
        let mut l = self.stream().launch_builder(&self.k().argmax_part);
        l.arg(&pv).arg(&pi).arg(&px).arg(&ni);
        let cfg = LaunchConfig {
            grid_dim: (parts as u32, i32_of(rows, "rows")? as u32, 1),
            block_dim: (ARGMAX_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argmax_part(float* cv, int* ci, const bf16* x, int n): grid (parts, rows) of
        // ARGMAX_THREADS threads (whole warps); x holds rows * n bf16 values, cv and ci rows * parts
        // each (the two halves of `candidates`).
        launched(unsafe { l.launch(cfg) }, "argmax_part")?;
        let mut l = self.stream().launch_builder(&self.k().argmax_rows);
        l.arg(&pout).arg(&pv).arg(&pi).arg(&px).arg(&ni).arg(&parts_i);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argmax_rows(unsigned* out, const float* cv, const int* ci, const bf16* x, int n,
        // int parts): a warp per row; cv / ci written by argmax_part above on this stream; out
        // holds rows indices.
        launched(unsafe { l.launch(cfg) }, "argmax_rows")?;
        let mut out = vec![0u32; rows];
        self.copy_out(&mut out, &ids, "argmax_rows")?;
        Ok(out)
    }

    fn random(&self, dtype: DType, shape: &[usize], seed: u64, scale: f32) -> Result<Tensor<Self>> {
        crate::fill::random(self, dtype, shape, seed, scale)
    }
}

impl Ops for CudaBackend {
    fn embedding(&self, table: &Tensor<Self>, ids: &[u32]) -> Result<Tensor<Self>> {
        let [vocab, hidden] = *table.shape() else {
            return Err(err(format!("embedding: table must be 2-D, found {:?}", table.shape())));
        };
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(err(format!("embedding: token id {bad} is outside the vocabulary of {vocab}")));
        }
        let dt = float_code(table, "embedding")?;
        // A recorded step reads the ids its replays write.
        let (dev_ids, pi) = match self.recording() {
            Some(r) => (None, r.ids_at(ids.len(), vocab)?),
            None => {
                let buf = self.upload_slice(ids)?;
                let ptr = buf.ptr();
                (Some(buf), ptr)
            }
        };
        let out = self.empty(DType::BF16, &[ids.len(), hidden])?;
        let (po, pt, h) = (out.buffer().ptr(), table.buffer().ptr(), i32_of(hidden, "hidden")?);
        let mut l = Overlapped::new(self, &self.k().embedding);
        l.arg(&po).arg(&pt).arg(&dt).arg(&pi).arg(&h);
        let cfg = LaunchConfig { grid_dim: (ids.len() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: embedding(bf16* out, const void* table, int dt, const unsigned* ids, int hidden):
        // one block per id, every id < vocab (checked), out holds ids.len() * hidden values.
        // The kernel starts with grid_dep_begin.
        unsafe { l.launch(cfg, "embedding")? };
        drop(dev_ids); // freed in stream order, after the kernel
        Ok(out)
    }

    fn rms_norm(&self, x: &Tensor<Self>, w: &Tensor<Self>, eps: f32, kind: NormKind) -> Result<Tensor<Self>> {
        let d = x.last_dim();
        check(w.numel() == d, "rms_norm", || format!("input {:?} vs weight {:?}", x.shape(), w.shape()))?;
        let (px, pw, wdt) = (act(x, "rms_norm")?, w.buffer().ptr(), float_code(w, "rms_norm")?);
        let offset = kind.weight_offset();
        let out = self.empty(DType::BF16, x.shape())?;
        let (po, di) = (out.buffer().ptr(), i32_of(d, "norm width")?);
        let mut l = Overlapped::new(self, &self.k().rms_norm);
        l.arg(&po).arg(&px).arg(&pw).arg(&wdt).arg(&di).arg(&eps).arg(&offset);
        let cfg = LaunchConfig { grid_dim: (x.rows() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: rms_norm(bf16* out, const bf16* x, const void* w, int wdt, int d, float eps,
        // float offset): one block per row of d values; w holds d values of dtype wdt.
        // The kernel starts with grid_dep_begin.
        unsafe { l.launch(cfg, "rms_norm")? };
        Ok(out)
    }

    fn rms_norm_gated(&self, x: &Tensor<Self>, z: &Tensor<Self>, w: &Tensor<Self>, eps: f32) -> Result<Tensor<Self>> {
        let d = x.last_dim();
        check(w.numel() == d && z.numel() == x.numel(), "rms_norm_gated", || {
            format!("input {:?}, gate {:?}, weight {:?}", x.shape(), z.shape(), w.shape())
        })?;
        let (px, pz, pw, wdt) =
            (act(x, "rms_norm_gated")?, act(z, "rms_norm_gated")?, w.buffer().ptr(), float_code(w, "rms_norm_gated")?);
        let out = self.empty(DType::BF16, x.shape())?;
        let (po, di) = (out.buffer().ptr(), i32_of(d, "norm width")?);
        let mut l = Overlapped::new(self, &self.k().rms_norm_gated);
        l.arg(&po).arg(&px).arg(&pz).arg(&pw).arg(&wdt).arg(&di).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (x.rows() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: rms_norm_gated(bf16* out, const bf16* x, const bf16* z, const void* w, int wdt,
        // int d, float eps): one block per row; x, z, out hold rows * d values, w holds d.
        // The kernel starts with grid_dep_begin.
        unsafe { l.launch(cfg, "rms_norm_gated")? };
        Ok(out)
    }

    fn linear(&self, x: &Tensor<Self>, w: &Linear<Self>) -> Result<Tensor<Self>> {
        let (n, k) = w.weight.dims();
        check(x.last_dim() == k, "linear", || format!("input {:?} vs weight [{n}, {k}]", x.shape()))?;
        let (px, t) = (act(x, "linear")?, x.rows());
        let out = self.empty(DType::BF16, &with_last(x.shape(), n))?;
        let py = out.buffer().ptr();
        if crate::gemv::gemv(self, px, t, &[(&w.weight, py)])? || crate::w4a16::linear(self, px, t, w, py)? {
            return Ok(out);
        }
        if let Weight::Dense(wt) = &w.weight {
            // cuBLASLt's bf16 kernels want 16-byte aligned rows; odd shapes (router-sized outputs,
            // per-head gates) take the simple kernel.
            if wt.dtype() == DType::BF16 && n % 8 == 0 && k % 8 == 0 {
                // SAFETY: x holds t * k, the weight n * k and out t * n bf16 values, all alive
                // until the stream runs the GEMM (buffers free in stream order).
                unsafe { self.inner.gemm.bf16_xwt(self.stream(), px, wt.buffer().ptr(), py, t, n, k)? };
                return Ok(out);
            }
        }
        let desc = WeightDesc::of(&w.weight, "linear")?;
        check(k * 4 <= MAX_SHARED && n.div_ceil(8) <= 65535, "linear", || {
            format!("weight [{n}, {k}] exceeds the simple kernel's limits")
        })?;
        let ni = i32_of(n, "linear outputs")?;
        let mut l = self.stream().launch_builder(&self.k().linear_rows);
        l.arg(&py).arg(&px).arg(&desc).arg(&ni);
        let cfg = LaunchConfig {
            grid_dim: (t as u32, n.div_ceil(8) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (k * 4) as u32,
        };
        // SAFETY: linear_rows(bf16* y, const bf16* x, WeightDesc w, int n): grid (t, n/8), k f32
        // of shared memory; desc describes the live [n, k] weight (validated at load).
        launched(unsafe { l.launch(cfg) }, "linear_rows")?;
        Ok(out)
    }

    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary(a, b, "add")
    }

    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>> {
        self.binary(gate, up, "swiglu")
    }

    fn gate(&self, x: &Tensor<Self>, g: &Tensor<Self>, act_kind: GateAct) -> Result<Tensor<Self>> {
        let (rows, width) = (x.rows(), x.last_dim());
        let groups = g.numel() / rows.max(1);
        check(g.numel() == rows * groups && groups > 0 && width % groups == 0, "gate", || {
            format!("gate {:?} does not fit input {:?}", g.shape(), x.shape())
        })?;
        let (px, pg) = (act(x, "gate")?, act(g, "gate")?);
        let out = self.empty(DType::BF16, x.shape())?;
        let (po, n, per) = (out.buffer().ptr(), x.numel() as i64, i32_of(width / groups, "gate group")?);
        let a: i32 = match act_kind {
            GateAct::Sigmoid => 0,
            GateAct::Softplus => 1,
        };
        let mut l = Overlapped::new(self, &self.k().gate);
        l.arg(&po).arg(&px).arg(&pg).arg(&n).arg(&per).arg(&a);
        // SAFETY: gate(bf16* out, const bf16* x, const bf16* g, long long n, int per, int act):
        // x and out hold n values, g holds n / per (checked above); the kernel starts with grid_dep_begin.
        unsafe { l.launch(grid1(x.numel()), "gate")? };
        Ok(out)
    }

    fn narrow_cols(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        let width = x.last_dim();
        check(start + len <= width, "narrow_cols", || format!("columns {start}..{} of {:?}", start + len, x.shape()))?;
        let px = act(x, "narrow_cols")?;
        let out = self.empty(DType::BF16, &with_last(x.shape(), len))?;
        let (po, rows, w, s, n) =
            (out.buffer().ptr(), x.rows() as i64, i32_of(width, "width")?, start as i32, len as i32);
        let mut l = Overlapped::new(self, &self.k().narrow_cols);
        l.arg(&po).arg(&px).arg(&rows).arg(&w).arg(&s).arg(&n);
        // SAFETY: narrow_cols(bf16* out, const bf16* x, long long rows, int width, int start,
        // int len): start + len <= width (checked); out holds rows * len values.
        // The kernel starts with grid_dep_begin.
        unsafe { l.launch(grid1(x.rows() * len), "narrow_cols")? };
        Ok(out)
    }

    fn slice_rows(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        let width = x.last_dim();
        check(start + len <= x.rows(), "slice_rows", || format!("rows {start}..{} of {:?}", start + len, x.shape()))?;
        let px = act(x, "slice_rows")?;
        let out = self.empty(DType::BF16, &[len, width])?;
        let bytes = len * width * 2;
        // SAFETY: the source range lies inside x (checked), out holds `bytes`; stream-ordered.
        unsafe {
            result::memcpy_dtod_async(
                out.buffer().ptr(),
                px + (start * width * 2) as u64,
                bytes,
                self.stream().cu_stream(),
            )
        }
        .map_err(|e| driver_err("slice_rows copy", e))?;
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        let width = parts.first().map_or(0, |p| p.last_dim());
        let mut rows = 0;
        for p in parts {
            act(p, "concat_rows")?;
            check(p.last_dim() == width, "concat_rows", || format!("width {} differs from {width}", p.last_dim()))?;
            rows += p.rows();
        }
        let out = self.empty(DType::BF16, &[rows, width])?;
        let mut at = out.buffer().ptr();
        for p in parts {
            let bytes = p.numel() * 2;
            // SAFETY: `out` holds the sum of the parts' bytes; each copy lands in its own range;
            // stream-ordered after the kernels that wrote the parts.
            unsafe { result::memcpy_dtod_async(at, p.buffer().ptr(), bytes, self.stream().cu_stream()) }
                .map_err(|e| driver_err("concat_rows copy", e))?;
            at += bytes as u64;
        }
        Ok(out)
    }

    fn rope(&self, x: &Tensor<Self>, start: usize, rope: &Rope) -> Result<Tensor<Self>> {
        let (t, heads, dim) = x.dims3("cuda", "rope")?;
        let (freqs, half) = rope_freqs(rope, dim, "rope")?;
        let px = act(x, "rope")?;
        let out = self.empty(DType::BF16, x.shape())?;
        let po = out.buffer().ptr();
        let (ti, hi, di, si) = (i32_of(t, "tokens")?, heads as i32, dim as i32, i32_of(start, "position")?);
        let start_at = self.recording().map(|r| r.pos_at("rope", start)).transpose()?.unwrap_or(0);
        let mut l = Overlapped::new(self, &self.k().rope);
        l.arg(&po).arg(&px).arg(&ti).arg(&hi).arg(&di).arg(&si).arg(&start_at).arg(&half);
        l.arg(&freqs).arg(&rope.attention_scaling);
        // SAFETY: rope(bf16* out, const bf16* x, int t, int heads, int d, int start, const int*
        // start_at, int half, RopeFreqs inv (float[128] by value), float scaling): x and out hold
        // t * heads * d values; start_at is 0 or a recording's position; the kernel starts with grid_dep_begin.
        unsafe { l.launch(grid1(x.numel()), "rope")? };
        Ok(out)
    }

    fn causal_conv1d(&self, x: &Tensor<Self>, w: &Tensor<Self>, state: &mut Tensor<Self>) -> Result<Tensor<Self>> {
        let [channels, kernel] = *w.shape() else {
            return Err(err(format!("causal_conv1d: weight must be [channels, kernel], found {:?}", w.shape())));
        };
        check(
            x.last_dim() == channels
                && (1..=CONV_MAX_K).contains(&kernel)
                && state.shape() == [channels, kernel - 1]
                && state.dtype() == DType::BF16,
            "causal_conv1d",
            || format!("input {:?}, weight {:?}, state {} {:?}", x.shape(), w.shape(), state.dtype(), state.shape()),
        )?;
        let (px, pw, wdt, ps) =
            (act(x, "causal_conv1d")?, w.buffer().ptr(), float_code(w, "causal_conv1d")?, state.buffer().ptr());
        let out = self.empty(DType::BF16, x.shape())?;
        let (po, t, c, kk) =
            (out.buffer().ptr(), i32_of(x.rows(), "tokens")?, i32_of(channels, "channels")?, kernel as i32);
        let mut l = self.stream().launch_builder(&self.k().causal_conv1d);
        l.arg(&po).arg(&px).arg(&pw).arg(&wdt).arg(&ps).arg(&t).arg(&c).arg(&kk);
        // SAFETY: causal_conv1d(bf16* out, const bf16* x, const void* w, int wdt, bf16* state,
        // int t, int c, int k): one thread per channel; x/out [t, c], w [c, k], state [c, k-1]
        // bf16 (checked), k <= CONV_MAX_K.
        launched(unsafe { l.launch(grid1(channels)) }, "causal_conv1d")?;
        Ok(out)
    }

    /// The chunked mode takes gdn_chunk.rs's kernels where they fit (key dim 128); everything
    /// else runs the token-by-token kernel (the same arithmetic up to f32 rounding).
    fn gated_delta_rule(
        &self,
        inp: &GdnInputs<'_, Self>,
        state: &mut Tensor<Self>,
        mode: GdnMode,
    ) -> Result<Tensor<Self>> {
        let op = "gated_delta_rule";
        let GdnDims { t, key_heads, value_heads, key_dim, value_dim } = inp.dims(state, "cuda")?;
        check(value_dim <= 1024 && key_dim * 8 <= MAX_SHARED, op, || {
            format!("value dim {value_dim} / key dim {key_dim} exceed this kernel's limits")
        })?;
        let (pq, pk, pv, pa, pb) =
            (act(inp.q, op)?, act(inp.k, op)?, act(inp.v, op)?, act(inp.a, op)?, act(inp.b, op)?);
        let (pal, al_dt, pdt, dt_dt) = (
            inp.a_log.buffer().ptr(),
            float_code(inp.a_log, op)?,
            inp.dt_bias.buffer().ptr(),
            float_code(inp.dt_bias, op)?,
        );
        let ps = state.buffer().ptr();
        let out = self.empty(DType::BF16, &[t, value_heads, value_dim])?;
        let po = out.buffer().ptr();
        let (ti, kh, vh, dk, dv) =
            (i32_of(t, "tokens")?, key_heads as i32, value_heads as i32, key_dim as i32, value_dim as i32);
        if mode == GdnMode::Chunked && crate::gdn_chunk::fits(t, key_dim, value_dim, self.k().max_shared) {
            let ops = crate::gdn_chunk::Operands {
                out: po,
                q: pq,
                k: pk,
                v: pv,
                a: pa,
                b: pb,
                a_log: pal,
                a_log_dt: al_dt,
                dt_bias: pdt,
                dt_bias_dt: dt_dt,
                state: ps,
            };
            crate::gdn_chunk::run(self, &ops, t, key_heads, value_heads, value_dim)?;
            return Ok(out);
        }
        let mut l = self.stream().launch_builder(&self.k().gdn_recurrent);
        l.arg(&po)
            .arg(&pq)
            .arg(&pk)
            .arg(&pv)
            .arg(&pa)
            .arg(&pb)
            .arg(&pal)
            .arg(&al_dt)
            .arg(&pdt)
            .arg(&dt_dt)
            .arg(&ps)
            .arg(&ti)
            .arg(&kh)
            .arg(&vh)
            .arg(&dk)
            .arg(&dv);
        let threads = value_dim.max(1).next_multiple_of(32) as u32;
        let cfg = LaunchConfig {
            grid_dim: (value_heads as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: (key_dim * 8) as u32,
        };
        // SAFETY: gdn_recurrent(bf16* out, q, k, v, a, b, const void* a_log, int, const void*
        // dt_bias, int, float* state, int t, int key_heads, int value_heads, int dk, int dv): one
        // block per value head with >= dv threads and 2 * dk floats of shared memory; every
        // tensor's shape was checked against t, the head counts and dims above.
        launched(unsafe { l.launch(cfg) }, "gdn_recurrent")?;
        Ok(out)
    }

    fn moe(&self, x: &Tensor<Self>, router: &Router<Self>, experts: &MoeExperts<Self>) -> Result<Tensor<Self>> {
        if crate::grouped::fits(x, router, experts) {
            return crate::grouped::moe(self, x, router, experts);
        }
        crate::moe::moe(self, x, router, experts)
    }
}

impl KvOps for CudaBackend {
    type KvCache = CudaKvCache;

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Result<CudaKvCache> {
        check(window != Some(0), "new_kv_cache", || "a sliding window of 0 positions".into())?;
        Ok(CudaKvCache::new(self.alloc().clone(), kv_heads, head_dim, window))
    }

    fn kv_clear(&self, cache: &mut CudaKvCache) -> Result<()> {
        // The rows stay: position p goes to row p (p % window) again, and no kernel reads a row
        // past the positions seen.
        cache.len = 0;
        Ok(())
    }

    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        cache: &mut CudaKvCache,
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        crate::kv::attention(self, q, k, v, cache, params)
    }

    fn kv_reserve(&self, cache: &mut CudaKvCache, positions: usize) -> Result<()> {
        check(self.recording().is_none(), "kv_reserve", || "a recorder cannot move a cache".into())?;
        cache.reserve_total(positions)
    }
}

impl FusedOps for CudaBackend {
    fn linear_many(&self, x: &Tensor<Self>, ws: &[&Linear<Self>]) -> Result<Vec<Tensor<Self>>> {
        // One GEMV launch when every weight reads x's width (gemv checks the rest); else one each.
        if ws.iter().all(|w| w.weight.dims().1 == x.last_dim()) {
            let outs = ws
                .iter()
                .map(|w| self.empty(DType::BF16, &with_last(x.shape(), w.weight.dims().0)))
                .collect::<Result<Vec<_>>>()?;
            let parts: Vec<_> = ws.iter().zip(&outs).map(|(w, o)| (&w.weight, o.buffer().ptr())).collect();
            if crate::gemv::gemv(self, act(x, "linear")?, x.rows(), &parts)? {
                return Ok(outs);
            }
        }
        ws.iter().map(|w| self.linear(x, w)).collect()
    }

    fn add_rms_norm(
        &self,
        x: &Tensor<Self>,
        y: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        kind: NormKind,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let d = x.last_dim();
        check(x.shape() == y.shape() && w.numel() == d, "add_rms_norm", || {
            format!("inputs {:?} and {:?}, weight {:?}", x.shape(), y.shape(), w.shape())
        })?;
        let (px, py, pw, wdt) =
            (act(x, "add_rms_norm")?, act(y, "add_rms_norm")?, w.buffer().ptr(), float_code(w, "add_rms_norm")?);
        let offset = kind.weight_offset();
        let (sum, out) = (self.empty(DType::BF16, x.shape())?, self.empty(DType::BF16, x.shape())?);
        let (ps, po, di) = (sum.buffer().ptr(), out.buffer().ptr(), i32_of(d, "norm width")?);
        let mut l = Overlapped::new(self, &self.k().add_rms_norm);
        l.arg(&ps).arg(&po).arg(&px).arg(&py).arg(&pw).arg(&wdt).arg(&di).arg(&eps).arg(&offset);
        let cfg = LaunchConfig { grid_dim: (x.rows() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: add_rms_norm(bf16* sum, bf16* out, const bf16* x, const bf16* y, const void* w,
        // int wdt, int d, float eps, float offset): one block per row of d values; x, y, sum, out
        // hold rows * d values (one shape, checked), w holds d values of dtype wdt.
        // The kernel starts with grid_dep_begin.
        unsafe { l.launch(cfg, "add_rms_norm")? };
        Ok((sum, out))
    }

    /// A few tokens (decode) take the fused kernels of moe_decode.rs, the rest the composed ops.
    fn moe_block(
        &self,
        x: &Tensor<Self>,
        router: &Router<Self>,
        experts: &MoeExperts<Self>,
        shared: Option<&SharedExpert<'_, Self>>,
    ) -> Result<Tensor<Self>> {
        match crate::moe_decode::moe_block(self, x, router, experts, shared)? {
            Some(out) => Ok(out),
            None => vt_core::backend::composed::moe_block(self, x, router, experts, shared),
        }
    }

    fn gated_delta_step(&self, step: &GdnStep<'_, Self>, states: &mut [GdnState<'_, Self>]) -> Result<Tensor<Self>> {
        match crate::gdn_decode::step(self, step, states)? {
            Some(out) => Ok(out),
            None => vt_core::backend::composed::gated_delta_step(self, step, states),
        }
    }

    fn attention_decode(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        rope: &Rope,
        positions: &[usize],
        caches: &mut [&mut CudaKvCache],
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        match crate::kv::attention_decode(self, q, k, v, rope, positions, caches, params)? {
            Some(out) => Ok(out),
            None => vt_core::backend::composed::attention_decode(self, q, k, v, rope, positions, caches, params),
        }
    }
}

impl StepRecording for CudaBackend {
    type StepGraph = CudaStepGraph;

    fn recorder(&self, ids: usize, pos: usize) -> Result<Option<Self>> {
        check(self.recording().is_none(), "recorder", || "a recorder cannot record".into())?;
        let recording = Recording::begin(self.stream(), self.buffer(4 * (1 + ids))?, ids, pos)?;
        let alloc = Arc::new(Allocator::for_recording(self.alloc(), recording.stream().clone()));
        let inner = Inner {
            id: self.inner.id,
            kernels: self.inner.kernels.clone(),
            gemm: self.inner.gemm.clone(),
            alloc,
            recording: Some(recording),
        };
        Ok(Some(CudaBackend { inner: Arc::new(inner) }))
    }

    fn is_recording(&self) -> bool {
        self.recording().is_some()
    }

    fn finish_recording(&self, recorder: Self) -> Result<CudaStepGraph> {
        crate::record::finish(self, recorder)
    }

    fn replay(
        &self,
        graph: &mut CudaStepGraph,
        ids: &[u32],
        pos: usize,
        caches: &mut [&mut CudaKvCache],
    ) -> Result<bool> {
        crate::record::replay(self, graph, ids, pos, caches)
    }
}
