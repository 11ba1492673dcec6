//! Attention with a KV cache, through the Backend API: windowed and full, prefill and decode,
//! against a naive formula; a sliding-window cache must not grow with the sequence.

use vt_core::backend::prelude::*;
use vt_core::AttentionParams;
use vt_cpu::{CpuBackend, KV_BLOCK};
use vt_test_support::max_abs_diff;

const T: usize = 40;
const QH: usize = 4;
const KVH: usize = 2;
const D: usize = 8;

fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 8) % 2000) as f32 / 1000.0
                - 1.0
        })
        .collect()
}

/// Softmax attention of query position `i` over keys `lo..=i`, straight from the definition.
fn naive(q: &[f32], k: &[f32], v: &[f32], window: Option<usize>, scale: f32) -> Vec<f32> {
    let mut out = vec![0.0; T * QH * D];
    for i in 0..T {
        let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
        for h in 0..QH {
            let kvh = h / (QH / KVH);
            let qv = &q[(i * QH + h) * D..][..D];
            let s: Vec<f64> = (lo..=i)
                .map(|j| {
                    qv.iter().zip(&k[(j * KVH + kvh) * D..][..D]).map(|(a, b)| (a * b) as f64).sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (j, sj) in (lo..=i).zip(&s) {
                for e in 0..D {
                    out[(i * QH + h) * D + e] += (((sj - m).exp() / z) * v[(j * KVH + kvh) * D + e] as f64) as f32;
                }
            }
        }
    }
    out
}

fn run(b: &CpuBackend, q: &[f32], k: &[f32], v: &[f32], window: Option<usize>, split: &[usize]) -> Vec<f32> {
    let params = AttentionParams { scale: 0.35, window };
    let mut cache = b.new_kv_cache(KVH, D, window).unwrap();
    let mut out = Vec::new();
    let mut start = 0;
    for &end in split.iter().chain(std::iter::once(&T)) {
        let n = end - start;
        let slice = |x: &[f32], h: usize| b.from_f32(&[n, h, D], &x[start * h * D..end * h * D]).unwrap();
        let o = b.attention(&slice(q, QH), &slice(k, KVH), &slice(v, KVH), &mut cache, &params).unwrap();
        out.extend(b.to_f32(&o).unwrap());
        start = end;
    }
    out
}

#[test]
fn cached_attention_matches_naive_in_any_split() {
    let b = CpuBackend::new();
    let (q, k, v) = (values(1, T * QH * D), values(2, T * KVH * D), values(3, T * KVH * D));
    for window in [None, Some(1), Some(7), Some(T + 5)] {
        let want = naive(&q, &k, &v, window, 0.35);
        let one_by_one: Vec<usize> = (1..T).collect();
        for split in [vec![], vec![5], vec![9, 10, 30], one_by_one] {
            let got = run(&b, &q, &k, &v, window, &split);
            let d = max_abs_diff(&got, &want);
            // f32 softmax over <= 40 terms of magnitude ~1: errors of a few ulp.
            assert!(d < 1e-5, "window {window:?} split {split:?}: max diff {d}");
        }
    }
}

#[test]
fn sliding_window_cache_memory_stays_bounded() {
    let b = CpuBackend::new();
    let window = 6;
    let mut cache = b.new_kv_cache(KVH, D, Some(window)).unwrap();
    let params = AttentionParams { scale: 0.35, window: Some(window) };
    // Blocks wholly outside the window go back, so at most the window's blocks plus one partly
    // filled block on either side are held.
    let bound = (window / KV_BLOCK + 2) * 2 * KV_BLOCK * KVH * D * 4;
    for step in 0..200u32 {
        let q = b.from_f32(&[1, QH, D], &values(step, QH * D)).unwrap();
        let k = b.from_f32(&[1, KVH, D], &values(step + 1000, KVH * D)).unwrap();
        let o = b.attention(&q, &k, &k, &mut cache, &params).unwrap();
        drop((q, k, o));
        let live = b.memory().bytes_live;
        assert!(live <= bound, "cache holds {live} bytes at step {step}, bound {bound}");
    }
    drop(cache);
    assert_eq!(b.memory().bytes_live, 0);
}
