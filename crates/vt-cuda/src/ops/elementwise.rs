//! Elementwise and row-gathering ops on bf16 activations (kernels/elementwise.cu), and the row
//! copies that need no kernel (slice_rows, concat_rows).

use cudarc::driver::{result, LaunchConfig, PushKernelArg};
use vt_core::backend::check;
use vt_core::{DType, GateAct, Result};

use super::with_last;
use crate::device::{CudaBackend, CudaTensor};
use crate::error::{check as ensure, driver_err};
use crate::launch::{act, grid1, i32_of, launched, Overlapped};
use crate::weight::float_code;

pub(crate) fn embedding(b: &CudaBackend, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
    let (vocab, _) = check::embedding(b, table, ids)?;
    // A recorded step reads the ids its replays write.
    let (dev_ids, pi) = match b.recording() {
        Some(r) => (None, r.ids_at(ids.len(), vocab)?),
        None => {
            let buf = b.upload_slice(ids)?;
            let ptr = buf.ptr();
            (Some(buf), ptr)
        }
    };
    let out = embed_rows(b, table, pi, ids.len());
    drop(dev_ids); // freed in stream order, after the kernel
    out
}

/// Queues the rows of `table` for the `n` ids at device address `ids` (each below the table's
/// vocabulary: the caller's to ensure) -> `[n, hidden]`.
pub(crate) fn embed_rows(b: &CudaBackend, table: &CudaTensor, ids: u64, n: usize) -> Result<CudaTensor> {
    let dt = float_code(table, "embedding")?;
    let hidden = table.last_dim();
    let out = b.empty(DType::BF16, &[n, hidden])?;
    let (po, pt, h) = (out.buffer().ptr(), table.buffer().ptr(), i32_of(hidden, "hidden")?);
    let mut l = Overlapped::new(b, &b.k().embedding);
    l.arg(&po).arg(&pt).arg(&dt).arg(&ids).arg(&h);
    let cfg = LaunchConfig { grid_dim: (i32_of(n, "rows")? as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: embedding(bf16* out, const void* table, int dt, const unsigned* ids, int hidden):
    // one block per id, `ids` holds n ids below the table's vocabulary (the caller's contract),
    // out holds n * hidden values. The kernel starts with grid_dep_begin.
    unsafe { l.launch(cfg, "embedding")? };
    Ok(out)
}

/// Elementwise `out = f(a, b)` over bf16 tensors of one shape (add, swiglu).
fn binary(be: &CudaBackend, a: &CudaTensor, b: &CudaTensor, op: &str) -> Result<CudaTensor> {
    check::same_shape(be, op, a, b)?;
    let (pa, pb) = (act(a, op)?, act(b, op)?);
    let out = be.empty(DType::BF16, a.shape())?;
    let (po, n) = (out.buffer().ptr(), a.numel() as i64);
    let f = if op == "add" { &be.k().add } else { &be.k().swiglu };
    let mut l = be.stream().launch_builder(f);
    l.arg(&po).arg(&pa).arg(&pb).arg(&n);
    // SAFETY: add/swiglu(bf16* out, const bf16* a, const bf16* b, long long n); all three
    // hold n bf16 values (same shape, checked).
    launched(unsafe { l.launch(grid1(a.numel())) }, op)?;
    Ok(out)
}

pub(crate) fn add(be: &CudaBackend, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
    binary(be, a, b, "add")
}

pub(crate) fn swiglu(be: &CudaBackend, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
    binary(be, gate, up, "swiglu")
}

pub(crate) fn gate(b: &CudaBackend, x: &CudaTensor, g: &CudaTensor, act_kind: GateAct) -> Result<CudaTensor> {
    let per = check::gate(b, x, g)?;
    let (px, pg) = (act(x, "gate")?, act(g, "gate")?);
    let out = b.empty(DType::BF16, x.shape())?;
    let (po, n, per) = (out.buffer().ptr(), x.numel() as i64, i32_of(per, "gate group")?);
    let a: i32 = match act_kind {
        GateAct::Sigmoid => 0,
        GateAct::Softplus => 1,
    };
    let mut l = Overlapped::new(b, &b.k().gate);
    l.arg(&po).arg(&px).arg(&pg).arg(&n).arg(&per).arg(&a);
    // SAFETY: gate(bf16* out, const bf16* x, const bf16* g, long long n, int per, int act): x and
    // out hold n values, g holds n / per (checked above); the kernel starts with grid_dep_begin.
    unsafe { l.launch(grid1(x.numel()), "gate")? };
    Ok(out)
}

pub(crate) fn narrow_cols(b: &CudaBackend, x: &CudaTensor, start: usize, len: usize) -> Result<CudaTensor> {
    check::narrow_cols(b, x, start, len)?;
    let width = x.last_dim();
    let px = act(x, "narrow_cols")?;
    let out = b.empty(DType::BF16, &with_last(x.shape(), len))?;
    let (po, rows, w, s, n) = (out.buffer().ptr(), x.rows() as i64, i32_of(width, "width")?, start as i32, len as i32);
    let mut l = Overlapped::new(b, &b.k().narrow_cols);
    l.arg(&po).arg(&px).arg(&rows).arg(&w).arg(&s).arg(&n);
    // SAFETY: narrow_cols(bf16* out, const bf16* x, long long rows, int width, int start,
    // int len): start + len <= width (checked); out holds rows * len values.
    // The kernel starts with grid_dep_begin.
    unsafe { l.launch(grid1(x.rows() * len), "narrow_cols")? };
    Ok(out)
}

/// `copy_into` for many pairs in one launch of `copy_pairs` (65535 pairs a launch).
pub(crate) fn copy_many(b: &CudaBackend, pairs: &mut [(&CudaTensor, &mut CudaTensor)]) -> Result<()> {
    ensure(b.recording().is_none(), "copy_many", || "a recorder does not copy states".into())?;
    let mut table = Vec::with_capacity(3 * pairs.len());
    for (src, dst) in pairs.iter() {
        check::copy_into(b, src, dst)?;
        let bytes = src.dtype().bytes_for(src.numel()).unwrap_or(0) as u64;
        table.extend([dst.buffer().ptr(), src.buffer().ptr(), bytes]);
    }
    for chunk in table.chunks(3 * u16::MAX as usize) {
        let pairs = chunk.len() / 3;
        let dev = b.upload_slice(chunk)?;
        let pt = dev.ptr();
        let mut l = b.stream().launch_builder(&b.k().copy_pairs);
        l.arg(&pt);
        let cfg = LaunchConfig { grid_dim: (16, pairs as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: copy_pairs(const u64* table): `pairs` (dst, src, bytes) triples, each dst and
        // src a distinct tensor of `bytes` (same dtype and shape, checked), every dst held
        // `&mut` (so no two alias and none is a source); the allocator aligns them to 256 bytes;
        // the table lives until the kernel has read it (freed in stream order).
        launched(unsafe { l.launch(cfg) }, "copy_many")?;
        drop(dev);
    }
    Ok(())
}

pub(crate) fn slice_rows(b: &CudaBackend, x: &CudaTensor, start: usize, len: usize) -> Result<CudaTensor> {
    check::slice_rows(b, x, start, len)?;
    let width = x.last_dim();
    let px = act(x, "slice_rows")?;
    let out = b.empty(DType::BF16, &[len, width])?;
    let bytes = len * width * 2;
    // SAFETY: the source range lies inside x (checked), out holds `bytes`; stream-ordered.
    unsafe {
        result::memcpy_dtod_async(out.buffer().ptr(), px + (start * width * 2) as u64, bytes, b.stream().cu_stream())
    }
    .map_err(|e| driver_err("slice_rows copy", e))?;
    Ok(out)
}

pub(crate) fn concat_rows(b: &CudaBackend, parts: &[&CudaTensor]) -> Result<CudaTensor> {
    let (rows, width) = check::concat_rows(b, parts)?;
    for p in parts {
        act(p, "concat_rows")?;
    }
    let out = b.empty(DType::BF16, &[rows, width])?;
    let mut at = out.buffer().ptr();
    for p in parts {
        let bytes = p.numel() * 2;
        // SAFETY: `out` holds the sum of the parts' bytes; each copy lands in its own range;
        // stream-ordered after the kernels that wrote the parts.
        unsafe { result::memcpy_dtod_async(at, p.buffer().ptr(), bytes, b.stream().cu_stream()) }
            .map_err(|e| driver_err("concat_rows copy", e))?;
        at += bytes as u64;
    }
    Ok(out)
}
