//! Prefill kernels on Qwen3.5-35B-A3B and Laguna-XS.2 shapes (their MoE blocks share one shape;
//! the routing here is softmax) with synthetic weights, each beside its ceiling measured in the
//! same process: bytes ÷ device copy bandwidth and FLOPs ÷ cuBLASLt bf16 GEMM rate. Writes one
//! JSON object per line to `OUT/vt.json` plus the MoE input and router weight (`OUT/moe_x.bin`,
//! `OUT/moe_router.bin`, raw bf16) so that tools/gpu/prefill_peers.py measures torch on the same
//! routing, then prints the joint table.
//!
//! usage: prefill_bench OUT_DIR   (VT_BENCH_WARMUP, VT_BENCH_ITERS: runs per case, default 3 and
//! 20; `VT_BENCH_WARMUP=0 VT_BENCH_ITERS=1` runs each op once, for a profiler; `VT_BENCH_CASES`:
//! a comma-separated subset of `linear,moe,attention,gdn`, default all)

use std::io::Write;

use vt_core::backend::prelude::*;
use vt_core::{
    AttentionParams, DType, Expert, GdnInputs, GdnMode, KvLayout, KvSeq, Linear, MoeExperts, Result, Router,
    RouterKind, Tensor, Weight,
};
use vt_cuda::CudaBackend;

/// Warm-up and timed runs per case.
fn runs() -> (usize, usize) {
    let var = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    (var("VT_BENCH_WARMUP", 3), var("VT_BENCH_ITERS", 20))
}

#[path = "common/cases.rs"]
mod cases;
use cases::wanted;

/// A pool of random bf16 values (uniform in [-1, 1)); weights are windows of it, scaled.
struct Pool(Vec<u16>);

impl Pool {
    fn new(n: usize) -> Self {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        Pool(
            (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let x = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                    half::bf16::from_f32(x).to_bits()
                })
                .collect(),
        )
    }

    /// `n` values from `seed`'s window, times `scale` (bf16 bytes).
    fn bytes(&self, n: usize, seed: usize, scale: f32) -> Vec<u8> {
        let start = seed.wrapping_mul(7_919_993) % (self.0.len() - n.min(self.0.len()) + 1);
        (0..n)
            .flat_map(|i| {
                let v = half::bf16::from_bits(self.0[(start + i) % self.0.len()]).to_f32() * scale;
                half::bf16::from_f32(v).to_le_bytes()
            })
            .collect()
    }

    fn tensor(&self, b: &CudaBackend, shape: &[usize], seed: usize, scale: f32) -> Result<Tensor<CudaBackend>> {
        b.upload(DType::BF16, shape, &self.bytes(shape.iter().product(), seed, scale))
    }
}

struct Rates {
    /// Device copy bandwidth, bytes read + written per second.
    copy: f64,
    /// cuBLASLt bf16 GEMM, FLOP per second.
    gemm: f64,
}

fn rates(b: &CudaBackend, pool: &Pool) -> Result<Rates> {
    let rows = 1 << 18;
    let x = pool.tensor(b, &[rows, 1024], 1, 1.0)?; // 512 MiB
    let ms = b.time_ms(runs().0, runs().1, || b.slice_rows(&x, 0, rows).map(drop))?;
    let copy = 2.0 * (rows * 1024 * 2) as f64 / (ms as f64 * 1e-3);
    let n = 8192;
    let (a, w) = (pool.tensor(b, &[n, n], 2, 1.0)?, Linear::new(b, Weight::Dense(pool.tensor(b, &[n, n], 3, 0.01)?))?);
    let ms = b.time_ms(runs().0, runs().1, || b.linear(&a, &w).map(drop))?;
    let gemm = 2.0 * (n as f64).powi(3) / (ms as f64 * 1e-3);
    Ok(Rates { copy, gemm })
}

struct Row {
    name: String,
    ms: f32,
    flops: f64,
    bytes: f64,
}

impl Row {
    fn json(&self, r: &Rates) -> String {
        let ceil_ms = (self.flops / r.gemm).max(self.bytes / r.copy) * 1e3;
        format!(
            "{{\"name\": \"{}\", \"ms\": {:.4}, \"ceiling_ms\": {ceil_ms:.4}, \"flops\": {:.4e}, \"bytes\": {:.4e}, \"copy_tb_s\": {:.3}, \"gemm_tflop_s\": {:.1}}}",
            self.name,
            self.ms,
            self.flops,
            self.bytes,
            r.copy / 1e12,
            r.gemm / 1e12
        )
    }
}

/// The routed-experts block at prefill, experts in bf16 or NVFP4 (same input and router).
fn moe(b: &CudaBackend, pool: &Pool, out: &std::path::Path, nvfp4_experts: bool) -> Result<Row> {
    let (t, h, inter, n_exp, top_k) = (4096, 2048, 512, 256, 8);
    let x_bytes = pool.bytes(t * h, 10, 1.0);
    let r_bytes = pool.bytes(n_exp * h, 11, 0.05);
    std::fs::write(out.join("moe_x.bin"), &x_bytes).map_err(|e| vt_core::Error::backend("bench", e.to_string()))?;
    std::fs::write(out.join("moe_router.bin"), &r_bytes)
        .map_err(|e| vt_core::Error::backend("bench", e.to_string()))?;
    let x = b.upload(DType::BF16, &[t, h], &x_bytes)?;
    let router = Router {
        weight: Linear::new(b, Weight::Dense(b.upload(DType::BF16, &[n_exp, h], &r_bytes)?))?,
        kind: RouterKind::Softmax { top_k, renormalize: true },
        correction_bias: None,
    };
    let scale = 1.0 / (h as f32).sqrt();
    let experts = (0..n_exp)
        .map(|e| {
            let weight = |n, k, seed| match nvfp4_experts {
                true => nvfp4(b, n, k, seed as u64),
                false => Ok(Weight::Dense(pool.tensor(b, &[n, k], seed, scale)?)),
            };
            Ok(Expert {
                gate: weight(inter, h, 100 + 3 * e)?,
                up: weight(inter, h, 101 + 3 * e)?,
                down: weight(h, inter, 102 + 3 * e)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let experts = MoeExperts::new(b, "experts", experts, h, inter)?;
    let ms = b.time_ms(runs().0, runs().1, || b.moe(&x, &router, &experts).map(drop))?;
    let weight_bytes = (3 * n_exp * h * inter) as f64 * if nvfp4_experts { 0.5625 } else { 2.0 };
    Ok(Row {
        name: format!("moe {} t={t} h={h} i={inter} e={n_exp} k={top_k}", if nvfp4_experts { "nvfp4" } else { "bf16" }),
        ms,
        flops: 6.0 * (t * top_k * h * inter) as f64,
        bytes: weight_bytes,
    })
}

/// A random NVFP4 weight `[n, k]`: codes uniform, scales around 2^-1..2^0 (fp8 exponents 6, 7),
/// the global multiplier `0.5 / sqrt(k)`, so outputs stay of the inputs' size.
fn nvfp4(b: &CudaBackend, n: usize, k: usize, seed: u64) -> Result<Weight<CudaBackend>> {
    let mut s = 0x2545_f491_4f6c_dd1du64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut bytes = |len: usize, f: fn(u8) -> u8| -> Vec<u8> {
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                f((s >> 32) as u8)
            })
            .collect()
    };
    let codes = b.upload(DType::F4x2, &[n, k], &bytes(n * k / 2, |v| v))?;
    let scales = b.upload(DType::F8E4M3, &[n, k / 16], &bytes(n * k / 16, |v| 0x30 + (v & 0x0f)))?;
    Ok(Weight::Nvfp4(vt_core::Nvfp4::new(b, "bench weight", codes, scales, 0.5 / (k as f32).sqrt())?))
}

/// The NVFP4 linear (W4A16 tensor-core kernel) at `[t, k] x [n, k]^T` beside cuBLASLt's bf16 GEMM of
/// the same shape, same input.
fn nvfp4_linear(b: &CudaBackend, pool: &Pool, t: usize, n: usize, k: usize) -> Result<[Row; 2]> {
    let w4 = Linear::new(b, nvfp4(b, n, k, (n * k) as u64)?)?;
    let dense = Linear::new(b, Weight::Dense(pool.tensor(b, &[n, k], 41, 1.0 / (k as f32).sqrt())?))?;
    let x = pool.tensor(b, &[t, k], 40, 1.0)?;
    let flops = 2.0 * (t * n * k) as f64;
    let ms4 = b.time_ms(runs().0, runs().1, || b.linear(&x, &w4).map(drop))?;
    let ms16 = b.time_ms(runs().0, runs().1, || b.linear(&x, &dense).map(drop))?;
    eprintln!(
        "nvfp4 linear t={t} n={n} k={k}: {ms4:.3} ms ({:.0} TFLOP/s), bf16 cuBLASLt {ms16:.3} ms ({:.0} TFLOP/s): nvfp4 / bf16 time {:.2}",
        flops / (ms4 as f64 * 1e9),
        flops / (ms16 as f64 * 1e9),
        ms4 / ms16
    );
    let io = ((t * k + t * n) * 2) as f64;
    Ok([
        Row { name: format!("linear nvfp4 t={t} n={n} k={k}"), ms: ms4, flops, bytes: io + (n * k) as f64 * 0.5625 },
        Row {
            name: format!("linear bf16 cublaslt t={t} n={n} k={k}"),
            ms: ms16,
            flops,
            bytes: io + (n * k * 2) as f64,
        },
    ])
}

/// Where NVFP4 prefill turns from the W4A16 kernel (`w4a16`: a backend that never expands the
/// weight) to a bf16 copy of the weight and cuBLASLt (`b`, from NV4_DEQUANT_FROM_T tokens), at
/// `[t, k] x [n, k]^T` beside bf16 cuBLASLt, same input.
fn nvfp4_crossover(b: &CudaBackend, w4a16: &CudaBackend, pool: &Pool, t: usize, (n, k): (usize, usize)) -> Result<()> {
    let w4 = Linear::new(b, nvfp4(b, n, k, (n * k) as u64)?)?;
    let dense = Linear::new(b, Weight::Dense(pool.tensor(b, &[n, k], 41, 1.0 / (k as f32).sqrt())?))?;
    let x = pool.tensor(b, &[t, k], 40, 1.0)?;
    let time =
        |be: &CudaBackend, w: &Linear<CudaBackend>| be.time_ms(runs().0, runs().1, || be.linear(&x, w).map(drop));
    let (ms_b, ms_k, ms16) = (time(b, &w4)?, time(w4a16, &w4)?, time(b, &dense)?);
    eprintln!(
        "nvfp4 linear t={t} n={n} k={k}: vt {ms_b:.4} ms, W4A16 kernel {ms_k:.4} ms, bf16 cuBLASLt {ms16:.4} ms: vt / bf16 time {:.2}",
        ms_b / ms16
    );
    Ok(())
}

/// Causal attention of `t` queries over as many keys, heads `(hq, hkv, d)`, a sliding window of
/// `window` keys or none.
fn attention(
    b: &CudaBackend,
    pool: &Pool,
    t: usize,
    (hq, hkv, d): (usize, usize, usize),
    window: Option<usize>,
) -> Result<Row> {
    let q = pool.tensor(b, &[t, hq, d], 20, 1.0)?;
    let k = pool.tensor(b, &[t, hkv, d], 21, 1.0)?;
    let v = pool.tensor(b, &[t, hkv, d], 22, 1.0)?;
    let params = AttentionParams { scale: (d as f32).powf(-0.5), window };
    // One sequence in a pool of its own blocks, in order.
    let table: Vec<u32> = (0..t.div_ceil(b.kv_block_size()) as u32).collect();
    let mut kv = b.new_kv_pool(&[KvLayout { kv_heads: hkv, head_dim: d, blocks: table.len() }])?;
    let ms = b.time_ms(runs().0, runs().1, || {
        b.attention(&q, &k, &v, &mut kv, KvSeq { layer: 0, table: &table, start: 0 }, &params).map(drop)
    })?;
    // Query p sees min(p + 1, window) keys.
    let pairs: usize = (0..t).map(|p| window.map_or(p + 1, |w| (p + 1).min(w))).sum();
    let mask = window.map_or("causal".to_string(), |w| format!("window={w}"));
    Ok(Row {
        name: format!("attention t={t} hq={hq} hkv={hkv} d={d} {mask}"),
        ms,
        flops: 4.0 * (hq * d) as f64 * pairs as f64,
        bytes: (2 * t * (2 * hq + 2 * hkv) * d) as f64,
    })
}

fn gdn(b: &CudaBackend, pool: &Pool) -> Result<Row> {
    let (t, kh, vh, dk, dv) = (8192, 16, 32, 128, 128);
    let q = pool.tensor(b, &[t, kh, dk], 30, 1.0)?;
    let k = pool.tensor(b, &[t, kh, dk], 31, 1.0)?;
    let v = pool.tensor(b, &[t, vh, dv], 32, 1.0)?;
    let a = pool.tensor(b, &[t, vh], 33, 2.0)?;
    let bb = pool.tensor(b, &[t, vh], 34, 2.0)?;
    let a_log = pool.tensor(b, &[vh], 35, 1.0)?;
    let dt_bias = pool.tensor(b, &[vh], 36, 1.0)?;
    let mut state = b.zeros_f32(&[vh, dk, dv])?;
    let inputs = GdnInputs { q: &q, k: &k, v: &v, a: &a, b: &bb, a_log: &a_log, dt_bias: &dt_bias };
    let ms = b.time_ms(runs().0, runs().1, || b.gated_delta_rule(&inputs, &mut state, GdnMode::Chunked).map(drop))?;
    // Chunked-form multiply-adds per token and head (chunk C = 64): K K^T and Q K^T (2 C dk),
    // W and U (C dk + C dv), the state reads W S and Q S (2 dk dv), P V (C dv), the update (dk dv).
    let c = 64;
    let macs = (3 * c * dk + 2 * c * dv + 3 * dk * dv) * t * vh;
    Ok(Row {
        name: format!("gdn chunked t={t} kh={kh} vh={vh} dk={dk} dv={dv}"),
        ms,
        flops: 2.0 * macs as f64,
        bytes: (2 * t * (2 * kh * dk + 2 * vh * dv) + 2 * vh * dk * dv * 4) as f64,
    })
}

fn main() -> Result<()> {
    let out = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "/tmp/vt-bench".into()));
    std::fs::create_dir_all(&out).map_err(|e| vt_core::Error::backend("bench", e.to_string()))?;
    let b = CudaBackend::new()?;
    let pool = Pool::new(1 << 25);
    let r = rates(&b, &pool)?;
    eprintln!("copy {:.2} TB/s, bf16 GEMM {:.0} TFLOP/s", r.copy / 1e12, r.gemm / 1e12);
    let mut lines = Vec::new();
    // A failing case is reported and the rest still run (unless it broke the context).
    let mut cases = Vec::new();
    for (n, k) in [(8192, 2048), (12352, 2048), (2048, 8192)].into_iter().filter(|_| wanted("linear")) {
        match nvfp4_linear(&b, &pool, 4096, n, k) {
            Ok(rows) => cases.extend(rows.map(Ok)),
            Err(e) => cases.push(Err(e)),
        }
    }
    if wanted("linear") {
        let w4a16 = b.with_kernel_defines(&[("NV4_DEQUANT_FROM_T", 1 << 30)])?;
        for t in [64, 128, 256, 512, 1024, 4096] {
            if let Err(e) = nvfp4_crossover(&b, &w4a16, &pool, t, (8192, 2048)) {
                eprintln!("nvfp4 crossover t={t}: {e}");
            }
        }
    }
    if wanted("moe") {
        let (moe16, moe4) = (moe(&b, &pool, &out, false), moe(&b, &pool, &out, true));
        if let (Ok(m16), Ok(m4)) = (&moe16, &moe4) {
            eprintln!(
                "nvfp4 MoE prefill {:.3} ms ({:.0} TFLOP/s, {:.2} of the bf16 GEMM rate), bf16 grouped {:.3} ms: nvfp4 / bf16 time {:.2}",
                m4.ms,
                m4.flops / (m4.ms as f64 * 1e9),
                m4.flops / (m4.ms as f64 * 1e-3) / r.gemm,
                m16.ms,
                m4.ms / m16.ms
            );
        }
        cases.extend([moe16, moe4]);
    }
    if wanted("attention") {
        // Qwen3.5-35B-A3B's full-attention layers, then Laguna-XS.2's global and sliding ones.
        let (qwen, laguna_global, laguna_swa) = ((16, 2, 256), (64, 8, 128), (48, 8, 128));
        for t in [4096, 8192] {
            cases.extend([attention(&b, &pool, t, qwen, None), attention(&b, &pool, t, laguna_global, None)]);
        }
        cases.push(attention(&b, &pool, 8192, laguna_swa, Some(512)));
    }
    if wanted("gdn") {
        cases.push(gdn(&b, &pool));
    }
    for row in cases {
        match row {
            Ok(row) => {
                let line = row.json(&r);
                eprintln!("{line}");
                lines.push(line);
            }
            Err(e) => eprintln!("case failed: {e}"),
        }
    }
    let mut f =
        std::fs::File::create(out.join("vt.json")).map_err(|e| vt_core::Error::backend("bench", e.to_string()))?;
    writeln!(f, "{}", lines.join("\n")).map_err(|e| vt_core::Error::backend("bench", e.to_string()))?;
    Ok(())
}
