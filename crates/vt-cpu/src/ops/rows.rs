//! Dot products of one weight row with token vectors: the inner loop of every CPU matmul.
//!
//! Weights stay in their stored form. A dense row is decoded into a scratch buffer while it is
//! used; an NVFP4 row is decoded one 16-element block at a time inside the dot product:
//! `e2m1(code) * f8(scale) * global`.

use vt_core::dtype::{decode_into, e2m1_to_f32, f8e4m3_to_f32};
use vt_core::{DType, Weight, NVFP4_GROUP};

use crate::CpuBackend;

/// Where the rows of one `[n, k]` matrix live, as raw addresses (see `moe.rs` for why raw).
#[derive(Clone, Copy, Debug)]
pub enum RowSource {
    Dense {
        ptr: *const u8,
        dtype: DType,
        k: usize,
    },
    /// `global[row % 2]` scales a row: fused gate/up pairs keep each half's own multiplier.
    Nvfp4 {
        codes: *const u8,
        scales: *const u8,
        global: [f32; 2],
        k: usize,
    },
}

// SAFETY: a RowSource is only a description of read-only memory; whoever dereferences it
// (`decode_row`) must guarantee that memory is alive. Sending the description is harmless.
unsafe impl Send for RowSource {}
// SAFETY: as above.
unsafe impl Sync for RowSource {}

impl RowSource {
    pub fn of(w: &Weight<CpuBackend>) -> RowSource {
        match w {
            Weight::Dense(t) => {
                RowSource::Dense { ptr: t.buffer().bytes().as_ptr(), dtype: t.dtype(), k: t.shape()[1] }
            }
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

    /// `out[i] = dot(row, x[i])` for the `out.len()` token vectors of `x` (`k` floats each).
    /// Dense rows are decoded once into `scratch` (`k` floats); NVFP4 rows are decoded one block
    /// of 16 at a time inside the dot product, never as a whole row.
    ///
    /// # Safety
    /// The memory described must be alive and hold at least `row + 1` rows.
    pub unsafe fn dot_row(&self, row: usize, x: &[f32], scratch: &mut [f32], out: &mut [f32]) {
        let (rb, sb) = self.row_bytes();
        match *self {
            RowSource::Dense { ptr, dtype, k } => {
                // SAFETY: the caller guarantees `row + 1` rows of `rb` bytes are alive at `ptr`.
                let bytes = unsafe { std::slice::from_raw_parts(ptr.add(row * rb), rb) };
                decode_into(dtype, bytes, &mut scratch[..k]);
                for (o, xi) in out.iter_mut().zip(x.chunks_exact(k)) {
                    *o = dot(xi, &scratch[..k]);
                }
            }
            RowSource::Nvfp4 { codes, scales, global, k } => {
                // SAFETY: as above, for the codes (`k/2` bytes a row) and scales (`k/16` a row).
                let (c, s) = unsafe {
                    (
                        std::slice::from_raw_parts(codes.add(row * rb), rb),
                        std::slice::from_raw_parts(scales.add(row * sb), sb),
                    )
                };
                out.fill(0.0);
                let mut block = [0.0f32; NVFP4_GROUP];
                for (b, (code_block, &scale)) in c.chunks_exact(NVFP4_GROUP / 2).zip(s).enumerate() {
                    decode_nvfp4_block(code_block, f8e4m3_to_f32(scale) * global[row % 2], &mut block);
                    for (o, xi) in out.iter_mut().zip(x.chunks_exact(k)) {
                        *o += dot(&xi[b * NVFP4_GROUP..(b + 1) * NVFP4_GROUP], &block);
                    }
                }
            }
        }
    }
}

/// One NVFP4 block: 8 bytes of codes (even element in the low nibble) times its scale.
pub fn decode_nvfp4_block(codes: &[u8], scale: f32, out: &mut [f32; NVFP4_GROUP]) {
    for (pair, &byte) in out.chunks_exact_mut(2).zip(codes) {
        pair[0] = e2m1_to_f32(byte & 0x0f) * scale;
        pair[1] = e2m1_to_f32(byte >> 4) * scale;
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
