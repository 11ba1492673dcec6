//! Reading one weight row as f32: the inner loop of every CPU matmul.
//!
//! Weights stay in their stored form; a row is decoded into a scratch buffer only while it is used.
//! NVFP4 rows decode one 16-element block at a time: `e2m1(code) * f8(scale) * global`.

use vt_core::dtype::{decode_into, e2m1_to_f32, f8e4m3_to_f32};
use vt_core::{DType, Weight, NVFP4_GROUP};

use crate::CpuBackend;

/// Where the rows of one `[n, k]` matrix live, as raw addresses (see `moe.rs` for why raw).
#[derive(Clone, Copy, Debug)]
pub enum RowSource {
    Dense { ptr: *const u8, dtype: DType, k: usize },
    /// `global[row % 2]` scales a row: fused gate/up pairs keep each half's own multiplier.
    Nvfp4 { codes: *const u8, scales: *const u8, global: [f32; 2], k: usize },
}

// SAFETY: a RowSource is only a description of read-only memory; whoever dereferences it
// (`decode_row`) must guarantee that memory is alive. Sending the description is harmless.
unsafe impl Send for RowSource {}
// SAFETY: as above.
unsafe impl Sync for RowSource {}

impl RowSource {
    pub fn of(w: &Weight<CpuBackend>) -> RowSource {
        match w {
            Weight::Dense(t) => RowSource::Dense { ptr: t.buffer().bytes().as_ptr(), dtype: t.dtype(), k: t.shape()[1] },
            Weight::Nvfp4(q) => RowSource::Nvfp4 {
                codes: q.codes.buffer().bytes().as_ptr(),
                scales: q.scales.buffer().bytes().as_ptr(),
                global: [q.global_scale; 2],
                k: q.codes.shape()[1],
            },
        }
    }

    /// Bytes one row occupies in (codes, scales).
    fn row_bytes(&self) -> (usize, usize) {
        match *self {
            RowSource::Dense { dtype, k, .. } => (dtype.bytes_for(k).expect("validated dtype"), 0),
            RowSource::Nvfp4 { k, .. } => (k / 2, k / NVFP4_GROUP),
        }
    }

    /// Decodes row `row` into `out` (`k` floats).
    ///
    /// # Safety
    /// The memory described must be alive and hold at least `row + 1` rows.
    pub unsafe fn decode_row(&self, row: usize, out: &mut [f32]) {
        let (rb, sb) = self.row_bytes();
        match *self {
            RowSource::Dense { ptr, dtype, .. } => {
                // SAFETY: the caller guarantees `row + 1` rows of `rb` bytes are alive at `ptr`.
                let bytes = unsafe { std::slice::from_raw_parts(ptr.add(row * rb), rb) };
                decode_into(dtype, bytes, out);
            }
            RowSource::Nvfp4 { codes, scales, global, k } => {
                // SAFETY: as above, for the codes (`k/2` bytes a row) and scales (`k/16` a row).
                let (c, s) = unsafe {
                    (std::slice::from_raw_parts(codes.add(row * rb), rb), std::slice::from_raw_parts(scales.add(row * sb), sb))
                };
                decode_nvfp4_row(c, s, global[row % 2], &mut out[..k]);
            }
        }
    }
}

/// One NVFP4 row: `codes` `k/2` bytes (even element low nibble), `scales` `k/16` fp8 bytes.
pub fn decode_nvfp4_row(codes: &[u8], scales: &[u8], global: f32, out: &mut [f32]) {
    for ((block, code_block), &scale) in out.chunks_exact_mut(NVFP4_GROUP).zip(codes.chunks_exact(NVFP4_GROUP / 2)).zip(scales) {
        let s = f8e4m3_to_f32(scale) * global;
        for (pair, &byte) in block.chunks_exact_mut(2).zip(code_block) {
            pair[0] = e2m1_to_f32(byte & 0x0f) * s;
            pair[1] = e2m1_to_f32(byte >> 4) * s;
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
