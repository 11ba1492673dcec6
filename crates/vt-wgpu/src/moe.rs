//! The routed experts of an MoE layer: routing on the device (route.wgsl), then each routed slot's
//! expert (linear.wgsl's expert modes) and the weighted sum (elementwise.wgsl).
//!
//! A shader binds a fixed set of buffers, so it cannot reach E experts' separate tensors: the
//! backend keeps a layer's experts stacked in their stored form (`stack_experts`, which
//! `MoeExperts::new` calls through `Device::expert_parts`): gate and up as matrices 2e and
//! 2e + 1 of one stack, down as matrix e of another, each stack in pieces of whole experts that
//! fit one binding of the adapter (a dispatch per piece). Each expert's tensors are parts of
//! those pieces, so the weights are held once. The layer's derived state (`WgpuExpertTable`, in
//! its resident slot) is the pieces as the dispatches bind them, and NVFP4's global scales.

use std::sync::Arc;

use vt_core::backend::check::MoeDims;
use vt_core::backend::Ops;
use vt_core::{Expert, Fp8Block, MoeExperts, Nvfp4, Result, Router, RouterKind, Tensor, Weight};

use crate::gpu::{err, Range};
use crate::shaders::Kernel;
use crate::{act, dense_format, u32_of, Elementwise, FmtWords, GpuBuffer, Rows, WgpuBackend, WG};

/// Most experts and top-k the routing shader takes (its private arrays).
const MAX_EXPERTS: usize = 1024;
const MAX_TOP_K: usize = 64;

type W = Weight<WgpuBackend>;

/// Matrices of one format and shape, stacked as weights.wgsl reads them, in pieces of whole
/// experts that each fit one binding of the adapter.
struct Stack {
    fmt: FmtWords,
    pieces: Vec<Piece>,
}

/// The stacked matrices of experts `first..end`.
struct Piece {
    first: usize,
    end: usize,
    values: Arc<GpuBuffer>,
    /// NVFP4's fp8 scales, FP8's block scales; `None` for dense weights.
    scales: Option<Arc<GpuBuffer>>,
    /// NVFP4's global scale per matrix.
    globals: Option<GpuBuffer>,
}

impl Piece {
    fn ranges(&self) -> [Range<'_>; 3] {
        let v = self.values.range();
        [v, self.scales.as_ref().map_or(v, |s| s.range()), self.globals.as_ref().map_or(v, GpuBuffer::range)]
    }
}

/// A layer's experts, stacked (see the module docs).
pub struct WgpuExpertTable {
    gate_up: Stack,
    down: Stack,
}

/// The tensors of one matrix in a stack: values, scales, global scale.
fn parts(w: &W) -> (&Tensor<WgpuBackend>, Option<&Tensor<WgpuBackend>>, Option<f32>) {
    match w {
        Weight::Dense(t) => (t, None, None),
        Weight::Nvfp4(q) => (&q.codes, Some(&q.scales), Some(q.global_scale)),
        Weight::Fp8(q) => (&q.values, Some(&q.scales), None),
    }
}

/// Format words of a weight; every matrix of a stack must give the same.
fn format(w: &W) -> Result<FmtWords> {
    let (n, k) = w.dims();
    let (n, k) = (u32_of(n, "expert rows")?, u32_of(k, "expert inputs")?);
    Ok(match w {
        Weight::Dense(t) => [dense_format(t.dtype())?, n, k, 1, 1],
        Weight::Nvfp4(_) => [4, n, k, 1, 1],
        Weight::Fp8(q) => [5, n, k, u32_of(q.block[0], "FP8 block")?, u32_of(q.block[1], "FP8 block")?],
    })
}

/// How a stack is laid out: its matrices' format, the value and scale bytes of one matrix, and
/// how many experts a piece takes.
struct Layout {
    fmt: FmtWords,
    value_bytes: usize,
    scale_bytes: usize,
    experts_a_piece: usize,
}

fn layout(b: &WgpuBackend, ws: &[&W], per: usize, what: &str) -> Result<Layout> {
    let fmt = format(ws[0])?;
    let (v0, s0, _) = parts(ws[0]);
    let bytes = |t: &Tensor<WgpuBackend>| t.dtype().bytes_for(t.numel()).unwrap_or(0);
    let (vb, sb) = (bytes(v0), s0.map_or(0, bytes));
    if vb % 4 != 0 || sb % 4 != 0 {
        return Err(err(format!("{what}: experts of {vb} value bytes, {sb} scale bytes do not stack (4-byte copies)")));
    }
    if ws.iter().any(|w| format(w).ok() != Some(fmt)) {
        return Err(err(format!("{what}: every expert must share one storage format and shape")));
    }
    let limits = &b.gpu.limits;
    let limit = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size) as usize;
    let expert_bytes = per * vb.max(sb);
    if expert_bytes > limit {
        return Err(err(format!(
            "{what}: an expert's {expert_bytes} bytes exceed the adapter's binding limit of {limit}"
        )));
    }
    Ok(Layout { fmt, value_bytes: vb, scale_bytes: sb, experts_a_piece: limit / expert_bytes })
}

/// `w` with its values and scales in `values` and `scales`.
fn moved(w: &W, values: GpuBuffer, scales: Option<GpuBuffer>) -> Result<W> {
    let tensor = |t: &Tensor<WgpuBackend>, buf| Tensor::from_parts(buf, t.dtype(), t.shape().to_vec());
    let scales = |s: &Tensor<WgpuBackend>| scales.map(|buf| tensor(s, buf)).ok_or_else(|| err("scales not stacked"));
    Ok(match w {
        Weight::Dense(t) => Weight::Dense(tensor(t, values)),
        Weight::Nvfp4(q) => Weight::Nvfp4(Nvfp4 {
            codes: tensor(&q.codes, values),
            scales: scales(&q.scales)?,
            global_scale: q.global_scale,
        }),
        Weight::Fp8(q) => {
            Weight::Fp8(Fp8Block { values: tensor(&q.values, values), scales: scales(&q.scales)?, block: q.block })
        }
    })
}

/// `ws` (`per` matrices an expert) moved into stacked pieces: the same weights, each over its
/// place in them. The uploads go when this returns.
fn stacked(b: &WgpuBackend, ws: Vec<W>, per: usize, what: &str) -> Result<Vec<W>> {
    let l = layout(b, &ws.iter().collect::<Vec<_>>(), per, what)?;
    let (vb, sb) = (l.value_bytes, l.scale_bytes);
    let mut out = Vec::with_capacity(ws.len());
    for piece in ws.chunks(per * l.experts_a_piece) {
        let values = Arc::new(b.buffer(vb * piece.len())?);
        let scales = (sb > 0).then(|| b.buffer(sb * piece.len()).map(Arc::new)).transpose()?;
        for (i, w) in piece.iter().enumerate() {
            let (v, s, _) = parts(w);
            b.copy(v.buffer(), 0, &values, i * vb, vb);
            if let (Some(s), Some(dst)) = (s, &scales) {
                b.copy(s.buffer(), 0, dst, i * sb, sb);
            }
            let scale_part = scales.as_ref().map(|s| GpuBuffer::part(s, i * sb, sb));
            out.push(moved(w, GpuBuffer::part(&values, i * vb, vb), scale_part)?);
        }
    }
    Ok(out)
}

/// One layer's experts as the backend keeps them (see the module docs).
pub fn stack_experts(b: &WgpuBackend, experts: Vec<Expert<WgpuBackend>>) -> Result<Vec<Expert<WgpuBackend>>> {
    let (mut gate_up, mut down) = (Vec::new(), Vec::new());
    for e in experts {
        gate_up.extend([e.gate, e.up]);
        down.push(e.down);
    }
    let mut gate_up = stacked(b, gate_up, 2, "experts' gate/up")?.into_iter();
    let down = stacked(b, down, 1, "experts' down")?;
    down.into_iter()
        .map(|down| match (gate_up.next(), gate_up.next()) {
            (Some(gate), Some(up)) => Ok(Expert { gate, up, down }),
            _ => Err(err("experts' gate/up: fewer stacked than uploaded")),
        })
        .collect()
}

/// The pieces `stacked` made of `ws`, as the dispatches bind them; an error if the matrices are
/// not where it put them.
fn stack(b: &WgpuBackend, ws: &[&W], per: usize, what: &str) -> Result<Stack> {
    let l = layout(b, ws, per, what)?;
    let experts = ws.len() / per;
    let mut pieces = Vec::new();
    let mut first = 0;
    while first < experts {
        let end = (first + l.experts_a_piece).min(experts);
        let matrices = &ws[first * per..end * per];
        let block_of = |t: Option<&Tensor<WgpuBackend>>, bytes: usize| -> Option<Arc<GpuBuffer>> {
            let (block, at) = t?.buffer().block()?;
            (at == 0 && block.len() == bytes * matrices.len()).then(|| block.clone())
        };
        let values = block_of(Some(parts(matrices[0]).0), l.value_bytes);
        let scales = block_of(parts(matrices[0]).1, l.scale_bytes);
        let placed = |i: usize, w: &W| {
            let (v, s, _) = parts(w);
            let at = |t: &Tensor<WgpuBackend>, block: &Option<Arc<GpuBuffer>>, bytes: usize| {
                let here = t.buffer().block();
                block.as_ref().zip(here).is_some_and(|(q, (p, o))| Arc::ptr_eq(p, q) && o == i * bytes)
            };
            at(v, &values, l.value_bytes) && s.is_none_or(|s| at(s, &scales, l.scale_bytes))
        };
        let in_place = matrices.iter().enumerate().all(|(i, w)| placed(i, w));
        let (true, Some(values)) = (in_place, values) else {
            return Err(err(format!("{what}: experts {first}..{end} are not stacked as the backend keeps experts")));
        };
        let globals: Vec<f32> = matrices.iter().filter_map(|w| parts(w).2).collect();
        let globals = if globals.is_empty() {
            None
        } else {
            let buf = b.buffer(globals.len() * 4)?;
            b.gpu.write(buf.range(), bytemuck::cast_slice(&globals))?;
            Some(buf)
        };
        pieces.push(Piece { first, end, values, scales, globals });
        first = end;
    }
    Ok(Stack { fmt: l.fmt, pieces })
}

pub fn build_table(b: &WgpuBackend, experts: &MoeExperts<WgpuBackend>) -> Result<WgpuExpertTable> {
    let gate_up: Vec<_> = experts.experts.iter().flat_map(|e| [&e.gate, &e.up]).collect();
    let down: Vec<_> = experts.experts.iter().map(|e| &e.down).collect();
    Ok(WgpuExpertTable {
        gate_up: stack(b, &gate_up, 2, "experts' gate/up")?,
        down: stack(b, &down, 1, "experts' down")?,
    })
}

/// Each slot's expert of `stack` (gate and up where `up`, else down) on its input row of `x`
/// into `y`, a dispatch per piece.
#[allow(clippy::too_many_arguments)]
fn experts(
    b: &WgpuBackend,
    stack: &Stack,
    up: bool,
    top_k: usize,
    x: Range<'_>,
    ids: Range<'_>,
    y: Range<'_>,
    shape: (usize, usize),
) -> Result<()> {
    for piece in &stack.pieces {
        let rows = Rows::Experts { up, top_k, experts: (piece.first, piece.end) };
        b.matvec((&stack.fmt, piece.ranges()), rows, x, ids, y, shape)?;
    }
    Ok(())
}

pub fn moe(
    b: &WgpuBackend,
    x: &Tensor<WgpuBackend>,
    router: &Router<WgpuBackend>,
    table: &WgpuExpertTable,
    d: &MoeDims,
) -> Result<Tensor<WgpuBackend>> {
    let op = "moe";
    let xb = act(x, op)?;
    if d.experts > MAX_EXPERTS || d.top_k > MAX_TOP_K {
        return Err(err(format!(
            "{op}: {} experts, top-k {}: the routing shader takes at most {MAX_EXPERTS} and {MAX_TOP_K}",
            d.experts, d.top_k
        )));
    }
    let (t, k) = (x.rows(), d.top_k);
    if t == 0 {
        return b.output(x.shape());
    }
    let logits = b.linear(x, &router.weight)?;
    let bias = match &router.correction_bias {
        Some(c) => b.small_f32(c, op)?,
        // Bound but unread: a routing binding of its own (the logits are written).
        None => b.output(&[1])?,
    };
    let (kind, renorm, cap, scaling) = match router.kind {
        RouterKind::Softmax { renormalize, .. } => (0, renormalize, None, 1.0),
        RouterKind::Sigmoid { softcap, renormalize, routed_scaling, .. } => (1, renormalize, softcap, routed_scaling),
    };
    let slots = t * k;
    let ids = b.buffer(slots * 4)?;
    let wts = b.output(&[slots])?;
    let params = [
        u32_of(t, op)?,
        u32_of(d.experts, op)?,
        u32_of(k, op)?,
        kind,
        renorm as u32,
        cap.is_some() as u32,
        cap.unwrap_or(1.0).to_bits(),
        f32::to_bits(scaling),
        router.correction_bias.is_some() as u32,
    ];
    let bindings =
        [(1, logits.buffer().range()), (2, bias.buffer().range()), (3, ids.range()), (4, wts.buffer().range())];
    b.gpu.dispatch(Kernel::Route, &params, &bindings, b.gpu.grid(t, WG)?)?;

    let (inter, hidden) = (d.intermediate, d.hidden);
    let h = b.output(&[slots, inter])?;
    experts(b, &table.gate_up, true, k, xb.range(), ids.range(), h.buffer().range(), (slots, inter))?;
    let y = b.output(&[slots, hidden])?;
    experts(b, &table.down, false, k, h.buffer().range(), ids.range(), y.buffer().range(), (slots, hidden))?;
    b.elementwise(Elementwise::WeightedSum { top_k: k }, &y, &wts, op)
}
