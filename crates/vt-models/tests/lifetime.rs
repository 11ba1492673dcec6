//! The lifetime invariant (docs/lifetime.md) on the CPU backend, on every fixture with MoE layers:
//! engines built in memory that dropped engines used compute exactly what they compute alone,
//! concurrent engines on one backend do too, and dropping an engine gives all its memory back.
//! The bodies are vt-test-support's `lifetime::checks`, shared with every backend.
//!
//! CI also runs this file with `vt-core/mutation-address-keyed-cache` (the original bug) and
//! requires all three tests to fail in their assertions.

use vt_cpu::{AllocMode, CpuBackend};
use vt_test_support::lifetime::{check_each, checks, moe_pairs};

fn arena() -> CpuBackend {
    CpuBackend::with_mode(AllocMode::PlacementArena)
}

#[test]
fn sequential_engines_in_reused_memory_compute_as_alone() {
    checks::sequential_engines(arena);
}

#[test]
fn concurrent_engines_on_one_backend_compute_as_alone() {
    checks::concurrent_engines(arena);
}

#[test]
fn build_run_drop_cycles_give_all_memory_back() {
    check_each(&moe_pairs(), |pair| checks::build_run_drop_cycles(&arena(), pair, 100));
}

#[test]
fn sharing_cycles_give_all_memory_back() {
    check_each(&moe_pairs(), |pair| checks::sharing_cycles(&arena(), pair, 20));
}
