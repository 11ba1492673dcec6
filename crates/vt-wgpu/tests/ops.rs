//! Every Backend op on fresh random inputs, vt-cpu (the reference) against vt-wgpu on whatever
//! adapter there is (lavapipe in CI): each body runs once per backend on the same bf16-rounded
//! inputs, with vt-test-support's op-test helpers (as vt-cuda's tests/ops.rs).
//!
//! Error measure: max |wgpu - cpu| / max |cpu|. Both compute in f32 with f32 accumulation; they
//! differ in summation order (parallel reductions, fused multiply-adds the shader compiler may
//! form) and in the device's exp/log. A sum of n terms in another order moves by at most
//! n * 2^-24 of the sum of magnitudes: the longest sums here are ~600 terms (attention over a
//! cache, GDN's state columns through 70 tokens), under 4e-5 of the output's scale, and the
//! transcendentals add a few ulps. So the bound is 1e-4 for every op; the measured errors are
//! printed (`--nocapture`).

use vt_core::backend::prelude::*;
use vt_core::{
    AttentionParams, DType, GateAct, GdnInputs, GdnMode, GdnState, GdnStep, KvSeq, Linear, NormKind, Rope, Router,
    RouterKind, SharedExpert,
};
use vt_cpu::CpuBackend;
use vt_test_support::ops::*;
use vt_wgpu::WgpuBackend;

const TOL: f32 = 1e-4;

fn wgpu() -> WgpuBackend {
    WgpuBackend::new().expect("a wgpu adapter (lavapipe: Debian's mesa-vulkan-drivers)")
}

macro_rules! on_both {
    ($gpu:expr, $op:expr, |$b:ident| $body:block) => {{
        let cpu: Vec<f32> = {
            let $b = &CpuBackend::new();
            $body
        };
        let gpu: Vec<f32> = {
            let $b: &WgpuBackend = $gpu;
            $body
        };
        report("wgpu", $op, TOL, &gpu, &cpu);
    }};
}

#[test]
fn elementwise_and_norm_ops() {
    let gpu = &wgpu();
    let mut r = Rng(0x1234_5678);
    let (t, d) = (37, 160);
    let (x, y, w) = (r.vec(t * d, 3.0), r.vec(t * d, 3.0), r.vec(d, 1.0));
    let table = r.vec(50 * d, 1.0);
    let ids = [3u32, 49, 0, 7, 7];
    on_both!(gpu, "embedding", |b| {
        out(b, &b.embedding(&b.upload(DType::BF16, &[50, d], &bf16_bytes(&table)).unwrap(), &ids).unwrap())
    });
    for kind in [NormKind::Plain, NormKind::UnitOffset] {
        on_both!(gpu, &format!("rms_norm {kind:?}"), |b| {
            out(b, &b.rms_norm(&act(b, &[t, d], &x), &small(b, &w), 1e-6, kind).unwrap())
        });
        on_both!(gpu, &format!("add_rms_norm {kind:?}"), |b| {
            let (sum, normed) =
                b.add_rms_norm(&act(b, &[t, d], &x), &act(b, &[t, d], &y), &small(b, &w), 1e-6, kind).unwrap();
            [out(b, &sum), out(b, &normed)].concat()
        });
    }
    on_both!(gpu, "rms_norm_gated", |b| {
        out(b, &b.rms_norm_gated(&act(b, &[t, d], &x), &act(b, &[t, d], &y), &small(b, &w), 1e-6).unwrap())
    });
    on_both!(gpu, "add", |b| { out(b, &b.add(&act(b, &[t, d], &x), &act(b, &[t, d], &y)).unwrap()) });
    on_both!(gpu, "swiglu", |b| { out(b, &b.swiglu(&act(b, &[t, d], &x), &act(b, &[t, d], &y)).unwrap()) });
    on_both!(gpu, "gate sigmoid per element", |b| {
        out(b, &b.gate(&act(b, &[t, d], &x), &act(b, &[t, d], &y), GateAct::Sigmoid).unwrap())
    });
    on_both!(gpu, "gate softplus per group", |b| {
        out(b, &b.gate(&act(b, &[t, d], &x), &act(b, &[t, 5], &y[..t * 5]), GateAct::Softplus).unwrap())
    });
    on_both!(gpu, "narrow_cols", |b| { out(b, &b.narrow_cols(&act(b, &[t, d], &x), 17, 40).unwrap()) });
    on_both!(gpu, "copy_into f32", |b| {
        let mut dst = b.zeros(&[t, d]).unwrap();
        b.copy_into(&act(b, &[t, d], &x), &mut dst).unwrap();
        out(b, &dst)
    });
    on_both!(gpu, "copy_into bf16", |b| {
        let mut dst = b.upload(DType::BF16, &[3], &bf16_bytes(&[0.0; 3])).unwrap();
        b.copy_into(&small(b, &w[..3]), &mut dst).unwrap();
        out(b, &dst)
    });
    on_both!(gpu, "slice_rows", |b| { out(b, &b.slice_rows(&act(b, &[t, d], &x), 5, 9).unwrap()) });
    on_both!(gpu, "concat_rows", |b| {
        let (p, q) = (act(b, &[3, d], &x[..3 * d]), act(b, &[t, d], &y));
        out(b, &b.concat_rows(&[&p, &q]).unwrap())
    });
    // Partial rotary (rotary dim 12 of head dim 16) with YaRN-style scaling, from position 1000.
    let rope = Rope { inv_freq: (0..6).map(|i| 10000f32.powf(-(i as f32) / 6.0)).collect(), attention_scaling: 1.15 };
    on_both!(gpu, "rope", |b| { out(b, &b.rope(&act(b, &[t, 10, 16], &x), 1000, &rope).unwrap()) });
}

#[test]
fn linear_every_weight_format() {
    let gpu = &wgpu();
    let mut r = Rng(0xfeed);
    for (n, k) in [(96, 64), (307, 160), (1, 80), (6, 80)] {
        let fp8 = [[128, 128], [16, 48]].map(|block| HostWeight::fp8(&mut r, n, k, block));
        let formats = [HostWeight::bf16(&mut r, n, k), HostWeight::f32(&mut r, n, k), HostWeight::nvfp4(&mut r, n, k)];
        for hw in formats.into_iter().chain(fp8) {
            for t in [1, 37] {
                let x = r.vec(t * k, 2.0);
                on_both!(gpu, &format!("linear {} [{n}, {k}] t={t}", hw.name()), |b| {
                    let lin = Linear::new(b, hw.upload(b)).unwrap();
                    out(b, &b.linear(&act(b, &[t, k], &x), &lin).unwrap())
                });
            }
        }
    }
}

#[test]
fn attention_full_and_windowed_across_calls() {
    let gpu = &wgpu();
    let mut r = Rng(0xa77e);
    // A prefill longer than the window, single-token steps, a short chunk and one longer than the
    // window again.
    let steps = [70usize, 1, 1, 5, 40];
    let total: usize = steps.iter().sum();
    for (hq, hkv, d) in [(6, 2, 32), (4, 2, 40)] {
        let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
        for window in [None, Some(16)] {
            let params = AttentionParams { scale: (d as f32).powf(-0.5), window };
            on_both!(gpu, &format!("attention [{hq}, {hkv}, {d}] window {window:?}"), |b| {
                // Another sequence's blocks between this one's: scattered.
                let (mut pool, tables) = pool_of(b, hkv, d, &[total, total], true);
                let (mut s, mut all) = (0, Vec::new());
                for &n in &steps {
                    let qt = act(b, &[n, hq, d], &q[s * hq * d..(s + n) * hq * d]);
                    let kt = act(b, &[n, hkv, d], &k[s * hkv * d..(s + n) * hkv * d]);
                    let vt = act(b, &[n, hkv, d], &v[s * hkv * d..(s + n) * hkv * d]);
                    let seq = KvSeq { layer: 0, table: &tables[1], start: s };
                    all.extend(out(b, &b.attention(&qt, &kt, &vt, &mut pool, seq, &params).unwrap()));
                    s += n;
                }
                all
            });
        }
    }
}

/// Attention decode of several sequences at once (the composed `attention_decode`): tables of
/// different lengths, scattered blocks, q and k rotated at each sequence's own position.
#[test]
fn attention_decode_batched_sequences() {
    let gpu = &wgpu();
    let mut r = Rng(0xa7b5);
    let (n, (hq, hkv, d)) = (5, (4, 2, 32));
    let lens: Vec<usize> = (0..n).map(|i| 1 + i * 9).collect();
    let total: usize = lens.iter().sum::<usize>() + n;
    let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
    let rope = Rope { inv_freq: (0..4).map(|i| 10000f32.powf(-(i as f32) / 4.0)).collect(), attention_scaling: 1.0 };
    let params = AttentionParams { scale: (d as f32).powf(-0.5), window: Some(20) };
    on_both!(gpu, "attention_decode", |b| {
        let rows = |at: usize, t: usize| {
            (
                act(b, &[t, hq, d], &q[at * hq * d..(at + t) * hq * d]),
                act(b, &[t, hkv, d], &k[at * hkv * d..(at + t) * hkv * d]),
                act(b, &[t, hkv, d], &v[at * hkv * d..(at + t) * hkv * d]),
            )
        };
        let grown: Vec<usize> = lens.iter().map(|l| l + 1).collect();
        let (mut pool, tables) = pool_of(b, hkv, d, &grown, true);
        let mut at = 0;
        for (table, &len) in tables.iter().zip(&lens) {
            let (qt, kt, vt) = rows(at, len);
            b.attention(&qt, &kt, &vt, &mut pool, KvSeq { layer: 0, table, start: 0 }, &params).unwrap();
            at += len;
        }
        let (qt, kt, vt) = rows(at, n);
        let seqs: Vec<KvSeq<'_>> =
            tables.iter().zip(&lens).map(|(table, &l)| KvSeq { layer: 0, table, start: l }).collect();
        out(b, &b.attention_decode(&qt, &kt, &vt, &rope, &mut pool, &seqs, &params).unwrap())
    });
}

#[test]
fn conv_and_gated_delta_rule_across_calls() {
    let gpu = &wgpu();
    let mut r = Rng(0x6d4e);
    let (c, kern) = (48, 4);
    let steps = [19usize, 1, 2, 1];
    let total: usize = steps.iter().sum();
    let (x, w) = (r.vec(total * c, 2.0), r.vec(c * kern, 0.7));
    on_both!(gpu, "causal_conv1d", |b| {
        let wt = b.upload(DType::BF16, &[c, kern], &bf16_bytes(&w)).unwrap();
        let mut state = b.zeros(&[c, kern - 1]).unwrap();
        let (mut s, mut all) = (0, Vec::new());
        for &n in &steps {
            all.extend(out(b, &b.causal_conv1d(&act(b, &[n, c], &x[s * c..(s + n) * c]), &wt, &mut state).unwrap()));
            s += n;
        }
        all.extend(out(b, &state));
        all
    });
    // A generic head layout and those of the qwen35moe fixtures; 70 tokens span two chunks of
    // vt-cpu's chunked form.
    for (kh, vh, dk, dv) in [(2, 4, 32, 48), (2, 4, 24, 20), (2, 6, 20, 28)] {
        let steps = [70usize, 1, 1, 3];
        let total: usize = steps.iter().sum();
        let (q, k, v) = (r.vec(total * kh * dk, 1.0), r.vec(total * kh * dk, 1.0), r.vec(total * vh * dv, 1.0));
        let (a, bb) = (r.vec(total * vh, 2.0), r.vec(total * vh, 2.0));
        let (a_log, dt_bias) = (r.vec(vh, 1.0), r.vec(vh, 1.0));
        on_both!(gpu, &format!("gated_delta_rule [{kh}, {vh}, {dk}, {dv}]"), |b| {
            let mut state = b.zeros_f32(&[vh, dk, dv]).unwrap();
            let (al, dt) = (small(b, &a_log), small(b, &dt_bias));
            let (mut s, mut all) = (0, Vec::new());
            for &n in &steps {
                let qt = act(b, &[n, kh, dk], &q[s * kh * dk..(s + n) * kh * dk]);
                let kt = act(b, &[n, kh, dk], &k[s * kh * dk..(s + n) * kh * dk]);
                let vt = act(b, &[n, vh, dv], &v[s * vh * dv..(s + n) * vh * dv]);
                let at = act(b, &[n, vh], &a[s * vh..(s + n) * vh]);
                let btt = act(b, &[n, vh], &bb[s * vh..(s + n) * vh]);
                let inputs = GdnInputs { q: &qt, k: &kt, v: &vt, a: &at, b: &btt, a_log: &al, dt_bias: &dt };
                let mode = if n == 1 { GdnMode::Recurrent } else { GdnMode::Chunked };
                all.extend(out(b, &b.gated_delta_rule(&inputs, &mut state, mode).unwrap()));
                s += n;
            }
            all.extend(out(b, &state));
            all
        });
    }
}

#[test]
fn gated_delta_step_decode() {
    let gpu = &wgpu();
    let mut r = Rng(0x9d57);
    let (kh, vh, dk, taps, steps) = (2, 4, 32, 4, 5);
    let channels = (2 * kh + vh) * dk;
    let qkv = r.vec(steps * channels, 2.0);
    let (a, bb) = (r.vec(steps * vh, 2.0), r.vec(steps * vh, 2.0));
    let (a_log, dt_bias, conv) = (r.vec(vh, 1.0), r.vec(vh, 1.0), r.vec(channels * taps, 0.7));
    on_both!(gpu, "gated_delta_step", |b| {
        let mut state = b.zeros_f32(&[vh, dk, dk]).unwrap();
        let mut conv_state = b.zeros(&[channels, taps - 1]).unwrap();
        let (al, dt) = (small(b, &a_log), small(b, &dt_bias));
        let cw = b.upload(DType::BF16, &[channels, taps], &bf16_bytes(&conv)).unwrap();
        let mut all = Vec::new();
        for s in 0..steps {
            let x = act(b, &[1, channels], &qkv[s * channels..(s + 1) * channels]);
            let (at, btt) = (act(b, &[1, vh], &a[s * vh..(s + 1) * vh]), act(b, &[1, vh], &bb[s * vh..(s + 1) * vh]));
            let step = GdnStep {
                qkv: &x,
                conv: &cw,
                a: &at,
                b: &btt,
                a_log: &al,
                dt_bias: &dt,
                key_heads: kh,
                key_dim: dk,
                value_heads: vh,
                value_dim: dk,
            };
            let mut seq = [GdnState { conv: &mut conv_state, recurrent: &mut state }];
            all.extend(out(b, &b.gated_delta_step(&step, &mut seq).unwrap()));
        }
        all.extend(out(b, &state));
        all.extend(out(b, &conv_state));
        all
    });
}

#[test]
fn moe_every_router_and_expert_format() {
    let gpu = &wgpu();
    let mut r = Rng(0x30e);
    let (t, h, inter, n_exp) = (29, 64, 32, 8);
    let kinds = [
        RouterKind::Softmax { top_k: 2, renormalize: true },
        RouterKind::Softmax { top_k: 3, renormalize: false },
        RouterKind::Sigmoid { top_k: 2, softcap: Some(3.0), renormalize: true, routed_scaling: 2.5 },
    ];
    let x = r.vec(t * h, 2.0);
    let router_w = HostWeight::bf16(&mut r, n_exp, h);
    let bias = r.vec(n_exp, 0.1);
    let shared =
        [HostWeight::bf16(&mut r, inter, h), HostWeight::bf16(&mut r, inter, h), HostWeight::bf16(&mut r, h, inter)];
    let shared_gate = HostWeight::bf16(&mut r, 1, h);
    for format in ["bf16", "nvfp4", "fp8"] {
        let experts = host_experts(&mut r, format, n_exp, h, inter);
        for kind in &kinds {
            on_both!(gpu, &format!("moe {format} {kind:?}"), |b| {
                let moe = upload_experts(b, &experts, h, inter);
                let router = router(b, &router_w, kind, &bias);
                // Twice: the second call reads the resident expert table built by the first.
                let first = out(b, &b.moe(&act(b, &[t, h], &x), &router, &moe).unwrap());
                assert_eq!(first, out(b, &b.moe(&act(b, &[t, h], &x), &router, &moe).unwrap()));
                first
            });
        }
        on_both!(gpu, &format!("moe_block {format} with a gated shared expert"), |b| {
            let moe = upload_experts(b, &experts, h, inter);
            let router = router(b, &router_w, &kinds[0], &bias);
            let [g, u, d] = shared.each_ref().map(|w| Linear::new(b, w.upload(b)).unwrap());
            let gp = Linear::new(b, shared_gate.upload(b)).unwrap();
            let se = SharedExpert { gate: &g, up: &u, down: &d, gate_proj: Some(&gp) };
            out(b, &b.moe_block(&act(b, &[t, h], &x), &router, &moe, Some(&se)).unwrap())
        });
    }
}

#[test]
fn every_routing_ranks_a_nan_choice_last() {
    // Expert 0's router row is NaN: vt-cpu ranks its choice after every number.
    let gpu = &wgpu();
    let mut r = Rng(0x7a7);
    let (h, inter) = (64, 32);
    let kind = RouterKind::Sigmoid { top_k: 3, softcap: None, renormalize: true, routed_scaling: 1.0 };
    for (t, n_exp) in [(1, 8), (5, 12)] {
        let x = r.vec(t * h, 2.0);
        let mut router_w = HostWeight::bf16(&mut r, n_exp, h);
        if let HostWeight::Bf16 { v, .. } = &mut router_w {
            v[..h].fill(f32::NAN);
        }
        let experts = host_experts(&mut r, "bf16", n_exp, h, inter);
        on_both!(gpu, &format!("moe with a NaN router row, t={t}, {n_exp} experts"), |b| {
            let moe = upload_experts(b, &experts, h, inter);
            let router = Router {
                weight: Linear::new(b, router_w.upload(b)).unwrap(),
                kind: kind.clone(),
                correction_bias: None,
            };
            out(b, &b.moe(&act(b, &[t, h], &x), &router, &moe).unwrap())
        });
    }
}

#[test]
fn random_fill_and_read_back_every_dtype() {
    let gpu = &wgpu();
    for (dtype, scale) in [(DType::F32, 0.5), (DType::BF16, 3.0), (DType::F8E4M3, 1.0)] {
        on_both!(gpu, &format!("random {dtype}"), |b| { out(b, &b.random(dtype, &[37, 129], 42, scale).unwrap()) });
    }
}
