//! Attention through a block table of a KV pool, through the Backend API: windowed and full,
//! prefill and decode, over scattered blocks, against a naive formula; tables checked; block copies.

use vt_core::backend::prelude::*;
use vt_core::{AttentionParams, KvLayout, KvSeq, RELEASED};
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

/// Attention over the whole sequence in calls split at `split`, through a block table whose blocks
/// run backwards through the pool (so positions that follow each other sit in blocks that do not).
fn run(b: &CpuBackend, q: &[f32], k: &[f32], v: &[f32], window: Option<usize>, split: &[usize]) -> Vec<f32> {
    let params = AttentionParams { scale: 0.35, window };
    let blocks = T.div_ceil(KV_BLOCK) + 3;
    let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: KVH, head_dim: D, blocks }]).unwrap();
    let table: Vec<u32> = (0..T.div_ceil(KV_BLOCK)).map(|i| (blocks - 1 - 2 * i) as u32).collect();
    let mut out = Vec::new();
    let mut start = 0;
    for &end in split.iter().chain(std::iter::once(&T)) {
        let n = end - start;
        let slice = |x: &[f32], h: usize| b.from_f32(&[n, h, D], &x[start * h * D..end * h * D]).unwrap();
        let seq = KvSeq { layer: 0, table: &table, start };
        let o = b.attention(&slice(q, QH), &slice(k, KVH), &slice(v, KVH), &mut pool, seq, &params).unwrap();
        out.extend(b.to_f32(&o).unwrap());
        start = end;
    }
    out
}

#[test]
fn paged_attention_matches_naive_in_any_split() {
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

/// A table that does not cover the call, names a block past the layer, or has released a block a
/// query still sees is an error naming it; a released block no query sees is never read.
#[test]
fn block_tables_are_checked() {
    let b = CpuBackend::new();
    let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: KVH, head_dim: D, blocks: 4 }]).unwrap();
    let x = |h: usize| b.from_f32(&[1, h, D], &values(h as u32, h * D)).unwrap();
    let (q, k) = (x(QH), x(KVH));
    let mut call = |table: &[u32], start: usize, window: Option<usize>| {
        let params = AttentionParams { scale: 0.35, window };
        b.attention(&q, &k, &k, &mut pool, KvSeq { layer: 0, table, start }, &params).map_err(|e| e.to_string())
    };
    let err = call(&[0], KV_BLOCK, None).unwrap_err();
    assert!(err.contains("table of 1 blocks"), "{err}");
    let err = call(&[9], 0, None).unwrap_err();
    assert!(err.contains("block 9") && err.contains("4 blocks"), "{err}");
    let err = call(&[RELEASED, 1], KV_BLOCK, None).unwrap_err();
    assert!(err.contains("released"), "{err}");
    // A window of 2 from position KV_BLOCK + 1 on sees only block 1.
    for pos in [KV_BLOCK + 1, KV_BLOCK + 2] {
        call(&[RELEASED, 1], pos, Some(2)).unwrap();
    }
    let err = call(&[0], 0, Some(0)).unwrap_err();
    assert!(err.contains("window of 0"), "{err}");
    let err = b.copy_kv_block(&mut pool, 1, 0, 1).unwrap_err().to_string();
    assert!(err.contains("pool layer 1"), "{err}");
    b.copy_kv_block(&mut pool, 0, 1, 2).unwrap();
}

/// A block copied to another (copy-on-write) attends as the original.
#[test]
fn a_copied_block_attends_as_its_source() {
    let b = CpuBackend::new();
    let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: KVH, head_dim: D, blocks: 4 }]).unwrap();
    let n = KV_BLOCK - 1;
    let (q, k, v) = (values(4, n * QH * D), values(5, n * KVH * D), values(6, n * KVH * D));
    let t = |x: &[f32], h: usize, rows: usize| b.from_f32(&[rows, h, D], x).unwrap();
    let params = AttentionParams { scale: 0.35, window: None };
    b.attention(
        &t(&q, QH, n),
        &t(&k, KVH, n),
        &t(&v, KVH, n),
        &mut pool,
        KvSeq { layer: 0, table: &[2], start: 0 },
        &params,
    )
    .unwrap();
    b.copy_kv_block(&mut pool, 0, 2, 3).unwrap();
    let (q1, k1) = (values(7, QH * D), values(8, KVH * D));
    let step = |pool: &mut _, table: &[u32]| {
        let seq = KvSeq { layer: 0, table, start: n };
        b.to_f32(&b.attention(&t(&q1, QH, 1), &t(&k1, KVH, 1), &t(&k1, KVH, 1), pool, seq, &params).unwrap()).unwrap()
    };
    let from_copy = step(&mut pool, &[3]);
    assert_eq!(from_copy, step(&mut pool, &[2]));
}
