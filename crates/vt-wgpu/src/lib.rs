//! vt-wgpu: the portable GPU backend (Vulkan, Metal, DX12) on wgpu, every op a WGSL compute
//! shader (src/shaders/).
//!
//! Numerics: activations are f32. WGSL has no bf16, and f16 (`SHADER_F16`) is optional (lavapipe
//! has it, not every adapter does); f32 keeps one code path on every adapter and holds this
//! backend to vt-cpu's f32 parity rule. f16 activations where the adapter has them would halve
//! activation traffic: a later step. Weights stay in their stored dtype (bf16/f16/f32, NVFP4,
//! FP8) and are decoded in the shaders; accumulation and the GDN state are f32.
//!
//! Memory comes from vt-core's shared allocator over wgpu buffers (memory.rs), commands are
//! recorded in issue order into one encoder (gpu.rs). An MoE layer's experts are kept stacked
//! (one buffer per half, which one dispatch can index; each expert's tensors are parts of it),
//! and the layer's derived state (the stacks as dispatches bind them) lives in its resident slot.

mod gdn;
mod gpu;
mod kv;
mod memory;
mod moe;
mod rows;
mod shaders;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vt_core::backend::prelude::*;
use vt_core::backend::{check, Pick};
use vt_core::{
    AttentionParams, DType, GateAct, GdnInputs, GdnMode, KvLayout, KvSeq, Linear, MemoryStats, MoeExperts, NormKind,
    Result, Rope, Router, Tensor, Weight,
};

pub use gpu::Gpu;
pub use kv::{WgpuKvPool, KV_BLOCK};
pub use memory::{AllocMode, GpuBuffer};
pub use moe::WgpuExpertTable;

use gpu::{err, Range, LOOP_BUDGET};
use memory::{Allocator, GpuMemory};
use shaders::Kernel;

/// Source of instance ids; ids only distinguish instances, nothing is keyed by them globally.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// The wgpu backend. Clones share one device and allocator.
#[derive(Clone)]
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    alloc: Arc<Allocator>,
    id: u64,
}

/// Workgroup width of every kernel.
const WG: usize = 64;

/// Format words of a weight as weights.wgsl reads them: format, rows, inputs, FP8 block.
type FmtWords = [u32; 5];

fn dense_format(dtype: DType) -> Result<u32> {
    Ok(match dtype {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F8E4M3 => 3,
        other => return Err(err(format!("no shader decodes {other} values"))),
    })
}

/// The ops of elementwise.wgsl.
#[derive(Clone, Copy)]
enum Elementwise {
    Add,
    Swiglu,
    /// `x * act(g)`, a gate value per `per` values of x.
    Gate(GateAct, usize),
    /// The MoE's weighted sum of each token's `top_k` expert rows (weights in the second operand).
    WeightedSum {
        top_k: usize,
    },
}

/// What linear.wgsl computes for each row.
#[derive(Clone, Copy)]
enum Rows {
    /// A linear: the one matrix bound (the weight's rows from `col0`: rows.rs), for every row,
    /// into its columns from `col0` of rows of `cols`.
    Linear { col0: usize, cols: usize },
    /// The routed experts' gate and up (`up`) or down, for the slots whose expert is one of
    /// `experts` (a range: the matrices bound).
    Experts { up: bool, top_k: usize, experts: (usize, usize) },
}

/// Checked conversion of a size to a shader's u32.
fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| err(format!("{what} {n} exceeds a shader's 32-bit index")))
}

impl WgpuBackend {
    pub fn new() -> Result<Self> {
        Self::with_mode(AllocMode::System)
    }

    pub fn with_mode(mode: AllocMode) -> Result<Self> {
        Ok(Self::on(&Gpu::new()?, mode))
    }

    /// A backend instance on a device another instance may share (as CUDA backends share a
    /// GPU's context): its own allocator, id and memory; the device's compiled kernels shared.
    /// Tests that make many backends use it, so each kernel compiles once.
    pub fn on(gpu: &Arc<Gpu>, mode: AllocMode) -> Self {
        WgpuBackend {
            alloc: Arc::new(Allocator::new(mode, GpuMemory::new(gpu.clone()))),
            gpu: gpu.clone(),
            id: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The adapter this backend runs on.
    pub fn adapter(&self) -> String {
        self.gpu.describe()
    }

    /// Waits for every recorded op.
    pub fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }

    fn buffer(&self, len: usize) -> Result<GpuBuffer> {
        GpuBuffer::new(&self.alloc, len)
    }

    /// An f32 tensor for an op to fill.
    fn output(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        let n: usize = shape.iter().product();
        Ok(Tensor::from_parts(self.buffer(n * 4)?, DType::F32, shape.to_vec()))
    }

    /// A fresh storage buffer of host data (ids, tables) that an op binds.
    fn host_data(&self, bytes: &[u8]) -> Result<wgpu::Buffer> {
        self.gpu.init_buffer(bytes, wgpu::BufferUsages::STORAGE)
    }

    /// A small float tensor (norm weight, bias, gate parameter) as f32.
    fn small_f32(&self, t: &Tensor<Self>, op: &str) -> Result<Tensor<Self>> {
        let fmt =
            dense_format(t.dtype()).map_err(|_| err(format!("{op}: expected a float tensor, found {}", t.dtype())))?;
        let n = t.numel();
        let out = self.output(&[n])?;
        let w = t.buffer().range();
        let params = [fmt, 1, u32_of(n, op)?, 1, 1, u32_of(n, op)?];
        let bindings = [(1, w), (2, w), (3, w), (5, out.buffer().range())];
        self.gpu.dispatch(Kernel::Convert, &params, &bindings, self.gpu.grid(n, WG)?)?;
        Ok(out)
    }

    /// Format words and (values, scales, globals) of a linear weight; `keep` holds the global
    /// scale's buffer for the call.
    fn weight_parts<'a>(
        &self,
        w: &'a Weight<Self>,
        keep: &'a mut Option<wgpu::Buffer>,
    ) -> Result<(FmtWords, [Range<'a>; 3])> {
        let (n, k) = w.dims();
        let (n32, k32) = (u32_of(n, "weight rows")?, u32_of(k, "weight inputs")?);
        Ok(match w {
            Weight::Dense(t) => {
                let r = t.buffer().range();
                ([dense_format(t.dtype())?, n32, k32, 1, 1], [r, r, r])
            }
            Weight::Nvfp4(q) => {
                let g = keep.insert(self.host_data(&q.global_scale.to_le_bytes())?);
                let g = Range { buffer: g, offset: 0, size: 4 };
                ([4, n32, k32, 1, 1], [q.codes.buffer().range(), q.scales.buffer().range(), g])
            }
            Weight::Fp8(q) => {
                let r = q.scales.buffer().range();
                let block = [u32_of(q.block[0], "FP8 block")?, u32_of(q.block[1], "FP8 block")?];
                ([5, n32, k32, block[0], block[1]], [q.values.buffer().range(), r, r])
            }
        })
    }

    /// elementwise.wgsl's `op` over `a`'s shape.
    fn elementwise(&self, op: Elementwise, a: &Tensor<Self>, b: &Tensor<Self>, name: &str) -> Result<Tensor<Self>> {
        let (a_buf, b_buf) = (act(a, name)?, act(b, name)?);
        let (code, per, k) = match op {
            Elementwise::Add => (0, 1, 0),
            Elementwise::Swiglu => (1, 1, 0),
            Elementwise::Gate(GateAct::Sigmoid, per) => (2, per, 0),
            Elementwise::Gate(GateAct::Softplus, per) => (3, per, 0),
            Elementwise::WeightedSum { top_k } => (4, a.last_dim(), top_k),
        };
        let shape = match op {
            Elementwise::WeightedSum { top_k } => [&[a.rows() / top_k.max(1)], &a.shape()[1..]].concat(),
            _ => a.shape().to_vec(),
        };
        let out = self.output(&shape)?;
        let n = out.numel();
        let params = [code, u32_of(n, name)?, u32_of(per.max(1), name)?, u32_of(k, name)?];
        let bindings = [(1, a_buf.range()), (2, b_buf.range()), (3, out.buffer().range())];
        self.gpu.dispatch(Kernel::Elementwise, &params, &bindings, self.gpu.grid(n, WG)?)?;
        Ok(out)
    }

    /// linear.wgsl: `rows` rows of `n` outputs of the weight (`fmt`, `w`) times rows of `x`, as
    /// `what` says (`ids`: the slots' experts).
    fn matvec(
        &self,
        (fmt, w): (&FmtWords, [Range<'_>; 3]),
        what: Rows,
        x: Range<'_>,
        ids: Range<'_>,
        y: Range<'_>,
        (rows, n): (usize, usize),
    ) -> Result<()> {
        let op = "linear";
        if rows == 0 {
            return Ok(());
        }
        let (mode, top_k, (first, end), (col0, cols)) = match what {
            Rows::Linear { col0, cols } => (0, 1, (0, 1), (col0, cols)),
            Rows::Experts { up, top_k, experts } => (1 + up as u32, top_k, experts, (0, n)),
        };
        // An output is a loop over the inputs (two, for gate and up): past the budget, lavapipe
        // would end it early, so no adapter takes it.
        let inputs = fmt[2] as usize;
        if (inputs + 1) * (1 + (mode == 2) as usize) > LOOP_BUDGET {
            return Err(err(format!(
                "{op}: {inputs} inputs a row exceed the {LOOP_BUDGET} loop iterations a shader invocation may take"
            )));
        }
        let mut params = fmt.to_vec();
        params.extend([mode, u32_of(top_k, op)?, u32_of(first, op)?, u32_of(end, op)?]);
        params.extend([u32_of(cols, op)?, u32_of(col0, op)?]);
        let bindings = [(1, w[0]), (2, w[1]), (3, w[2]), (4, x), (5, ids), (6, y)];
        let groups = [self.gpu.axis(n.div_ceil(WG), op)?, self.gpu.axis(rows, op)?, 1];
        self.gpu.dispatch(Kernel::Linear, &params, &bindings, groups)
    }

    /// Copies `len` bytes between tensors' buffers in command order.
    fn copy(&self, src: &GpuBuffer, from: usize, dst: &GpuBuffer, to: usize, len: usize) {
        if len == 0 {
            return;
        }
        let (s, d) = (src.sub(from, len), dst.sub(to, len));
        self.gpu.record(|e| e.copy_buffer_to_buffer(s.buffer, s.offset, d.buffer, d.offset, len as u64));
    }

    fn norm(
        &self,
        x: &Tensor<Self>,
        z: Option<&Tensor<Self>>,
        w: &Tensor<Self>,
        eps: f32,
        offset: f32,
        op: &str,
    ) -> Result<Tensor<Self>> {
        let xb = act(x, op)?;
        let zb = z.map(|z| act(z, op)).transpose()?.unwrap_or(xb);
        let w = self.small_f32(w, op)?;
        let out = self.output(x.shape())?;
        let rows = x.rows();
        let [gx, gy, _] = self.gpu.grid(rows, 1)?;
        let params =
            [u32_of(x.last_dim(), op)?, eps.to_bits(), offset.to_bits(), z.is_some() as u32, u32_of(rows, op)?];
        let bindings = [(1, xb.range()), (2, w.buffer().range()), (3, zb.range()), (4, out.buffer().range())];
        self.gpu.dispatch(Kernel::RmsNorm, &params, &bindings, [gx, gy, 1])?;
        Ok(out)
    }
}

/// The buffer of an f32 activation, or an error naming the op.
fn act<'a>(t: &'a Tensor<WgpuBackend>, op: &str) -> Result<&'a GpuBuffer> {
    if t.dtype() != DType::F32 {
        return Err(err(format!("{op}: expected an F32 activation, found {} {:?}", t.dtype(), t.shape())));
    }
    Ok(t.buffer())
}

impl Device for WgpuBackend {
    type Buffer = GpuBuffer;

    fn name(&self) -> &'static str {
        "wgpu"
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

    fn buffer_addr(&self, buf: &GpuBuffer) -> usize {
        buf.addr()
    }

    fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<Self>> {
        check::upload(self, dtype, shape, bytes)?;
        let buf = self.buffer(bytes.len())?;
        self.gpu.write(buf.range(), bytes)?;
        Ok(Tensor::from_parts(buf, dtype, shape.to_vec()))
    }

    fn from_f32(&self, shape: &[usize], data: &[f32]) -> Result<Tensor<Self>> {
        check::from_f32(self, shape, data)?;
        self.upload(DType::F32, shape, bytemuck::cast_slice(data))
    }

    fn zeros_f32(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        self.output(shape)
    }

    fn zeros(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        self.output(shape)
    }

    fn zero(&self, t: &mut Tensor<Self>) -> Result<()> {
        t.buffer().clear();
        Ok(())
    }

    fn copy_into(&self, src: &Tensor<Self>, dst: &mut Tensor<Self>) -> Result<()> {
        check::copy_into(self, src, dst)?;
        let len = src.dtype().bytes_for(src.numel()).ok_or_else(|| err("copy_into: bad element count"))?;
        // Whole 4-byte words: the blocks are 256-byte multiples, so the padding is the block's own.
        self.copy(src.buffer(), 0, dst.buffer(), 0, len.next_multiple_of(4));
        Ok(())
    }

    /// On the device (argmax.wgsl): only the picks come back.
    fn argmax_rows(&self, x: &Tensor<Self>, allowed: Option<&[u32]>) -> Result<Vec<Pick>> {
        let op = "argmax_rows";
        vt_core::backend::composed::check_allowed(x, allowed)?;
        let (rows, width) = (x.rows(), x.last_dim());
        if rows == 0 {
            return Ok(Vec::new());
        }
        let fmt = dense_format(x.dtype())?;
        let words = vt_core::backend::mask_words(width);
        let mask = self.host_data(allowed.map_or(&[0u8; 4][..], bytemuck::cast_slice))?;
        let picks = self.buffer(rows * 8)?;
        let w = x.buffer().range();
        let params = [fmt, u32_of(rows, op)?, u32_of(width, op)?, 1, 1, allowed.is_some() as u32, u32_of(words, op)?];
        let bindings =
            [(1, w), (2, w), (3, w), (4, Range { buffer: &mask, offset: 0, size: mask.size() }), (5, picks.range())];
        self.gpu.dispatch(Kernel::Argmax, &params, &bindings, self.gpu.grid(rows, 1)?)?;
        let bytes = self.gpu.read(picks.range(), rows * 8)?;
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        Ok(bytes.chunks_exact(8).map(|p| Pick { id: word(&p[..4]), finite: word(&p[4..]) != 0 }).collect())
    }

    fn expert_parts(&self, experts: Vec<vt_core::Expert<Self>>) -> Result<Vec<vt_core::Expert<Self>>> {
        moe::stack_experts(self, experts)
    }

    fn to_f32(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        check::to_f32(self, t)?;
        let len = t.dtype().bytes_for(t.numel()).ok_or_else(|| err("to_f32: bad element count"))?;
        let bytes = self.gpu.read(t.buffer().range(), len)?;
        let mut out = vec![0.0; t.numel()];
        vt_core::dtype::decode_into(t.dtype(), &bytes, &mut out);
        Ok(out)
    }
}

impl Ops for WgpuBackend {
    fn embedding(&self, table: &Tensor<Self>, ids: &[u32]) -> Result<Tensor<Self>> {
        let op = "embedding";
        let (vocab, hidden) = check::embedding(self, table, ids)?;
        let out = self.output(&[ids.len(), hidden])?;
        let n = ids.len() * hidden;
        let ids_buf = self.host_data(bytemuck::cast_slice(ids))?;
        let idr = Range { buffer: &ids_buf, offset: 0, size: ids_buf.size() };
        let fmt = dense_format(table.dtype())?;
        let w = table.buffer().range();
        let row = rows::PartRows { bytes: table.dtype().bytes_for(hidden).unwrap_or(0), block: 1 };
        for piece in self.pieces(vocab, &[row], [w, w, w])? {
            let w = piece.ranges[0];
            let rows = u32_of(piece.end - piece.first, op)?;
            let (first, end) = (u32_of(piece.first, op)?, u32_of(piece.end, op)?);
            let params = [fmt, rows, u32_of(hidden, op)?, 1, 1, u32_of(n, op)?, first, end];
            let bindings = [(1, w), (2, w), (3, w), (4, idr), (5, out.buffer().range())];
            self.gpu.dispatch(Kernel::Embedding, &params, &bindings, self.gpu.grid(n, WG)?)?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &Tensor<Self>, w: &Tensor<Self>, eps: f32, kind: NormKind) -> Result<Tensor<Self>> {
        check::rms_norm(self, x, w)?;
        self.norm(x, None, w, eps, kind.weight_offset(), "rms_norm")
    }

    fn rms_norm_gated(&self, x: &Tensor<Self>, z: &Tensor<Self>, w: &Tensor<Self>, eps: f32) -> Result<Tensor<Self>> {
        check::rms_norm_gated(self, x, z, w)?;
        self.norm(x, Some(z), w, eps, 0.0, "rms_norm_gated")
    }

    fn linear(&self, x: &Tensor<Self>, w: &Linear<Self>) -> Result<Tensor<Self>> {
        let (n, _) = check::linear(self, x, w)?;
        let xb = act(x, "linear")?;
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("checked non-scalar") = n;
        let out = self.output(&shape)?;
        let mut keep = None;
        let (mut fmt, pieces) = self.row_pieces(&w.weight, &mut keep)?;
        for piece in pieces {
            let rows = piece.end - piece.first;
            fmt[1] = u32_of(rows, "linear")?;
            let what = Rows::Linear { col0: piece.first, cols: n };
            // No ids: the input is bound in their place, unread.
            let (input, y) = (xb.range(), out.buffer().range());
            self.matvec((&fmt, piece.ranges), what, input, input, y, (x.rows(), rows))?;
        }
        Ok(out)
    }

    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        check::same_shape(self, "add", a, b)?;
        self.elementwise(Elementwise::Add, a, b, "add")
    }

    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>> {
        check::same_shape(self, "swiglu", gate, up)?;
        self.elementwise(Elementwise::Swiglu, gate, up, "swiglu")
    }

    fn gate(&self, x: &Tensor<Self>, g: &Tensor<Self>, act: GateAct) -> Result<Tensor<Self>> {
        let per = check::gate(self, x, g)?;
        self.elementwise(Elementwise::Gate(act, per), x, g, "gate")
    }

    fn narrow_cols(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        let op = "narrow_cols";
        check::narrow_cols(self, x, start, len)?;
        let xb = act(x, op)?;
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("non-scalar") = len;
        let out = self.output(&shape)?;
        let n = x.rows() * len;
        let params = [u32_of(n, op)?, u32_of(x.last_dim(), op)?, u32_of(start, op)?, u32_of(len.max(1), op)?];
        self.gpu.dispatch(
            Kernel::Narrow,
            &params,
            &[(1, xb.range()), (2, out.buffer().range())],
            self.gpu.grid(n, WG)?,
        )?;
        Ok(out)
    }

    fn slice_rows(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        check::slice_rows(self, x, start, len)?;
        let width = x.last_dim();
        let out = self.output(&[len, width])?;
        self.copy(act(x, "slice_rows")?, start * width * 4, out.buffer(), 0, len * width * 4);
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        let (rows, width) = check::concat_rows(self, parts)?;
        let out = self.output(&[rows, width])?;
        let mut at = 0;
        for p in parts {
            let bytes = p.numel() * 4;
            self.copy(act(p, "concat_rows")?, 0, out.buffer(), at, bytes);
            at += bytes;
        }
        Ok(out)
    }

    fn rope(&self, x: &Tensor<Self>, start: usize, rope: &Rope) -> Result<Tensor<Self>> {
        let op = "rope";
        let (t, heads, dim) = check::rope(self, x, rope)?;
        let xb = act(x, op)?;
        // The angles as vt-cpu takes them: an f32 product, cos and sin in f32, times the scaling.
        let table: Vec<f32> = (0..t)
            .flat_map(|i| {
                let pos = (start + i) as f32;
                rope.inv_freq.iter().flat_map(move |&f| {
                    let a = pos * f;
                    [a.cos() * rope.attention_scaling, a.sin() * rope.attention_scaling]
                })
            })
            .collect();
        let cs = self.host_data(bytemuck::cast_slice(&table))?;
        let out = self.output(x.shape())?;
        let n = x.numel();
        let params = [u32_of(n, op)?, u32_of(heads, op)?, u32_of(dim, op)?, u32_of(rope.inv_freq.len(), op)?];
        let csr = Range { buffer: &cs, offset: 0, size: cs.size() };
        let bindings = [(1, xb.range()), (2, csr), (3, out.buffer().range())];
        self.gpu.dispatch(Kernel::Rope, &params, &bindings, self.gpu.grid(n, WG)?)?;
        Ok(out)
    }

    fn causal_conv1d(&self, x: &Tensor<Self>, w: &Tensor<Self>, state: &mut Tensor<Self>) -> Result<Tensor<Self>> {
        let op = "causal_conv1d";
        let (channels, kernel) = check::causal_conv1d(self, x, w, state)?;
        let (xb, sb) = (act(x, op)?, act(state, op)?);
        let w = self.small_f32(w, op)?;
        let out = self.output(x.shape())?;
        let params = [u32_of(x.rows(), op)?, u32_of(channels, op)?, u32_of(kernel, op)?];
        let bindings = [(1, xb.range()), (2, w.buffer().range()), (3, sb.range()), (4, out.buffer().range())];
        self.gpu.dispatch(Kernel::Conv, &params, &bindings, self.gpu.grid(channels, WG)?)?;
        Ok(out)
    }

    fn gated_delta_rule(
        &self,
        inp: &GdnInputs<'_, Self>,
        state: &mut Tensor<Self>,
        mode: GdnMode,
    ) -> Result<Tensor<Self>> {
        gdn::gated_delta_rule(self, inp, state, mode)
    }

    fn moe(&self, x: &Tensor<Self>, router: &Router<Self>, experts: &MoeExperts<Self>) -> Result<Tensor<Self>> {
        let dims = check::moe(self, x, router, experts)?;
        check::whole_experts(self, experts, "moe")?;
        let table = self.expert_table(experts)?;
        moe::moe(self, x, router, table, &dims)
    }

    fn prepare_experts(&self, experts: &MoeExperts<Self>) -> Result<()> {
        self.expert_table(experts).map(|_| ())
    }
}

impl WgpuBackend {
    /// The experts' stacked weights (moe.rs), built into their resident slot on first use.
    fn expert_table<'e>(&self, experts: &'e MoeExperts<Self>) -> Result<&'e WgpuExpertTable> {
        experts.resident.get_or_try_init(self, || moe::build_table(self, experts))
    }
}

impl KvOps for WgpuBackend {
    type KvPool = WgpuKvPool;

    fn kv_block_size(&self) -> usize {
        KV_BLOCK
    }

    fn new_kv_pool(&self, layers: &[KvLayout]) -> Result<WgpuKvPool> {
        kv::new_pool(self, layers)
    }

    fn copy_kv_block(&self, pool: &mut WgpuKvPool, layer: usize, src: u32, dst: u32) -> Result<()> {
        kv::copy_block(self, pool, layer, src, dst)
    }

    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        pool: &mut WgpuKvPool,
        seq: KvSeq<'_>,
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        let dims = check::attention(self, q, k, v, params)?;
        kv::attention(self, q, k, v, pool, seq, params, &dims)
    }
}

/// Every fused op composed from the primitive ones.
impl FusedOps for WgpuBackend {}

/// Steps are not recorded.
impl StepRecording for WgpuBackend {
    type StepGraph = ();
}
