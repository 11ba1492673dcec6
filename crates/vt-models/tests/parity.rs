//! CPU f32 against transformers f32 on every committed fixture: logits of one full forward,
//! prefill-then-decode logits, and greedy continuations (vt-test-support's `parity` bodies).

use vt_cpu::CpuBackend;
use vt_test_support::parity;

#[test]
fn full_forward_matches_reference() {
    parity::full_forward_matches_reference(&CpuBackend::new());
}

#[test]
fn prefill_then_decode_matches_reference() {
    parity::prefill_then_decode_matches_reference(&CpuBackend::new());
}

#[test]
fn greedy_generation_matches_reference() {
    parity::greedy_generation_matches_reference(&CpuBackend::new());
}

#[test]
fn split_prefill_matches_single_prefill() {
    parity::split_prefill_matches_single_prefill(&CpuBackend::new());
}

#[test]
fn mixed_batch_of_prompt_chunks_and_single_tokens_matches_reference() {
    parity::mixed_batch_of_prompt_chunks_and_single_tokens_matches_reference(&CpuBackend::new());
}
