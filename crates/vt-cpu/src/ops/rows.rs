//! Dot products of one weight row with token vectors: the inner loop of every CPU matmul.
//!
//! Weights stay in their stored form. A dense row is decoded into a scratch buffer while it is
//! used; a quantized row as its format (quant/) decodes it.

use std::sync::Arc;

use vt_core::dtype::decode_into;
use vt_core::{DType, Error, Result, Weight};

use super::quant::{fp8, interleave, nvfp4};
use crate::alloc::{Allocator, CpuBuffer};
use crate::CpuBackend;

/// Where the rows of one `[n, k]` matrix live, as raw addresses (see `moe.rs` for why raw). Each
/// quantized format is registered here: a variant, and an arm in `of`, `pair` and `dot_row`.
#[derive(Clone, Copy, Debug)]
pub enum RowSource {
    Dense { ptr: *const u8, dtype: DType, k: usize },
    Nvfp4(nvfp4::Rows),
    Fp8(fp8::Rows),
}

// SAFETY: a RowSource is only a description of read-only memory; whoever dereferences it
// (`dot_row`) must guarantee that memory is alive. Sending the description is harmless.
unsafe impl Send for RowSource {}
// SAFETY: as above.
unsafe impl Sync for RowSource {}

impl RowSource {
    pub fn of(w: &Weight<CpuBackend>) -> RowSource {
        match w {
            Weight::Dense(t) => {
                RowSource::Dense { ptr: t.buffer().bytes().as_ptr(), dtype: t.dtype(), k: t.shape()[1] }
            }
            Weight::Nvfp4(q) => RowSource::Nvfp4(nvfp4::Rows::of(q)),
            Weight::Fp8(q) => RowSource::Fp8(fp8::Rows::of(q)),
        }
    }

    /// `a` and `b` (same shape, same format) as one matrix, row i of each at rows 2i, 2i + 1 (an
    /// expert's gate and up, so that one pass over the input yields both halves of each SwiGLU
    /// unit); the rows point into the returned buffers. `what` names the pair in errors.
    pub fn pair(
        alloc: &Arc<Allocator>,
        a: &Weight<CpuBackend>,
        b: &Weight<CpuBackend>,
        what: &str,
    ) -> Result<(Vec<CpuBuffer>, RowSource)> {
        match (a, b) {
            (Weight::Dense(x), Weight::Dense(y)) if x.dtype() == y.dtype() => {
                let k = x.shape()[1];
                let row = x.dtype().bytes_for(k).expect("validated");
                let buf = interleave(alloc, x.buffer().bytes(), y.buffer().bytes(), row)?;
                let rows = RowSource::Dense { ptr: buf.bytes().as_ptr(), dtype: x.dtype(), k };
                Ok((vec![buf], rows))
            }
            (Weight::Nvfp4(x), Weight::Nvfp4(y)) => {
                nvfp4::Rows::pair(alloc, x, y).map(|(b, r)| (b, RowSource::Nvfp4(r)))
            }
            (Weight::Fp8(x), Weight::Fp8(y)) if x.block == y.block => {
                fp8::Rows::pair(alloc, x, y).map(|(b, r)| (b, RowSource::Fp8(r)))
            }
            _ => Err(Error::tensor(what, "gate and up projections must share one storage format")),
        }
    }

    /// `out[i] = dot(row, x[i])` for the `out.len()` token vectors of `x` (`k` floats each), with
    /// `scratch` (`k` floats) for a decoded row.
    ///
    /// # Safety
    /// The memory described must be alive and hold at least `row + 1` rows.
    pub unsafe fn dot_row(&self, row: usize, x: &[f32], scratch: &mut [f32], out: &mut [f32]) {
        match *self {
            RowSource::Dense { ptr, dtype, k } => {
                let rb = dtype.bytes_for(k).expect("validated dtype");
                // SAFETY: the caller guarantees `row + 1` rows of `rb` bytes are alive at `ptr`.
                let bytes = unsafe { std::slice::from_raw_parts(ptr.add(row * rb), rb) };
                decode_into(dtype, bytes, &mut scratch[..k]);
                for (o, xi) in out.iter_mut().zip(x.chunks_exact(k)) {
                    *o = dot(xi, &scratch[..k]);
                }
            }
            // SAFETY (both): the caller's guarantee, passed on.
            RowSource::Nvfp4(r) => unsafe { r.dot_row(row, x, out) },
            RowSource::Fp8(r) => unsafe { r.dot_row(row, x, scratch, out) },
        }
    }
}

/// `sum(a[i] * b[i])` with eight independent accumulators (vectorises; order fixed, deterministic).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}
