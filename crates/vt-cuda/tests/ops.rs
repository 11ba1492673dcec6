//! Every op of vt-cuda against vt-cpu: the bodies of `vt_test_support::ops::suite` (which
//! vt-wgpu runs too), and the tests of what only this backend has (its grouped MoE prefill's
//! resident tables, the NVFP4 tensor-core GEMM and the memory its weights hold).
//!
//! Bound: CUDA rounds each op's output to bf16 once (relative error <= u/2, u = 2^-8) and
//! accumulates in f32, so the unit is `u`; ops that round an intermediate to bf16 on the way take
//! a multiple, said where it is used. A summary line per op prints the worst error found
//! (`--nocapture`).
#![cfg(feature = "cuda")]

use vt_core::backend::prelude::*;
use vt_core::{AttentionParams, KvLayout, KvSeq, Linear, Rope, Router, RouterKind};
use vt_cpu::CpuBackend;
use vt_cuda::CudaBackend;
use vt_test_support::on_both;
use vt_test_support::ops::*;

/// bf16 unit roundoff.
const U: f32 = 1.0 / 256.0;

/// One backend per test: a backend compiles every kernel file when it starts.
fn cuda() -> OnDevice<CudaBackend> {
    OnDevice {
        backend: CudaBackend::new().expect("CUDA backend"),
        name: "cuda",
        u: U,
        // The tensor-core attention kernels round the probabilities to bf16 for P V.
        rounded_probabilities: &[64, 128, 256],
    }
}

vt_test_support::op_tests!(cuda() =>
    elementwise_and_norm_ops,
    embedding_and_lm_head_of_a_large_vocabulary,
    add_rms_norm_fused,
    linear_every_weight_format,
    linear_decode_gemv_few_tokens,
    linear_many_shares_one_pass_over_the_input,
    attention_full_and_windowed_across_calls,
    attention_flash_prefill,
    attention_decode_batched_sequences,
    attention_decode_long_cache,
    attention_continues_over_a_copied_block,
    attention_decode_continues_rows,
    conv_and_gated_delta_rule_across_calls,
    gated_delta_rule_chunked_prefill,
    gated_delta_rule_long_at_model_heads,
    gated_delta_step_decode,
    gated_delta_step_batched_sequences,
    gated_delta_waves_equal_their_steps,
    moe_every_router_and_expert_format,
    moe_block_decode_every_router_format_and_shared_expert,
    every_routing_ranks_a_nan_choice_last,
    random_fill_matches_the_host_definition,
    argmax_rows_on_the_device_is_the_greedy_rule,
    top_logprobs_on_the_device_match_the_reference,
    sample_rows_on_the_device_draw_as_the_reference,
);

#[test]
fn moe_grouped_prefill() {
    let dev = &cuda();
    let mut r = Rng(0x9a0e);
    let kinds = [
        RouterKind::Softmax { top_k: 4, renormalize: true },
        RouterKind::Sigmoid { top_k: 3, softcap: Some(3.0), renormalize: false, routed_scaling: 2.5 },
    ];
    // 16 experts: several row tiles each (64 slots for bf16, 128 for NVFP4: 130-175 slots an
    // expert) with short last tiles. 136 experts: the routing plan's scan spans several warps, and
    // most experts get one short tile, some none. Hidden and intermediate are not multiples of the
    // 64-input K steps or the 128-row N tiles, so every tail is exercised (NVFP4 needs multiples
    // of 16).
    for (t, n_exp) in [(700, 16), (300, 136)] {
        for (format, h, inter) in [("bf16", 200, 72), ("nvfp4", 208, 80)] {
            let x = r.vec(t * h, 2.0);
            let router_w = HostWeight::bf16(&mut r, n_exp, h);
            let bias = r.vec(n_exp, 0.1);
            let experts = host_experts(&mut r, format, n_exp, h, inter);
            for kind in &kinds {
                // 2u: three bf16 roundings of u/2 on the way, of the SwiGLU activations for the
                // down GEMM, of each expert's output before the weighted sum, and of the sum. NVFP4
                // weights enter the tensor cores exactly (kernels/w4a16.cu), so the bf16 analysis
                // holds for both.
                on_both!(dev, &format!("moe grouped prefill {format} {n_exp} experts {kind:?}"), 2.0 * U, |b| {
                    let moe = upload_experts(b, &experts, h, inter);
                    let router = router(b, &router_w, kind, &bias);
                    let first = out(b, &b.moe(&act(b, &[t, h], &x), &router, &moe).unwrap());
                    assert_eq!(first, out(b, &b.moe(&act(b, &[t, h], &x), &router, &moe).unwrap()));
                    first
                });
            }
            // A first prefill leaves exactly the layer's resident table: descriptors of every
            // expert's gate, up and down (the kernels read the weights in place, NVFP4 ones in the
            // tiled layout they were given at load: no copy is kept). Measured on a second layer,
            // after the first has set up what the backend keeps for itself.
            let b = &cuda().backend;
            let router = Router {
                weight: Linear::new(b, router_w.upload(b)).unwrap(),
                kind: kinds[0].clone(),
                correction_bias: None,
            };
            let xg = act(b, &[t, h], &x);
            drop(b.moe(&xg, &router, &upload_experts(b, &experts, h, inter)).unwrap());
            let moe = upload_experts(b, &experts, h, inter);
            let before = b.memory().bytes_live;
            drop(b.moe(&xg, &router, &moe).unwrap());
            // A descriptor is a kernels/common.cuh `WeightDesc`: 32 bytes.
            let want = (3 * n_exp * 32).next_multiple_of(256);
            assert_eq!(
                b.memory().bytes_live - before,
                want,
                "{format}, {n_exp} experts: bytes kept after the first prefill"
            );
        }
    }
}

/// `W` of an NVFP4 weight as f32, as vt-cpu decodes it (`e2m1 * (scale * global)`).
fn nvfp4_values(hw: &HostWeight) -> Vec<f32> {
    let HostWeight::Nvfp4 { n, k, codes, scales, global } = hw else { panic!("not an NVFP4 weight") };
    (0..n * k)
        .map(|i| {
            let code = if i % 2 == 0 { codes[i / 2] & 15 } else { codes[i / 2] >> 4 };
            vt_core::dtype::e2m1_to_f32(code) * (vt_core::dtype::f8e4m3_to_f32(scales[i / 16]) * global)
        })
        .collect()
}

/// Issue 31: an NVFP4 weight's only device form is the kernels' tiled layout, built at load in
/// place of the checkpoint's bytes. Whole 16 x 64 tiles take exactly the checkpoint's bytes (codes
/// n k / 2, scales n k / 16; the allocator's 256-byte granule aside), partial ones their zero
/// padding; decode, prefill and MoE calls keep nothing beside them but the MoE expert table's
/// descriptors; and everything goes back when the weights are dropped.
#[test]
fn nvfp4_weights_keep_only_their_tiled_form_on_the_device() {
    let b = &cuda().backend;
    let mut r = Rng(0x31);
    let granule = |bytes: usize| bytes.next_multiple_of(256);
    let (h, inter, n_exp) = (256, 128, 8);
    let router_w = HostWeight::bf16(&mut r, n_exp, h);
    let kind = RouterKind::Softmax { top_k: 2, renormalize: true };
    let moe_call = |moe: &vt_core::MoeExperts<CudaBackend>, rt: &Router<CudaBackend>, x: &[f32]| {
        let t = x.len() / h;
        let xt = act(b, &[t, h], x);
        drop(if t <= 16 { b.moe_block(&xt, rt, moe, None) } else { b.moe(&xt, rt, moe) }.unwrap());
    };
    // What the backend keeps for itself (cuBLASLt's workspace, ...) is set up before measuring.
    {
        let warm = Linear::new(b, HostWeight::nvfp4(&mut r, 32, 64).upload(b)).unwrap();
        for t in [1, 200] {
            drop(b.linear(&act(b, &[t, 64], &r.vec(t * 64, 1.0)), &warm).unwrap());
        }
        let (moe, rt) = (
            upload_experts(b, &host_experts(&mut r, "nvfp4", n_exp, h, inter), h, inter),
            router(b, &router_w, &kind, &[]),
        );
        for t in [1, 200] {
            moe_call(&moe, &rt, &r.vec(t * h, 1.0));
        }
    }
    b.synchronize().unwrap();
    let base = b.memory().bytes_live;
    for (n, k, tiles) in [(256, 2048, 16 * 32), (300, 208, 19 * 4)] {
        let lin = Linear::new(b, HostWeight::nvfp4(&mut r, n, k).upload(b)).unwrap();
        b.synchronize().unwrap();
        let held = b.memory().bytes_live - base;
        assert_eq!(held, granule(tiles * 512) + granule(tiles * 64), "[{n}, {k}] on the device");
        if n % 16 == 0 && k % 64 == 0 {
            assert_eq!(held, n * k / 2 + n * k / 16, "[{n}, {k}]: the checkpoint's bytes");
        }
        for t in [1, 4, 16, 300] {
            let y = b.linear(&act(b, &[t, k], &r.vec(t * k, 1.0)), &lin).unwrap();
            drop(y);
            b.synchronize().unwrap();
            assert_eq!(b.memory().bytes_live - base, held, "[{n}, {k}] after a linear of {t} tokens");
        }
        assert!(lin.resident.is_empty());
        drop(lin);
        b.synchronize().unwrap();
        assert_eq!(b.memory().bytes_live, base, "[{n}, {k}] dropped");
    }
    let experts = host_experts(&mut r, "nvfp4", n_exp, h, inter);
    let rt = router(b, &router_w, &kind, &[]);
    let moe = upload_experts(b, &experts, h, inter);
    b.synchronize().unwrap();
    let held = b.memory().bytes_live - base;
    assert_eq!(held - granule(n_exp * h * 2), 3 * n_exp * (inter * h / 2 + inter * h / 16), "experts on the device");
    for t in [1, 3, 200] {
        moe_call(&moe, &rt, &r.vec(t * h, 1.0));
        b.synchronize().unwrap();
        assert_eq!(b.memory().bytes_live - base, held + granule(3 * n_exp * 32), "MoE of {t} tokens: the table only");
    }
    drop((moe, rt));
    b.synchronize().unwrap();
    assert_eq!(b.memory().bytes_live, base, "experts dropped");
}

/// NVFP4 linear past the GEMV's 16 tokens (9 and 11: the GEMV): the tensor-core kernel
/// (kernels/w4a16.cu). Tokens in one, several and a partial 128-row tile; weight rows and inputs not multiples of the 128 x 64
/// weight tiles; a single row; scales over the whole fp8 range (subnormal and negative included).
///
/// Bound, from the arithmetic: the GPU's bf16 weight e2m1 x e4m3 is exact (2 x 4 significant bits
/// fit bf16's 8, and bf16 has f32's exponent range); products of bf16 are exact in f32; the sums
/// over k err by at most k ulps of f32 (2^-23 each, loosely covering the tensor cores' truncating
/// adds) relative to S = sum_j |x_j w_j|; the global multiplier is one more f32 rounding, and the
/// output's rounding to bf16 (7 stored bits) at most 2^-8 |y|. The CPU rounds scale * global and
/// its product with e2m1 (2^-23 |w| together) and sums in f32 (k ulps). So
/// |gpu - cpu| <= 2^-8 |y| + (2k + 2) 2^-23 S, taken with the largest S over the outputs.
#[test]
fn linear_nvfp4_prefill_tensor_cores() {
    let dev = &cuda().backend;
    let mut r = Rng(0x4a16);
    let full_range = |r: &mut Rng, n: usize, k: usize| {
        // Any fp8 scale but NaN (S.1111.111).
        let scales = r.bytes(n * k / 16).into_iter().map(|b| if b & 0x7f == 0x7f { b ^ 1 } else { b }).collect();
        HostWeight::Nvfp4 { n, k, codes: r.bytes(n * k / 2), scales, global: 1.7e-3 }
    };
    let cases = [
        (HostWeight::nvfp4(&mut r, 300, 208), [9, 128, 300]),
        (HostWeight::nvfp4(&mut r, 256, 2048), [130, 256, 17]),
        (HostWeight::nvfp4(&mut r, 1, 48), [40, 129, 9]),
        (full_range(&mut r, 136, 336), [64, 200, 11]),
    ];
    for (hw, ts) in &cases {
        let HostWeight::Nvfp4 { n, k, .. } = *hw else { unreachable!() };
        let w = nvfp4_values(hw);
        for &t in ts {
            let x = r.vec(t * k, 2.0);
            let cpu = {
                let b = &CpuBackend::new();
                out(b, &b.linear(&act(b, &[t, k], &x), &Linear::new(b, hw.upload(b)).unwrap()).unwrap())
            };
            let b = dev;
            let lin = Linear::new(b, hw.upload(b)).unwrap();
            let xg = act(b, &[t, k], &x);
            let gpu = out(b, &b.linear(&xg, &lin).unwrap());
            assert!(lin.resident.is_empty(), "the kernel reads the weight's own (tiled) storage, no copy");
            assert_eq!(gpu, out(b, &b.linear(&xg, &lin).unwrap()), "second call");
            let s = (0..t)
                .flat_map(|i| {
                    let (x, w) = (&x, &w);
                    (0..n).map(move |o| (0..k).map(|j| (x[i * k + j] * w[o * k + j]).abs()).sum::<f32>())
                })
                .fold(0.0f32, f32::max);
            let scale = cpu.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
            let bound = U + (2 * k + 2) as f32 * 2f32.powi(-23) * s / scale;
            report("cuda", &format!("linear nvfp4 tensor cores [{n}, {k}] t={t}"), bound, &gpu, &cpu);
        }
    }
}

/// `attention_decode` writes every row into the pool, so two rows that would write one place (a
/// block two tables name, at one position) are refused, naming it, where the kernels would race;
/// one sequence's consecutive positions (a verification's rows) are taken.
#[test]
fn attention_decode_refuses_two_rows_writing_one_place() {
    let b = &cuda().backend;
    let (hq, hkv, d) = (8, 2, 128);
    let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: hkv, head_dim: d, blocks: 4 }]).unwrap();
    let rope = Rope { inv_freq: vec![1.0; d / 2], attention_scaling: 1.0 };
    let params = AttentionParams { scale: 0.1, window: None };
    let rows = |heads: usize| act(b, &[2, heads, d], &Rng(7).vec(2 * heads * d, 1.0));
    // Two sequences whose tables name block 2, both at position 5; then one sequence at 0 and 1.
    let (a, other) = ([2u32], [2u32]);
    let twice = [KvSeq { layer: 0, table: &a, start: 5 }, KvSeq { layer: 0, table: &other, start: 5 }];
    let err = b.attention_decode(&rows(hq), &rows(hkv), &rows(hkv), &rope, &mut pool, &twice, &params);
    let err = err.expect_err("two rows writing position 5 of block 2").to_string();
    assert!(err.contains("two rows write position 5 of block 2"), "{err}");
    let verify = [KvSeq { layer: 0, table: &a, start: 0 }, KvSeq { layer: 0, table: &a, start: 1 }];
    let ok = b.attention_decode(&rows(hq), &rows(hkv), &rows(hkv), &rope, &mut pool, &verify, &params);
    assert_eq!(ok.unwrap().shape(), [2, hq, d]);
}
