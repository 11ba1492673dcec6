//! NeoX-style rotary embedding over the first `rotary_dim` features of each head.

use rayon::prelude::*;
use vt_core::Rope;

/// `x` `[t, heads, head_dim]` for positions `start..start+t`.
pub fn rope(x: &[f32], heads: usize, head_dim: usize, start: usize, rope: &Rope, out: &mut [f32]) {
    let half = rope.inv_freq.len();
    out.copy_from_slice(x);
    out.par_chunks_mut(heads * head_dim).enumerate().for_each(|(i, tok)| {
        // As transformers: the angle is an f32 product, cos/sin in f32, times the scaling.
        let pos = (start + i) as f32;
        let (cos, sin): (Vec<f32>, Vec<f32>) = rope
            .inv_freq
            .iter()
            .map(|&f| {
                let a = pos * f;
                (a.cos() * rope.attention_scaling, a.sin() * rope.attention_scaling)
            })
            .unzip();
        for head in tok.chunks_exact_mut(head_dim) {
            for j in 0..half {
                let (x1, x2) = (head[j], head[j + half]);
                head[j] = x1 * cos[j] - x2 * sin[j];
                head[j + half] = x2 * cos[j] + x1 * sin[j];
            }
        }
    });
}
