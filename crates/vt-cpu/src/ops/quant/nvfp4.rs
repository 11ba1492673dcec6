//! NVFP4 rows, decoded one 16-element block at a time inside the dot product:
//! `e2m1(code) * f8(scale) * global`.

use std::sync::Arc;

use vt_core::dtype::{e2m1_to_f32, f8e4m3_to_f32};
use vt_core::{Nvfp4, Result, NVFP4_GROUP};

use super::interleave;
use crate::alloc::{Allocator, CpuBuffer};
use crate::ops::rows::dot;
use crate::CpuBackend;

/// The rows of one NVFP4 matrix as raw addresses (see moe.rs for why raw).
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    codes: *const u8,
    scales: *const u8,
    /// `global[row % 2]` scales a row: fused gate/up pairs keep each half's own multiplier.
    global: [f32; 2],
    k: usize,
}

impl Rows {
    pub fn of(q: &Nvfp4<CpuBackend>) -> Rows {
        Rows {
            codes: q.codes.buffer().bytes().as_ptr(),
            scales: q.scales.buffer().bytes().as_ptr(),
            global: [q.global_scale; 2],
            k: q.codes.shape()[1],
        }
    }

    /// `a` and `b` (same shape) as one matrix, row i of each at rows 2i, 2i + 1; the rows point
    /// into the returned buffers.
    pub fn pair(
        alloc: &Arc<Allocator>,
        a: &Nvfp4<CpuBackend>,
        b: &Nvfp4<CpuBackend>,
    ) -> Result<(Vec<CpuBuffer>, Rows)> {
        let k = a.codes.shape()[1];
        let codes = interleave(alloc, a.codes.buffer().bytes(), b.codes.buffer().bytes(), k / 2)?;
        let scales = interleave(alloc, a.scales.buffer().bytes(), b.scales.buffer().bytes(), k / NVFP4_GROUP)?;
        let rows = Rows {
            codes: codes.bytes().as_ptr(),
            scales: scales.bytes().as_ptr(),
            global: [a.global_scale, b.global_scale],
            k,
        };
        Ok((vec![codes, scales], rows))
    }

    /// `out[i] = dot(row, x[i])`, the row decoded one block of 16 at a time, never as a whole.
    ///
    /// # Safety
    /// The memory described must be alive and hold at least `row + 1` rows.
    pub unsafe fn dot_row(&self, row: usize, x: &[f32], out: &mut [f32]) {
        let (k, rb, sb) = (self.k, self.k / 2, self.k / NVFP4_GROUP);
        // SAFETY: the caller guarantees `row + 1` rows of codes (`k/2` bytes a row) and scales
        // (`k/16` a row) are alive.
        let (c, s) = unsafe {
            (
                std::slice::from_raw_parts(self.codes.add(row * rb), rb),
                std::slice::from_raw_parts(self.scales.add(row * sb), sb),
            )
        };
        out.fill(0.0);
        let mut block = [0.0f32; NVFP4_GROUP];
        for (b, (code_block, &scale)) in c.chunks_exact(NVFP4_GROUP / 2).zip(s).enumerate() {
            decode_block(code_block, f8e4m3_to_f32(scale) * self.global[row % 2], &mut block);
            for (o, xi) in out.iter_mut().zip(x.chunks_exact(k)) {
                *o += dot(&xi[b * NVFP4_GROUP..(b + 1) * NVFP4_GROUP], &block);
            }
        }
    }
}

/// One NVFP4 block: 8 bytes of codes (even element in the low nibble) times its scale.
fn decode_block(codes: &[u8], scale: f32, out: &mut [f32; NVFP4_GROUP]) {
    for (pair, &byte) in out.chunks_exact_mut(2).zip(codes) {
        pair[0] = e2m1_to_f32(byte & 0x0f) * scale;
        pair[1] = e2m1_to_f32(byte >> 4) * scale;
    }
}
