//! Every op of vt-wgpu on whatever adapter there is (lavapipe in CI) against vt-cpu: the bodies
//! of `vt_test_support::ops::suite`, which vt-cuda runs too.
//!
//! Bound: both compute in f32 with f32 accumulation; they differ in summation order (parallel
//! reductions, fused multiply-adds the shader compiler may form) and in the device's exp/log. A
//! sum of n terms in another order moves by at most n * 2^-24 of the sum of magnitudes: the
//! longest sums here are a few thousand terms (attention over a cache, a GEMV row of 4096
//! inputs), under 3e-4 of the output's scale at worst and far less for random signs, and the
//! transcendentals add a few ulps: `u` = 1e-4 per op, a multiple where the suite composes ops.
//! The measured errors are printed (`--nocapture`).

use vt_test_support::ops::{suite, OnDevice};
use vt_wgpu::{AllocMode, Gpu, WgpuBackend};

fn wgpu() -> OnDevice<WgpuBackend> {
    on(WgpuBackend::new().expect("a wgpu adapter (lavapipe: Debian's mesa-vulkan-drivers)"))
}

fn on(backend: WgpuBackend) -> OnDevice<WgpuBackend> {
    OnDevice { backend, name: "wgpu", u: 1e-4, rounded_probabilities: &[] }
}

/// On an adapter whose storage bindings take 32 KiB, the MoE test's stacked bf16 gate/up experts
/// (8 of 8 KiB) do not fit one binding: they go in pieces, a dispatch each, with the same result.
#[test]
fn moe_experts_in_pieces_on_an_adapter_of_small_bindings() {
    let gpu = Gpu::with_limits(|l| wgpu::Limits { max_storage_buffer_binding_size: 32 << 10, ..l }).expect("adapter");
    suite::moe_every_router_and_expert_format(&on(WgpuBackend::on(&gpu, AllocMode::System)));
}

/// On an adapter whose storage bindings take 16 KiB, at offsets of 256 bytes (the most WebGPU
/// asks), a vocabulary of 1000 rows (a bf16 table of 125 KiB) goes in ranges of rows, a dispatch
/// each, with the same result.
#[test]
fn embedding_and_lm_head_in_pieces_on_an_adapter_of_small_bindings() {
    let gpu = Gpu::with_limits(|l| wgpu::Limits {
        max_storage_buffer_binding_size: 16 << 10,
        min_storage_buffer_offset_alignment: 256,
        ..l
    })
    .expect("adapter");
    suite::embedding_and_lm_head_of_a_large_vocabulary(&on(WgpuBackend::on(&gpu, AllocMode::System)));
}

/// An adapter that binds fewer storage buffers to a kernel than vt's need is refused when its
/// device is made, with the limit named, rather than failing at a kernel's first dispatch.
#[test]
fn an_adapter_too_small_for_the_kernels_is_refused_by_name() {
    let refused = Gpu::with_limits(|l| wgpu::Limits { max_storage_buffers_per_shader_stage: 4, ..l });
    let e = refused.err().expect("an adapter binding 4 storage buffers a kernel is refused").to_string();
    assert!(e.contains("max_storage_buffers_per_shader_stage >= ") && e.contains("is 4"), "{e}");
}

/// A linear of more inputs a row than one shader invocation may loop over is refused by name,
/// where lavapipe would end the loop early and return a wrong sum.
#[test]
fn a_linear_past_the_loop_budget_is_refused() {
    use vt_core::backend::prelude::*;
    let b = WgpuBackend::new().expect("a wgpu adapter");
    let k = 70_000;
    let x = b.from_f32(&[1, k], &vec![1.0; k]).unwrap();
    let w = vt_core::Linear::new(&b, vt_core::Weight::Dense(b.from_f32(&[1, k], &vec![1.0; k]).unwrap())).unwrap();
    let e = b.linear(&x, &w).expect_err("a linear of 70000 inputs a row is refused").to_string();
    assert!(e.contains("70000 inputs a row exceed"), "{e}");
}

// Not here: attention_flash_prefill and attention_decode_batched_sequences, whose shapes are
// vt-cuda's tiles and splits (vt-wgpu has one attention path, which the tests below take): 6 and
// 13 minutes on lavapipe on two cores, where they pass.
vt_test_support::op_tests!(wgpu() =>
    elementwise_and_norm_ops,
    embedding_and_lm_head_of_a_large_vocabulary,
    add_rms_norm_fused,
    linear_every_weight_format,
    linear_decode_gemv_few_tokens,
    linear_many_shares_one_pass_over_the_input,
    attention_full_and_windowed_across_calls,
    attention_continues_over_a_copied_block,
    attention_decode_continues_rows,
    attention_over_a_long_context,
    attention_decode_long_cache,
    moe_block_decode_every_router_format_and_shared_expert,
    conv_and_gated_delta_rule_across_calls,
    gated_delta_rule_chunked_prefill,
    gated_delta_rule_long_at_model_heads,
    gated_delta_step_decode,
    gated_delta_step_batched_sequences,
    gated_delta_waves_equal_their_steps,
    moe_every_router_and_expert_format,
    every_routing_ranks_a_nan_choice_last,
    random_fill_matches_the_host_definition,
    argmax_rows_on_the_device_is_the_greedy_rule,
    top_logprobs_on_the_device_match_the_reference,
    sample_rows_on_the_device_draw_as_the_reference,
);
