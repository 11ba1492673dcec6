//! Ops given tensors whose shapes disagree return an error naming the shapes; they never panic.

use vt_core::backend::prelude::*;
use vt_core::{AttentionParams, DType, Fp8Block, GdnInputs, GdnMode, Linear, NormKind, Nvfp4, Weight};
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
    let mut cache = b.new_kv_cache(2, 8, None).unwrap();
    let params = AttentionParams { scale: 1.0, window: None };
    // Three query heads cannot share two key/value heads.
    let err = b.attention(&zeros(&b, &[1, 3, 8]), &zeros(&b, &[1, 2, 8]), &zeros(&b, &[1, 2, 8]), &mut cache, &params);
    assert!(err.unwrap_err().to_string().contains("[1, 3, 8]"));
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
