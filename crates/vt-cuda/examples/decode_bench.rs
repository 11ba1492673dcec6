//! Decode kernels on the device at Qwen3.5-35B-A3B shapes (and Laguna-XS.2's attention), each
//! beside its ceiling (bytes it must read ÷ the device-to-device copy bandwidth measured in the
//! same process) and beside a peer measured in the same device call (tools/gpu/decode_peers.py
//! writes `name µs` lines; pass that file as the first argument). Device time comes from CUDA
//! events around calls queued behind a spin (`CudaBackend::time_queued`); inputs rotate over
//! copies larger than the 60 MB L2.
//!
//! cargo build --release -p vt-cuda --features cuda --example decode_bench
//! decode_bench [peers.txt]   (`VT_BENCH_CASES`: a comma-separated subset of
//! `gemv,argmax,gdn,attention,moe,nv4,bf16moe`, default all but the sweeps nv4 and bf16moe)
//!
//! `nv4` sweeps the NVFP4 decode kernels' launch shapes (limits.rs's GEMV_NV4_* and MOE_NV4_*),
//! `bf16moe` the bf16 MoE kernels' (MOE_DEC_GU_WARPS, MOE_DEC_THREADS, MOE_DEC_WAVE_BF16,
//! MOE_DEC_T1_*), each variant's kernels compiled into a backend of their own on the same device
//! and memory: µs and the weights' bytes per second of each variant beside limits.rs's values.

use std::collections::HashMap;

use vt_core::backend::composed;
use vt_core::backend::prelude::*;
use vt_core::{
    AttentionParams, DType, Expert, GdnState, GdnStep, KvLayout, KvSeq, Linear, MoeExperts, Nvfp4, Result, Router,
    RouterKind, SharedExpert, Tensor, Weight,
};
use vt_cuda::CudaBackend;

type B = CudaBackend;

#[path = "common/cases.rs"]
mod cases;
use cases::wanted;

/// Qwen3.5-35B-A3B.
const H: usize = 2048;
const EXPERTS: usize = 256;
const TOP_K: usize = 8;
const INTER: usize = 512;
const KEY_HEADS: usize = 16;
const VALUE_HEADS: usize = 32;
const HEAD: usize = 128;

struct Report {
    bandwidth: f64,
    peers: HashMap<String, f64>,
}

impl Report {
    /// One table row: time, ceiling, ratio, peer.
    fn row(&self, name: &str, us: f64, bytes: f64, peer: &str) {
        let ceiling = bytes / self.bandwidth * 1e6;
        let peer = match self.peers.get(peer) {
            Some(p) => format!("{peer} {p:>9.2} µs  peer/vt {:>6.2}x", p / us),
            None => String::from("-"),
        };
        println!(
            "{name:<44} {us:>9.2} µs  {:>8.1} MB  ceiling {ceiling:>8.2} µs  vt/ceiling {:>5.2}x  {peer}",
            bytes / 1e6,
            us / ceiling
        );
    }
}

fn weight(b: &B, fp4: bool, n: usize, k: usize, seed: u64) -> Result<Weight<B>> {
    Ok(if fp4 {
        Weight::Nvfp4(Nvfp4::new(
            b,
            "bench weight",
            b.random(DType::F4x2, &[n, k], seed, 1.0)?,
            b.random(DType::F8E4M3, &[n, k / 16], seed ^ 1, 1.0)?,
            0.5 / (k as f32).sqrt(),
        )?)
    } else {
        Weight::Dense(b.random(DType::BF16, &[n, k], seed, (3.0 / k as f32).sqrt())?)
    })
}

fn bytes_per_weight(fp4: bool) -> f64 {
    if fp4 {
        0.5 + 1.0 / 16.0
    } else {
        2.0
    }
}

struct MoeLayer {
    router: Router<B>,
    experts: MoeExperts<B>,
    shared: [Linear<B>; 3],
    gate: Linear<B>,
}

impl MoeLayer {
    /// Routed experts NVFP4 or bf16 (`fp4`), the shared expert as `shared_fp4` says.
    fn new(b: &B, fp4: bool, shared_fp4: bool, seed: u64) -> Result<Self> {
        let experts = (0..EXPERTS as u64)
            .map(|e| {
                let s = seed * 1000 + 3 * e;
                Ok(Expert {
                    gate: weight(b, fp4, INTER, H, s)?,
                    up: weight(b, fp4, INTER, H, s + 1)?,
                    down: weight(b, fp4, H, INTER, s + 2)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lin = |n, k, s| Linear::new(b, weight(b, shared_fp4, n, k, s)?);
        Ok(MoeLayer {
            router: Router {
                weight: Linear::new(b, weight(b, false, EXPERTS, H, seed ^ 0xabc)?)?,
                kind: RouterKind::Softmax { top_k: TOP_K, renormalize: true },
                correction_bias: None,
            },
            experts: MoeExperts::new(b, "experts", experts, H, INTER)?,
            shared: [lin(INTER, H, seed ^ 7)?, lin(INTER, H, seed ^ 8)?, lin(H, INTER, seed ^ 9)?],
            gate: Linear::new(b, weight(b, false, 1, H, seed ^ 10)?)?,
        })
    }

    fn shared(&self) -> SharedExpert<'_, B> {
        SharedExpert { gate: &self.shared[0], up: &self.shared[1], down: &self.shared[2], gate_proj: Some(&self.gate) }
    }
}

/// Bytes a MoE layer reads for `t` tokens: the router and gate rows, the experts the tokens may
/// pick (at most t * k) and the shared expert.
fn moe_bytes(t: usize, fp4: bool, shared_fp4: bool) -> f64 {
    let (routed, matrix) = ((TOP_K * t).min(EXPERTS), (3 * INTER * H) as f64);
    (EXPERTS * H * 2 + H * 2) as f64 + matrix * (routed as f64 * bytes_per_weight(fp4) + bytes_per_weight(shared_fp4))
}

/// The MoE layer fused and composed, its routed experts NVFP4 or bf16 (`fp4`) and its shared
/// expert as `shared_fp4` says (NVFP4 beside bf16 is ModelOpt's layout, whose shared expert went
/// through its own projections beside the fused kernels before they took it: that is its
/// "before").
fn moe(b: &B, r: &Report, fp4: bool, shared_fp4: bool) -> Result<()> {
    let layers =
        (0..if fp4 { 8 } else { 4 }).map(|l| MoeLayer::new(b, fp4, shared_fp4, l + 1)).collect::<Result<Vec<_>>>()?;
    let fmt = match (fp4, shared_fp4) {
        (true, false) => "nvfp4 + bf16 shared",
        (true, true) => "nvfp4",
        _ => "bf16",
    };
    for t in [1usize, 4] {
        let xs = (0..layers.len() as u64)
            .map(|l| b.random(DType::BF16, &[t, H], 77 + l, 1.0))
            .collect::<Result<Vec<_>>>()?;
        let run = |i: usize, fused: bool| -> Result<()> {
            let (l, x) = (&layers[i % layers.len()], &xs[i % layers.len()]);
            if fused {
                b.moe_block(x, &l.router, &l.experts, Some(&l.shared()))?;
            } else if fp4 != shared_fp4 {
                let routed = b.moe_block(x, &l.router, &l.experts, None)?;
                composed::add_shared_expert(b, x, &routed, &l.shared())?;
            } else {
                composed::moe_block(b, x, &l.router, &l.experts, Some(&l.shared()))?;
            }
            Ok(())
        };
        for i in 0..layers.len() {
            run(i, true)?;
            run(i, false)?;
        }
        let bytes = moe_bytes(t, fp4, shared_fp4);
        let fused = b.time_queued(200, 30.0, |i| run(i, true))?;
        let composed = b.time_queued(50, 30.0, |i| run(i, false))?;
        let peer = if fp4 { String::new() } else { format!("hf_moe_block_t{t}") };
        r.row(&format!("moe layer {fmt} t={t} (fused)"), fused.device_us, bytes, &peer);
        let before = if fp4 == shared_fp4 { "composed ops" } else { "shared expert composed" };
        r.row(&format!("moe layer {fmt} t={t} ({before}, before)"), composed.device_us, bytes, "");
        println!("    host µs per call: fused {:.1}, composed {:.1}", fused.host_us, composed.host_us);
    }
    Ok(())
}

fn gdn(b: &B, r: &Report) -> Result<()> {
    for batch in [1usize, 16, 64] {
        // `batch` sequences of Qwen3.5's heads, each with its own states.
        let (kh, vh) = (KEY_HEADS, VALUE_HEADS);
        let channels = (2 * kh + vh) * HEAD;
        let sets = (256 / batch).max(2);
        let mut states = (0..sets * batch)
            .map(|_| Ok((b.zeros(&[channels, 3])?, b.zeros_f32(&[vh, HEAD, HEAD])?)))
            .collect::<Result<Vec<_>>>()?;
        let rnd = |shape: &[usize], seed| b.random(DType::BF16, shape, seed, 1.0);
        let (qkv, conv, a, bb) =
            (rnd(&[batch, channels], 1)?, rnd(&[channels, 4], 2)?, rnd(&[batch, vh], 3)?, rnd(&[batch, vh], 4)?);
        let (a_log, dt_bias) = (rnd(&[vh], 5)?, rnd(&[vh], 6)?);
        let step = GdnStep {
            qkv: &qkv,
            conv: &conv,
            a: &a,
            b: &bb,
            a_log: &a_log,
            dt_bias: &dt_bias,
            key_heads: kh,
            key_dim: HEAD,
            value_heads: vh,
            value_dim: HEAD,
        };
        let mut run = |i: usize, fused: bool| -> Result<()> {
            let set = i % sets;
            let mut seqs: Vec<GdnState<'_, B>> = states[set * batch..(set + 1) * batch]
                .iter_mut()
                .map(|(conv, recurrent)| GdnState { conv, recurrent })
                .collect();
            if fused {
                b.gated_delta_step(&step, &mut seqs)?;
            } else {
                composed::gated_delta_step(b, &step, &mut seqs)?;
            }
            Ok(())
        };
        for i in 0..sets {
            run(i, true)?;
            run(i, false)?;
        }
        let state_bytes = (2 * batch * vh * HEAD * HEAD * 4) as f64;
        let fused = b.time_queued(200, 30.0, |i| run(i, true))?;
        // The peer does what vt's step does: FLA's conv update, then its recurrent kernel with the
        // gates fused (decode_peers.py); its recurrent kernel alone, on gates computed beforehand,
        // follows for reference.
        r.row(
            &format!("gdn decode step batch {batch} (fused)"),
            fused.device_us,
            state_bytes,
            &format!("fla_conv_recurrent_b{batch}"),
        );
        if let Some(alone) = r.peers.get(&format!("fla_fused_recurrent_b{batch}")) {
            println!("    fla recurrent kernel alone (no conv, gates precomputed): {alone:.2} µs");
        }
        let composed = b.time_queued(50, 30.0, |i| run(i, false))?;
        r.row(&format!("gdn decode step batch {batch} (composed, before)"), composed.device_us, state_bytes, "");
    }
    Ok(())
}

fn gemv(b: &B, r: &Report) -> Result<()> {
    for (name, n, k, fp4, t) in [
        ("lm_head", 248_320, H, false, 1),
        ("in_proj_qkv", 8192, H, false, 1),
        ("in_proj_qkv", 8192, H, false, 4),
        ("in_proj_qkv", 8192, H, false, 8),
        ("in_proj_qkv", 8192, H, false, 16),
        ("out_proj", H, 4096, false, 1),
        ("out_proj", H, 4096, false, 4),
        ("out_proj", H, 4096, false, 16),
        ("lm_head", 248_320, H, false, 4),
        ("in_proj_qkv", 8192, H, true, 1),
        ("in_proj_qkv", 8192, H, true, 4),
        ("in_proj_qkv", 8192, H, true, 16),
        ("out_proj", H, 4096, true, 1),
        ("out_proj", H, 4096, true, 8),
        ("shared_expert_up", INTER, H, true, 1),
        ("lm_head", 248_320, H, true, 1),
    ] {
        let bytes = (n * k) as f64 * bytes_per_weight(fp4);
        let copies = ((256e6 / bytes).ceil() as usize).max(1);
        let ws = (0..copies as u64).map(|s| Linear::new(b, weight(b, fp4, n, k, s)?)).collect::<Result<Vec<_>>>()?;
        let x = b.random(DType::BF16, &[t, k], 9, 1.0)?;
        let fmt = if fp4 { "nvfp4" } else { "bf16" };
        let time = b.time_queued(100, 30.0, |i| b.linear(&x, &ws[i % copies]).map(|_| ()))?;
        r.row(
            &format!("gemv {name} [{n}, {k}] {fmt} t={t}"),
            time.device_us,
            bytes,
            &format!("torch_linear_{n}x{k}_{fmt}_t{t}"),
        );
    }
    Ok(())
}

/// Launch shapes of the NVFP4 decode kernels a `nv4` run compares, as limits.rs's numbers: each
/// list beside limits.rs's values (the empty variant). The first non-empty variant of each is the
/// shape of 14ceb6d (4-warp blocks; the down kernel's rounds of 6).
const NV4_GEMV_VARIANTS: &[&[(&str, i64)]] = &[
    &[],
    &[("GEMV_NV4_TILES", 4), ("GEMV_NV4_MAX_WARPS", 4)],
    &[("GEMV_NV4_TILES", 4), ("GEMV_NV4_MAX_WARPS", 8)],
    &[("GEMV_NV4_TILES", 2), ("GEMV_NV4_MAX_WARPS", 16)],
    &[("GEMV_NV4_TILES", 2), ("GEMV_NV4_MAX_WARPS", 8)],
    &[("GEMV_NV4_TILES", 8), ("GEMV_NV4_MAX_WARPS", 16)],
    &[("GEMV_NV4_TILES", 8), ("GEMV_NV4_MAX_WARPS", 8)],
];
const NV4_MOE_VARIANTS: &[&[(&str, i64)]] = &[
    &[],
    &[("MOE_NV4_WARPS", 4), ("MOE_NV4_U", 4), ("MOE_NV4_DOWN_WARPS", 8), ("MOE_NV4_DOWN_U", 6)],
    &[("MOE_NV4_WARPS", 4), ("MOE_NV4_U", 8)],
    &[("MOE_NV4_WARPS", 8), ("MOE_NV4_U", 2)],
    &[("MOE_NV4_WARPS", 16), ("MOE_NV4_U", 2)],
    &[("MOE_NV4_WARPS", 16), ("MOE_NV4_U", 1)],
    &[("MOE_NV4_DOWN_WARPS", 8), ("MOE_NV4_DOWN_U", 6)],
    &[("MOE_NV4_DOWN_WARPS", 8), ("MOE_NV4_DOWN_U", 3)],
    &[("MOE_NV4_DOWN_WARPS", 16), ("MOE_NV4_DOWN_U", 5)],
    &[("MOE_NV4_DOWN_WARPS", 16), ("MOE_NV4_DOWN_U", 3)],
    &[("MOE_NV4_DOWN_WARPS", 4), ("MOE_NV4_DOWN_U", 18)],
    &[("MOE_NV4_DOWN_WARPS", 4), ("MOE_NV4_DOWN_U", 9)],
    &[("MOE_NV4_DOWN1_WARPS", 8), ("MOE_NV4_DOWN1_U", 9)],
    &[("MOE_NV4_DOWN1_WARPS", 16), ("MOE_NV4_DOWN1_U", 3)],
];

/// Launch shapes of the bf16 MoE kernels: the gate/up kernel's warps a block, the down kernels'
/// threads a block and blocks a SM (one resident wave), the one-token instance's (MOE_DEC_T1_*)
/// and the rest's.
const BF16_MOE_VARIANTS: &[&[(&str, i64)]] = &[
    &[],
    &[("MOE_DEC_GU_WARPS", 8)],
    &[("MOE_DEC_GU_WARPS", 16)],
    &[("MOE_DEC_GU_WARPS", 2)],
    &[("MOE_DEC_GU_WARPS", 8), ("MOE_DEC_THREADS", 512), ("MOE_DEC_WAVE_BF16", 2)],
    &[("MOE_DEC_T1_THREADS", 256), ("MOE_DEC_T1_WAVE_BF16", 4)],
    &[("MOE_DEC_T1_THREADS", 1024), ("MOE_DEC_T1_WAVE_BF16", 1)],
];

/// Each variant's backend, named by its numbers.
fn variants(b: &B, list: &[&[(&str, i64)]]) -> Result<Vec<(String, B)>> {
    list.iter()
        .map(|v| {
            let name = match v {
                [] => "limits.rs".to_string(),
                _ => v.iter().map(|(n, x)| format!("{n}={x}")).collect::<Vec<_>>().join(" "),
            };
            Ok((name, b.with_kernel_defines(v)?))
        })
        .collect()
}

/// One line of the `nv4` sweep: time, the bytes' rate and the ceiling's multiple.
fn nv4_row(r: &Report, case: &str, variant: &str, us: f64, bytes: f64) {
    let ceiling = bytes / r.bandwidth * 1e6;
    println!(
        "nv4 {case:<30} {us:>8.2} µs  {:>5.2} TB/s  vt/ceiling {:>5.2}x  {variant}",
        bytes / us * 1e-6,
        us / ceiling
    );
}

/// The NVFP4 GEMV (a full-attention layer's q, k and v rows in one launch; the output projection)
/// and the fused MoE layer at Qwen3.5-35B-A3B's shapes under each launch shape of the lists above.
fn nv4(b: &B, r: &Report) -> Result<()> {
    let gemv_variants = variants(b, NV4_GEMV_VARIANTS)?;
    for (n, k) in [(9216, H), (H, 4096)] {
        let bytes = (n * k) as f64 * bytes_per_weight(true);
        let copies = ((256e6 / bytes).ceil() as usize).max(1);
        let ws = (0..copies as u64).map(|s| Linear::new(b, weight(b, true, n, k, s)?)).collect::<Result<Vec<_>>>()?;
        for t in [1usize, 2, 8, 16] {
            let x = b.random(DType::BF16, &[t, k], 9, 1.0)?;
            for (name, vb) in &gemv_variants {
                vb.linear(&x, &ws[0])?;
                let time = vb.time_queued(100, 30.0, |i| vb.linear(&x, &ws[i % copies]).map(|_| ()))?;
                nv4_row(r, &format!("gemv [{n}, {k}] t={t}"), name, time.device_us, bytes);
            }
        }
    }
    drop(gemv_variants);
    moe_sweep(b, r, true, NV4_MOE_VARIANTS)
}

/// The fused MoE layer at Qwen3.5-35B-A3B's shapes, NVFP4 (`fp4`) or bf16, under each launch
/// shape of `list`.
fn moe_sweep(b: &B, r: &Report, fp4: bool, list: &[&[(&str, i64)]]) -> Result<()> {
    let moe_variants = variants(b, list)?;
    let layers = (0..8).map(|l| MoeLayer::new(b, fp4, fp4, l + 1)).collect::<Result<Vec<_>>>()?;
    let fmt = if fp4 { "nvfp4" } else { "bf16" };
    for t in [1usize, 4, 16] {
        let xs = (0..layers.len() as u64)
            .map(|l| b.random(DType::BF16, &[t, H], 77 + l, 1.0))
            .collect::<Result<Vec<_>>>()?;
        for (name, vb) in &moe_variants {
            let run = |i: usize| -> Result<()> {
                let l = &layers[i % layers.len()];
                vb.moe_block(&xs[i % layers.len()], &l.router, &l.experts, Some(&l.shared()))?;
                Ok(())
            };
            for i in 0..layers.len() {
                run(i)?;
            }
            let time = vb.time_queued(200, 30.0, run)?;
            nv4_row(r, &format!("moe layer {fmt} t={t}"), name, time.device_us, moe_bytes(t, fp4, fp4));
        }
    }
    Ok(())
}

/// One decode step of attention, heads `(hq, hkv, d)`, over a sequence of `ctx` positions in a
/// pool's blocks (with a window, it reads min(ctx, window) keys).
fn attention(b: &B, r: &Report, (hq, hkv, d): (usize, usize, usize), ctx: usize, window: Option<usize>) -> Result<()> {
    let params = AttentionParams { scale: (d as f32).powf(-0.5), window };
    let rnd = |shape: &[usize], seed| b.random(DType::BF16, shape, seed, 1.0);
    // 8 sequences (rotating over more bytes than L2 holds), each in blocks of its own, room for
    // the steps timed.
    let (seqs, steps) = (8, 100);
    let per_seq = (ctx + steps).div_ceil(b.kv_block_size());
    let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: hkv, head_dim: d, blocks: seqs * per_seq }])?;
    let tables: Vec<Vec<u32>> =
        (0..seqs).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
    let mut lens = vec![0; seqs];
    for (s, table) in tables.iter().enumerate() {
        let seq = KvSeq { layer: 0, table, start: 0 };
        let (q, k, v) =
            (rnd(&[ctx, hq, d], s as u64)?, rnd(&[ctx, hkv, d], s as u64 + 10)?, rnd(&[ctx, hkv, d], s as u64 + 20)?);
        b.attention(&q, &k, &v, &mut pool, seq, &params)?;
        lens[s] = ctx;
    }
    let (q, k, v) = (rnd(&[1, hq, d], 1)?, rnd(&[1, hkv, d], 2)?, rnd(&[1, hkv, d], 3)?);
    let mut step = |i: usize| {
        let s = i % seqs;
        b.attention(&q, &k, &v, &mut pool, KvSeq { layer: 0, table: &tables[s], start: lens[s] }, &params)?;
        lens[s] += 1;
        Ok(())
    };
    for i in 0..seqs {
        step(i)?;
    }
    let time = b.time_queued(64, 30.0, &mut step)?;
    // The keys a step reads: every position so far, or the window's.
    let keys = window.map_or(ctx + 9, |w| w.min(ctx + 9));
    let bytes = (2 * keys * hkv * d * 2) as f64;
    let peer_keys = window.unwrap_or(ctx);
    let name = match window {
        Some(w) => format!("attention decode ctx {ctx} window {w} [{hq}, {hkv}, {d}]"),
        None => format!("attention decode ctx {ctx} [{hq}, {hkv}, {d}]"),
    };
    r.row(&name, time.device_us, bytes, &format!("torch_sdpa_decode_{hq}x{hkv}x{d}_keys{peer_keys}"));
    Ok(())
}

/// A greedy pick over Qwen3.5's vocabulary as the engine makes it: launched, then the index read
/// back, so the time is the host's wall time per call (median), set beside torch's
/// `argmax(..).cpu()` measured the same way.
fn argmax(b: &B, r: &Report) -> Result<()> {
    let vocab = 248_320;
    let xs = (0..8).map(|s| b.random(DType::BF16, &[1, vocab], s, 4.0)).collect::<Result<Vec<_>>>()?;
    let mut us = Vec::new();
    for i in 0..64 {
        let t0 = std::time::Instant::now();
        b.argmax_rows(&xs[i % xs.len()], None)?;
        us.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    let median = us[us.len() / 2];
    let peer = match r.peers.get("torch_argmax_1x248320_wall") {
        Some(p) => format!("torch argmax(..).cpu() {p:>9.2} µs  peer/vt {:>6.2}x", p / median),
        None => String::from("-"),
    };
    println!("{:<44} {median:>9.2} µs  (wall, with the read-back)  {peer}", format!("argmax [1, {vocab}] bf16"));
    Ok(())
}

fn main() -> Result<()> {
    let peers = std::env::args()
        .nth(1)
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|s| {
            s.lines()
                .filter_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    Some((k.to_string(), v.trim().parse().ok()?))
                })
                .collect()
        })
        .unwrap_or_default();
    let b = CudaBackend::new()?;
    // Device-to-device copy bandwidth (bytes read + written), the ceilings' denominator.
    let rows = 1 << 16;
    let big: Tensor<B> = b.random(DType::BF16, &[rows, 8192], 1, 1.0)?;
    let copy = b.time_queued(20, 5.0, |_| b.slice_rows(&big, 0, rows).map(|_| ()))?;
    let bandwidth = 2.0 * (rows * 8192 * 2) as f64 / (copy.device_us * 1e-6);
    println!(
        "copy bandwidth {:.2} TB/s (2 x {:.2} GB in {:.1} µs)",
        bandwidth / 1e12,
        (rows * 8192 * 2) as f64 / 1e9,
        copy.device_us
    );
    drop(big);
    let r = Report { bandwidth, peers };
    if wanted("gemv") {
        gemv(&b, &r)?;
    }
    if wanted("argmax") {
        argmax(&b, &r)?;
    }
    if wanted("gdn") {
        gdn(&b, &r)?;
    }
    if wanted("attention") {
        // Qwen3.5-35B-A3B's full attention, then Laguna-XS.2's global layers (at 4000 and 32000
        // keys) and its sliding-window layers.
        attention(&b, &r, (16, 2, 256), 4000, None)?;
        attention(&b, &r, (64, 8, 128), 4000, None)?;
        attention(&b, &r, (64, 8, 128), 32000, None)?;
        attention(&b, &r, (48, 8, 128), 4000, Some(512))?;
    }
    if wanted("moe") {
        moe(&b, &r, false, false)?;
        moe(&b, &r, true, true)?;
        moe(&b, &r, true, false)?;
    }
    // A sweep, only when named (tools/gpu/bench_decode.sh runs the rest in its time limit).
    if std::env::var("VT_BENCH_CASES").is_ok() && wanted("nv4") {
        nv4(&b, &r)?;
    }
    if std::env::var("VT_BENCH_CASES").is_ok() && wanted("bf16moe") {
        moe_sweep(&b, &r, false, BF16_MOE_VARIANTS)?;
    }
    Ok(())
}
