//! `y = x W^T` for a weight in its stored form, parallel over blocks of output rows.

use rayon::prelude::*;

use super::rows::RowSource;

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
            let mut scratch = vec![0.0f32; k];
            let mut out = vec![0.0f32; rows.len() * t];
            for (r, col) in rows.zip(out.chunks_exact_mut(t.max(1))) {
                // SAFETY: `r < n` and the caller keeps the `n` rows alive.
                unsafe { src.dot_row(r, x, &mut scratch, col) };
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
