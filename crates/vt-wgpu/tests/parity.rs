//! vt-wgpu (f32 activations) against transformers f32 on every committed fixture, under the same
//! rule as the CPU reference (vt-test-support's `parity` bodies): logits of one full forward,
//! prefill-then-decode, greedy continuations, split prefills and mixed batches.

use vt_test_support::parity;
use vt_wgpu::WgpuBackend;

fn wgpu() -> WgpuBackend {
    WgpuBackend::new().expect("a wgpu adapter (lavapipe: Debian's mesa-vulkan-drivers)")
}

#[test]
fn full_forward_matches_reference() {
    parity::full_forward_matches_reference(&wgpu());
}

#[test]
fn prefill_then_decode_matches_reference() {
    parity::prefill_then_decode_matches_reference(&wgpu());
}

#[test]
fn greedy_generation_matches_reference() {
    parity::greedy_generation_matches_reference(&wgpu());
}

#[test]
fn split_prefill_matches_single_prefill() {
    parity::split_prefill_matches_single_prefill(&wgpu());
}

#[test]
fn mixed_batch_of_prompt_chunks_and_single_tokens_matches_reference() {
    parity::mixed_batch_of_prompt_chunks_and_single_tokens_matches_reference(&wgpu());
}
