//! The lifetime invariant on the device (docs/lifetime.md): vt-test-support's `lifetime::checks`
//! bodies, as vt-models' tests/lifetime.rs runs them on the CPU, on a CUDA placement arena. Engines
//! built in memory that dropped engines used compute exactly what they compute alone, concurrent
//! engines on one backend do too, and dropping an engine gives all its memory back — by vt's
//! accounting and, here also, by `cuMemGetInfo`.
//!
//! Run single-threaded (`--test-threads=1`): `cuMemGetInfo` is device-wide. The mutation arm
//! builds this file with `mutation-address-keyed-cache` and requires the sequential and cycle
//! tests to fail.
#![cfg(feature = "cuda")]

use vt_core::backend::prelude::*;
use vt_cuda::{AllocMode, CudaBackend};
use vt_models::Model;
use vt_test_support::lifetime::{assert_bit_identical, checks, moe_pairs, run};

fn arena() -> CudaBackend {
    CudaBackend::with_mode(AllocMode::PlacementArena).expect("CUDA backend")
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
fn sharing_cycles_give_all_memory_back() {
    for pair in moe_pairs() {
        checks::sharing_cycles(&arena(), &pair, 10);
    }
}

/// Device bytes in use as the driver sees them, after the stream has drained.
fn device_used(b: &CudaBackend) -> usize {
    b.synchronize().unwrap();
    let (free, total) = b.device_memory().unwrap();
    total - free
}

/// 50 build/run/drop cycles (A and B alternately) next to a long-lived engine, in both allocator
/// modes: vt's accounting ends exactly at the baseline (arena: the peak reached in the first two
/// cycles), the driver's figure ends at its baseline (system allocator: freed memory goes back to
/// the driver), and the long-lived engine computes what it did before.
#[test]
fn build_run_drop_cycles_give_all_memory_back() {
    const CYCLES: usize = 50;
    const STEPS: usize = 2;
    for pair in moe_pairs() {
        let prompt = &pair.prompt[..8];
        for mode in [AllocMode::PlacementArena, AllocMode::System] {
            let b = CudaBackend::with_mode(mode).unwrap();
            let resident = Model::load(&b, &pair.a).unwrap();
            let resident_run = run(&resident, prompt, STEPS);
            let (baseline, dev_baseline) = (b.memory(), device_used(&b));
            let mut peak_after_warmup = 0;
            for cycle in 0..CYCLES {
                run(&Model::load(&b, pair.dirs()[cycle % 2]).unwrap(), prompt, STEPS);
                if cycle == 1 {
                    peak_after_warmup = b.memory().peak_bytes;
                }
            }
            let (end, dev_end) = (b.memory(), device_used(&b));
            println!(
                "{} {mode:?}: {CYCLES} cycles: vt baseline {} bytes / {} blocks, final {} bytes / {} blocks, peak {}; cuMemGetInfo used baseline {} MiB, final {} MiB (delta {} bytes)",
                pair.name,
                baseline.bytes_live,
                baseline.blocks_live,
                end.bytes_live,
                end.blocks_live,
                end.peak_bytes,
                dev_baseline >> 20,
                dev_end >> 20,
                dev_end as i64 - dev_baseline as i64
            );
            assert_eq!(
                (end.bytes_live, end.blocks_live),
                (baseline.bytes_live, baseline.blocks_live),
                "{} {mode:?}: live memory differs from the baseline",
                pair.name
            );
            assert_eq!(end.peak_bytes, peak_after_warmup, "{} {mode:?}: peak memory grew over the cycles", pair.name);
            assert_eq!(dev_end, dev_baseline, "{} {mode:?}: device memory in use differs from the baseline", pair.name);
            assert_bit_identical(
                &format!("{} long-lived engine", pair.name),
                &run(&resident, prompt, STEPS),
                &resident_run,
            );
        }
    }
}

/// Whole backends come and go: 50 create/load/run/drop cycles end with the driver's figure back
/// at the first cycle's baseline (the CUDA context itself stays: its fixed overhead is the baseline).
#[test]
fn backends_come_and_go() {
    const CYCLES: usize = 50;
    let pair = &moe_pairs()[0];
    let prompt = &pair.prompt[..8];
    let probe = CudaBackend::new().unwrap();
    let mut used = Vec::new();
    for cycle in 0..CYCLES {
        let b =
            CudaBackend::with_mode(if cycle % 2 == 0 { AllocMode::System } else { AllocMode::PlacementArena }).unwrap();
        run(&Model::load(&b, pair.dirs()[cycle % 2]).unwrap(), prompt, 2);
        drop(b);
        used.push(device_used(&probe));
    }
    println!(
        "{}: {CYCLES} backend cycles: cuMemGetInfo used after cycle 1 {} bytes, after cycle {CYCLES} {} bytes",
        pair.name,
        used[0],
        used[CYCLES - 1]
    );
    assert_eq!(used[CYCLES - 1], used[1], "device memory in use grew over backend cycles");
}
