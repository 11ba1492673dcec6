//! FP8 block-scaled rows: a row is decoded into scratch, `e4m3(v) * scale` per element (the f32
//! product transformers dequantizes to), then dotted with every token.

use std::sync::Arc;

use vt_core::dtype::f8e4m3_to_f32;
use vt_core::{Fp8Block, Result};

use super::interleave;
use crate::alloc::{Allocator, CpuBuffer};
use crate::ops::rows::dot;
use crate::CpuBackend;

/// The rows of one FP8 matrix as raw addresses (see moe.rs for why raw): row r takes scale row
/// `r / block_rows`, input j scale `j / block_cols` of it.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    values: *const u8,
    /// f32, `k.div_ceil(block_cols)` a scale row.
    scales: *const u8,
    block_rows: usize,
    block_cols: usize,
    k: usize,
}

impl Rows {
    pub fn of(q: &Fp8Block<CpuBackend>) -> Rows {
        Rows {
            values: q.values.buffer().bytes().as_ptr(),
            scales: q.scales.buffer().bytes().as_ptr(),
            block_rows: q.block[0],
            block_cols: q.block[1],
            k: q.values.shape()[1],
        }
    }

    /// `a` and `b` (same shape and blocks) as one matrix, row i of each at rows 2i, 2i + 1, with a
    /// scale row per row (interleaved rows leave no common block of rows); the rows point into the
    /// returned buffers.
    pub fn pair(
        alloc: &Arc<Allocator>,
        a: &Fp8Block<CpuBackend>,
        b: &Fp8Block<CpuBackend>,
    ) -> Result<(Vec<CpuBuffer>, Rows)> {
        let (n, k) = (a.values.shape()[0], a.values.shape()[1]);
        let values = interleave(alloc, a.values.buffer().bytes(), b.values.buffer().bytes(), k)?;
        let row_bytes = 4 * k.div_ceil(a.block[1]);
        let mut scales = CpuBuffer::new(alloc, 2 * n * row_bytes)?;
        for (r, dst) in scales.bytes_mut().chunks_exact_mut(row_bytes).enumerate() {
            let (w, i) = if r % 2 == 0 { (a, r / 2) } else { (b, r / 2) };
            let src = i / w.block[0] * row_bytes;
            dst.copy_from_slice(&w.scales.buffer().bytes()[src..src + row_bytes]);
        }
        let rows = Rows {
            values: values.bytes().as_ptr(),
            scales: scales.bytes().as_ptr(),
            block_rows: 1,
            block_cols: a.block[1],
            k,
        };
        Ok((vec![values, scales], rows))
    }

    /// `out[i] = dot(row, x[i])` for the `out.len()` token vectors of `x` (`k` floats each), the
    /// row decoded once into `scratch` (`k` floats).
    ///
    /// # Safety
    /// The memory described must be alive and hold at least `row + 1` rows.
    pub unsafe fn dot_row(&self, row: usize, x: &[f32], scratch: &mut [f32], out: &mut [f32]) {
        let (k, bc) = (self.k, self.block_cols);
        let kb = k.div_ceil(bc);
        // SAFETY: the caller guarantees `row + 1` rows of `k` values are alive, and the scale rows
        // up to `row / block_rows` (`kb` f32 each).
        let (v, s) = unsafe {
            (
                std::slice::from_raw_parts(self.values.add(row * k), k),
                std::slice::from_raw_parts(self.scales.add(row / self.block_rows * kb * 4), kb * 4),
            )
        };
        let w = &mut scratch[..k];
        for ((dst, src), scale) in w.chunks_mut(bc).zip(v.chunks(bc)).zip(s.chunks_exact(4)) {
            let scale = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
            for (d, &b) in dst.iter_mut().zip(src) {
                *d = f8e4m3_to_f32(b) * scale;
            }
        }
        for (o, xi) in out.iter_mut().zip(x.chunks_exact(k)) {
            *o = dot(xi, w);
        }
    }
}
