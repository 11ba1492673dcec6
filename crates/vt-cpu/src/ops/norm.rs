//! RMSNorm variants over the last dimension, computed in f32 as transformers does.

use rayon::prelude::*;
use vt_core::NormKind;

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, kind: NormKind, out: &mut [f32]) {
    let d = w.len();
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, row)| {
        let r = inv_rms(row, eps);
        for ((o, &v), &wi) in o.iter_mut().zip(row).zip(w) {
            let scale = match kind {
                NormKind::Plain => wi,
                NormKind::UnitOffset => 1.0 + wi,
            };
            *o = v * r * scale;
        }
    });
}

/// `rmsnorm(x) * w * silu(z)`.
pub fn rms_norm_gated(x: &[f32], z: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    out.par_chunks_mut(d).zip(x.par_chunks(d).zip(z.par_chunks(d))).for_each(|(o, (row, zr))| {
        let r = inv_rms(row, eps);
        for i in 0..d {
            o[i] = w[i] * (row[i] * r) * silu(zr[i]);
        }
    });
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, threshold 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
