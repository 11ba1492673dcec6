//! The CPU reference backend's ops at the shapes a decode step and a prefill chunk give them:
//! `cargo bench -p vt-benches` (or `-- linear` for one group). Weights are random values
//! (`Device::random`), the same every run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use vt_core::{
    AttentionParams, DType, Device, Expert, FusedOps, GdnInputs, GdnMode, KvLayout, KvOps, KvSeq, Linear, MoeExperts,
    NormKind, Nvfp4, Ops, Router, RouterKind, Tensor, Weight,
};
use vt_cpu::CpuBackend;

const HIDDEN: usize = 1024;
/// Tokens of a decode step and of a prefill chunk.
const TOKENS: [usize; 2] = [1, 64];

fn activations(b: &CpuBackend, shape: &[usize], seed: u64) -> Tensor<CpuBackend> {
    b.random(DType::F32, shape, seed, 1.0).unwrap()
}

fn dense(b: &CpuBackend, n: usize, k: usize, seed: u64) -> Weight<CpuBackend> {
    Weight::Dense(b.random(DType::BF16, &[n, k], seed, 0.05).unwrap())
}

fn nvfp4(b: &CpuBackend, n: usize, k: usize, seed: u64) -> Weight<CpuBackend> {
    Weight::Nvfp4(Nvfp4 {
        codes: b.random(DType::F4x2, &[n, k], seed, 1.0).unwrap(),
        scales: b.random(DType::F8E4M3, &[n, k / 16], seed + 1, 0.01).unwrap(),
        global_scale: 1.0,
    })
}

fn linear(c: &mut Criterion) {
    let b = CpuBackend::new();
    let mut g = c.benchmark_group("linear 1024x1024");
    for (format, w) in [("bf16", dense(&b, HIDDEN, HIDDEN, 1)), ("nvfp4", nvfp4(&b, HIDDEN, HIDDEN, 1))] {
        let w = Linear::new(&b, w).unwrap();
        for t in TOKENS {
            let x = activations(&b, &[t, HIDDEN], 2);
            g.bench_with_input(BenchmarkId::new(format, t), &x, |bench, x| bench.iter(|| b.linear(x, &w).unwrap()));
        }
    }
}

fn rms_norm(c: &mut Criterion) {
    let b = CpuBackend::new();
    let w = activations(&b, &[HIDDEN], 3);
    let mut g = c.benchmark_group("rms_norm 1024");
    for t in TOKENS {
        let x = activations(&b, &[t, HIDDEN], 4);
        g.bench_with_input(BenchmarkId::from_parameter(t), &x, |bench, x| {
            bench.iter(|| b.rms_norm(x, &w, 1e-6, NormKind::UnitOffset).unwrap())
        });
    }
}

/// 64 experts of intermediate size 256, top 8 (softmax), no shared expert.
fn moe(c: &mut Criterion) {
    let (experts, inter, top_k) = (64, 256, 8);
    let b = CpuBackend::new();
    let mut g = c.benchmark_group("moe 64 experts top 8");
    for (format, weight) in [("bf16", dense as fn(&CpuBackend, usize, usize, u64) -> _), ("nvfp4", nvfp4)] {
        let list = (0..experts as u64)
            .map(|e| Expert {
                gate: weight(&b, inter, HIDDEN, 10 * e),
                up: weight(&b, inter, HIDDEN, 10 * e + 3),
                down: weight(&b, HIDDEN, inter, 10 * e + 6),
            })
            .collect();
        let moe = MoeExperts::new(&b, "bench", list, HIDDEN, inter).unwrap();
        let router = Router {
            weight: Linear::new(&b, dense(&b, experts, HIDDEN, 5)).unwrap(),
            kind: RouterKind::Softmax { top_k, renormalize: true },
            correction_bias: None,
        };
        for t in TOKENS {
            let x = activations(&b, &[t, HIDDEN], 6);
            g.bench_with_input(BenchmarkId::new(format, t), &x, |bench, x| {
                bench.iter(|| b.moe_block(x, &router, &moe, None).unwrap())
            });
        }
    }
}

/// Qwen3.5-like heads at a tenth of the width: 4 key heads, 8 value heads, head dim 128.
fn gated_delta_rule(c: &mut Criterion) {
    let (kh, vh, d) = (4, 8, 128);
    let b = CpuBackend::new();
    let mut g = c.benchmark_group("gated_delta_rule 4/8 heads d128");
    for (mode, t) in [(GdnMode::Recurrent, 1), (GdnMode::Chunked, 64)] {
        let (q, k, v) =
            (activations(&b, &[t, kh, d], 7), activations(&b, &[t, kh, d], 8), activations(&b, &[t, vh, d], 9));
        let (a, beta) = (activations(&b, &[t, vh], 10), activations(&b, &[t, vh], 11));
        let (a_log, dt_bias) = (activations(&b, &[vh], 12), activations(&b, &[vh], 13));
        let inputs = GdnInputs { q: &q, k: &k, v: &v, a: &a, b: &beta, a_log: &a_log, dt_bias: &dt_bias };
        g.bench_function(BenchmarkId::new(format!("{mode:?}"), t), |bench| {
            bench.iter_batched_ref(
                || b.zeros_f32(&[vh, d, d]).unwrap(),
                |state| b.gated_delta_rule(&inputs, state, mode).unwrap(),
                criterion::BatchSize::SmallInput,
            )
        });
    }
}

/// One new token (decode) and a 64-token chunk (prefill) over a cache of 512 positions:
/// 16 query heads, 2 KV heads, head dim 128.
fn attention(c: &mut Criterion) {
    let (qh, kvh, d, cached) = (16, 2, 128, 512);
    let b = CpuBackend::new();
    let params = AttentionParams { scale: 1.0 / (d as f32).sqrt(), window: None };
    // Each sample fills a fresh pool first (untimed), so fewer samples.
    let mut g = c.benchmark_group("attention 16/2 heads d128 after 512");
    g.sample_size(20);
    for t in TOKENS {
        let (q, k, v) =
            (activations(&b, &[t, qh, d], 14), activations(&b, &[t, kvh, d], 15), activations(&b, &[t, kvh, d], 16));
        // Enough blocks for the prefix and the step, in order.
        let blocks = (cached + t).div_ceil(b.kv_block_size());
        let table: Vec<u32> = (0..blocks as u32).collect();
        g.bench_function(BenchmarkId::from_parameter(t), |bench| {
            bench.iter_batched_ref(
                || {
                    let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: kvh, head_dim: d, blocks }]).unwrap();
                    let (pk, pv) = (activations(&b, &[cached, kvh, d], 17), activations(&b, &[cached, kvh, d], 18));
                    let pq = activations(&b, &[cached, qh, d], 19);
                    b.attention(&pq, &pk, &pv, &mut pool, KvSeq { layer: 0, table: &table, start: 0 }, &params)
                        .unwrap();
                    pool
                },
                |pool| {
                    b.attention(&q, &k, &v, pool, KvSeq { layer: 0, table: &table, start: cached }, &params).unwrap()
                },
                criterion::BatchSize::LargeInput,
            )
        });
    }
}

criterion_group!(benches, linear, rms_norm, moe, gated_delta_rule, attention);
criterion_main!(benches);
