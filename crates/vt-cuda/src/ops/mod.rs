//! The ops, one module per family, each holding its kernels' launch code. Every op follows one
//! convention to choose a kernel:
//!
//! - A fast path is a pair: `fits(...)`, a pure function of the call's shapes and formats and the
//!   device's limits that says whether its kernels take the call (nothing allocated or queued,
//!   unit-testable without a GPU), and the function that launches them, which then never declines
//!   (it errs if called for a call `fits` refused).
//! - The op (its Backend method in backend.rs, or the family's op function it calls) asks its fast
//!   paths in order of preference and otherwise runs the general kernel, or vt-core's composed
//!   default, so which kernel runs is decided in one place.

pub(crate) mod argmax;
pub(crate) mod attention;
pub(crate) mod elementwise;
pub(crate) mod gdn;
pub(crate) mod linear;
pub(crate) mod logprobs;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod random;
pub(crate) mod rope;
pub(crate) mod sample;

/// `shape` with its last dimension `last`.
fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let Some(l) = s.last_mut() {
        *l = last;
    }
    s
}
