//! `y = x W^T` for a weight in its stored form, parallel over blocks of output rows.

use rayon::prelude::*;

use super::rows::{dot, RowSource};

const ROW_BLOCK: usize = 16;

/// `x` `[t, k]` times the `n` rows of `src` -> `[t, n]`.
///
/// # Safety
/// `src` must describe `n` rows of `k` inputs that stay alive for the call.
pub unsafe fn matmul(x: &[f32], t: usize, k: usize, src: RowSource, n: usize) -> Vec<f32> {
    // Each block decodes its rows once and dots them with every token; results come back per row.
    let blocks: Vec<Vec<f32>> = (0..n.div_ceil(ROW_BLOCK))
        .into_par_iter()
        .map(|b| {
            let rows = (b * ROW_BLOCK)..((b + 1) * ROW_BLOCK).min(n);
            let mut w = vec![0.0f32; k];
            let mut out = Vec::with_capacity(rows.len() * t);
            for r in rows {
                // SAFETY: `r < n` and the caller keeps the `n` rows alive.
                unsafe { src.decode_row(r, &mut w) };
                out.extend((0..t).map(|i| dot(&x[i * k..(i + 1) * k], &w)));
            }
            out
        })
        .collect();
    let mut y = vec![0.0f32; t * n];
    for (b, block) in blocks.iter().enumerate() {
        for (j, col) in block.chunks_exact(t.max(1)).enumerate() {
            let r = b * ROW_BLOCK + j;
            for (i, &v) in col.iter().enumerate() {
                y[i * n + r] = v;
            }
        }
    }
    y
}
