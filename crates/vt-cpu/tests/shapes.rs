//! Ops given tensors whose shapes disagree return an error naming the shapes; they never panic.

use vt_core::backend::prelude::*;
use vt_core::{
    AttentionParams, DType, Expert, Fp8Block, GateAct, GdnInputs, GdnMode, KvLayout, KvSeq, Linear, MoeExperts,
    NormKind, Nvfp4, Rope, Router, RouterKind, Weight,
};
use vt_cpu::CpuBackend;

fn zeros(b: &CpuBackend, shape: &[usize]) -> vt_core::Tensor<CpuBackend> {
    b.from_f32(shape, &vec![0.5; shape.iter().product()]).unwrap()
}

#[test]
fn gated_delta_rule_rejects_mismatched_inputs() {
    let b = CpuBackend::new();
    let (q, k, v) = (zeros(&b, &[3, 2, 4]), zeros(&b, &[3, 2, 4]), zeros(&b, &[3, 4, 5]));
    let (a, a_log, dt) = (zeros(&b, &[3, 4]), zeros(&b, &[4]), zeros(&b, &[4]));
    let bad_b = zeros(&b, &[3, 3]);
    let mut state = b.zeros_f32(&[4, 4, 5]).unwrap();
    let inputs = GdnInputs { q: &q, k: &k, v: &v, a: &a, b: &bad_b, a_log: &a_log, dt_bias: &dt };
    let err = b.gated_delta_rule(&inputs, &mut state, GdnMode::Chunked).unwrap_err().to_string();
    assert!(err.contains("gated_delta_rule") && err.contains("[3, 3]"), "{err}");
    // The same inputs with a state of the wrong shape.
    let good = GdnInputs { b: &a, ..inputs };
    let mut wrong_state = b.zeros_f32(&[4, 5, 4]).unwrap();
    let err = b.gated_delta_rule(&good, &mut wrong_state, GdnMode::Recurrent).unwrap_err().to_string();
    assert!(err.contains("state F32 [4, 5, 4]"), "{err}");
    assert!(b.gated_delta_rule(&good, &mut state, GdnMode::Recurrent).is_ok());
}

#[test]
fn attention_linear_and_norm_reject_mismatched_inputs() {
    let b = CpuBackend::new();
    let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: 2, head_dim: 8, blocks: 1 }]).unwrap();
    let params = AttentionParams { scale: 1.0, window: None };
    let seq = KvSeq { layer: 0, table: &[0], start: 0 };
    // Three query heads cannot share two key/value heads.
    let err =
        b.attention(&zeros(&b, &[1, 3, 8]), &zeros(&b, &[1, 2, 8]), &zeros(&b, &[1, 2, 8]), &mut pool, seq, &params);
    assert!(err.unwrap_err().to_string().contains("[1, 3, 8]"));
    // Keys of another shape than the pool layer's.
    let err =
        b.attention(&zeros(&b, &[1, 4, 4]), &zeros(&b, &[1, 2, 4]), &zeros(&b, &[1, 2, 4]), &mut pool, seq, &params);
    assert!(err.unwrap_err().to_string().contains("pool layer of 2 kv heads x 8"));
    let w = Linear::new(&b, Weight::Dense(zeros(&b, &[6, 5]))).unwrap();
    let err = b.linear(&zeros(&b, &[2, 4]), &w).unwrap_err().to_string();
    assert!(err.contains("[2, 4]") && err.contains("[6, 5]"), "{err}");
    let err = b.rms_norm(&zeros(&b, &[2, 4]), &zeros(&b, &[5]), 1e-6, NormKind::Plain).unwrap_err().to_string();
    assert!(err.contains("rms_norm"), "{err}");
}

#[test]
fn linear_refuses_malformed_nvfp4_weights() {
    let b = CpuBackend::new();
    let nvfp4 = |k: usize, scale_cols: usize, global: f32| {
        let codes = b.upload(DType::F4x2, &[2, k], &vec![0x11; k]).unwrap();
        let scales = b.upload(DType::F8E4M3, &[2, scale_cols], &vec![0x38; 2 * scale_cols]).unwrap();
        Weight::Nvfp4(Nvfp4 { codes, scales, global_scale: global })
    };
    // Kernels read a row's scales as k / 16 whole groups: a partial group, a scale table of the
    // wrong width or a non-finite global multiplier is refused before any op sees the weight.
    for (k, cols, global, want) in
        [(72, 4, 1.0, "72 is not a multiple of 16"), (64, 3, 1.0, "[2, 3]"), (64, 4, f32::NAN, "NaN")]
    {
        let err = Linear::new(&b, nvfp4(k, cols, global)).err().expect("malformed NVFP4 refused").to_string();
        assert!(err.contains(want), "{err}");
    }
    assert!(Linear::new(&b, nvfp4(64, 4, 1.0)).is_ok());
}

#[test]
fn linear_refuses_malformed_fp8_weights() {
    let b = CpuBackend::new();
    let (n, k) = (40, 72);
    let fp8 = |block: [usize; 2], scales: [usize; 2], dtype: DType| {
        let values = b.upload(DType::F8E4M3, &[n, k], &vec![0x38; n * k]).unwrap();
        let bytes = vec![0; dtype.bytes_for(scales[0] * scales[1]).unwrap()];
        Weight::Fp8(Fp8Block { values, scales: b.upload(dtype, &scales, &bytes).unwrap(), block })
    };
    // Kernels index scales by (row / bn, input / bk) over ceil(n / bn) x ceil(k / bk) blocks: a
    // table without the partial blocks, one of another dtype, or a zero block side is refused
    // before any op sees the weight.
    for (block, scales, dtype, want) in [
        ([32, 32], [1, 2], DType::F32, "[2, 3]"),
        ([32, 32], [2, 3], DType::BF16, "BF16"),
        ([0, 32], [1, 3], DType::F32, "zero side"),
    ] {
        let err = Linear::new(&b, fp8(block, scales, dtype)).err().expect("malformed FP8 refused").to_string();
        assert!(err.contains(want), "{err}");
    }
    // Every value 1.0 (e4m3 0x38); block scales 1, 2, 4 for rows 0..32 and 8, 16, 32 for the
    // partial block of rows 32..40, over inputs in blocks of 32, 32 and a partial 8. With inputs
    // 0.5: 0.5 * (32 * 1 + 32 * 2 + 8 * 4) = 64 and 0.5 * (32 * 8 + 32 * 16 + 8 * 32) = 512, exact.
    let scales: Vec<u8> = [1.0f32, 2.0, 4.0, 8.0, 16.0, 32.0].iter().flat_map(|s| s.to_le_bytes()).collect();
    let values = b.upload(DType::F8E4M3, &[n, k], &vec![0x38; n * k]).unwrap();
    let scales = b.upload(DType::F32, &[2, 3], &scales).unwrap();
    let w = Linear::new(&b, Weight::Fp8(Fp8Block { values, scales, block: [32, 32] })).unwrap();
    let y = b.to_f32(&b.linear(&zeros(&b, &[3, k]), &w).unwrap()).unwrap();
    let row: Vec<f32> = (0..n).map(|r| if r < 32 { 64.0 } else { 512.0 }).collect();
    assert_eq!(y, row.repeat(3));
}

/// Each op's shared argument check (vt_core::backend::check) refuses what the trait's contract
/// rules out, naming the op and what it was given.
#[test]
fn ops_refuse_arguments_outside_their_contract() {
    let b = CpuBackend::new();
    let x = zeros(&b, &[2, 6]);
    let expect = |r: vt_core::Result<vt_core::Tensor<CpuBackend>>, want: &[&str]| {
        let err = r.expect_err("refused").to_string();
        assert!(want.iter().all(|w| err.contains(w)), "{err} lacks {want:?}");
    };
    expect(b.gate(&x, &zeros(&b, &[2, 4]), GateAct::Sigmoid), &["gate", "[2, 4]", "[2, 6]"]);
    expect(b.narrow_cols(&x, 4, 3), &["narrow_cols", "columns 4..7", "[2, 6]"]);
    expect(b.narrow_cols(&x, usize::MAX, 2), &["narrow_cols", "[2, 6]"]);
    expect(b.slice_rows(&x, 1, 2), &["slice_rows", "rows 1..3", "[2, 6]"]);
    expect(b.concat_rows(&[&x, &zeros(&b, &[1, 5])]), &["concat_rows", "width 5 differs from 6"]);
    expect(b.add(&x, &zeros(&b, &[6, 2])), &["add", "[2, 6] vs [6, 2]"]);
    expect(b.embedding(&x, &[1, 2]), &["embedding", "token id 2", "vocabulary of 2"]);
    expect(b.embedding(&zeros(&b, &[2, 3, 1]), &[0]), &["embedding", "2-D", "[2, 3, 1]"]);
    let rope = Rope { inv_freq: vec![1.0; 4], attention_scaling: 1.0 };
    expect(b.rope(&zeros(&b, &[1, 2, 6]), 0, &rope), &["rope", "rotary dim 8", "head dim 6"]);
    expect(b.rope(&x, 0, &rope), &["rope", "[2, 6]"]);
    // The convolution state must be in the activation dtype (f32 here), not merely of its shape.
    let w = zeros(&b, &[6, 4]);
    let mut bf16_state = b.upload(DType::BF16, &[6, 3], &[0; 36]).unwrap();
    expect(b.causal_conv1d(&x, &w, &mut bf16_state), &["causal_conv1d", "BF16 [6, 3]"]);
    let mut state = b.zeros(&[6, 2]).unwrap();
    expect(b.causal_conv1d(&x, &w, &mut state), &["causal_conv1d", "weight [6, 4]", "[6, 2]"]);
}

/// An MoE layer whose router disagrees with its experts is refused before anything runs.
#[test]
fn moe_refuses_a_router_that_does_not_fit_its_experts() {
    let b = CpuBackend::new();
    let dense = |shape: &[usize]| Weight::Dense(zeros(&b, shape));
    let experts =
        (0..4).map(|_| Expert { gate: dense(&[3, 8]), up: dense(&[3, 8]), down: dense(&[8, 3]) }).collect::<Vec<_>>();
    let experts = MoeExperts::new(&b, "experts", experts, 8, 3).unwrap();
    let router = |rows: usize, kind: RouterKind, bias: Option<usize>| Router {
        weight: Linear::new(&b, dense(&[rows, 8])).unwrap(),
        kind,
        correction_bias: bias.map(|n| zeros(&b, &[n])),
    };
    let sigmoid = |top_k, softcap| RouterKind::Sigmoid { top_k, softcap, renormalize: true, routed_scaling: 1.0 };
    let x = zeros(&b, &[2, 8]);
    for (r, want) in [
        (router(5, sigmoid(2, None), None), &["moe", "router [5, 8]", "4 experts of hidden 8"][..]),
        (router(4, sigmoid(5, None), None), &["moe", "top-k 5 with 4 experts"]),
        (router(4, sigmoid(2, Some(-1.0)), None), &["moe", "softcap -1"]),
        (router(4, sigmoid(2, Some(f32::NAN)), None), &["moe", "softcap NaN"]),
        (router(4, sigmoid(2, None), Some(3)), &["moe", "correction bias F32 [3] for 4 experts"]),
    ] {
        let err = b.moe(&x, &r, &experts).expect_err("refused").to_string();
        assert!(want.iter().all(|w| err.contains(w)), "{err} lacks {want:?}");
    }
    assert!(b.moe(&x, &router(4, sigmoid(2, Some(30.0)), Some(4)), &experts).is_ok());
}

#[test]
fn copy_into_copies_in_place_and_rejects_other_shapes() {
    let b = CpuBackend::new();
    let src = b.from_f32(&[2, 3], &[1.0, -2.0, 3.5, 0.25, f32::MIN_POSITIVE, 7.0]).unwrap();
    let mut dst = b.zeros(&[2, 3]).unwrap();
    let at = b.buffer_addr(dst.buffer());
    b.copy_into(&src, &mut dst).unwrap();
    assert_eq!(b.to_f32(&dst).unwrap(), b.to_f32(&src).unwrap());
    assert_eq!(b.buffer_addr(dst.buffer()), at, "the copy lands where the destination was");
    let mut other = b.zeros(&[3, 2]).unwrap();
    let err = b.copy_into(&src, &mut other).unwrap_err().to_string();
    assert!(err.contains("copy_into") && err.contains("[2, 3]") && err.contains("[3, 2]"), "{err}");
}
