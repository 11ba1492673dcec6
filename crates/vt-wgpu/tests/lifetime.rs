//! The lifetime invariant (docs/lifetime.md) on a wgpu placement arena: vt-test-support's
//! `lifetime::checks` bodies, as vt-models' tests/lifetime.rs runs them on the CPU. Engines built
//! in buffers that dropped engines used compute exactly what they compute alone, concurrent
//! engines on one backend do too, and dropping an engine gives all its memory back.
//!
//! CI also runs this file with `mutation-address-keyed-cache` (the original bug) and requires all
//! three tests to fail in their assertions.

//!
//! Each test's backends share one device (`WgpuBackend::on`), as CUDA backends share a GPU's
//! context, so each kernel is compiled once a test.

use std::sync::Arc;

use vt_core::backend::prelude::*;
use vt_test_support::lifetime::{check_each, checks, moe_pairs};
use vt_wgpu::{AllocMode, Gpu, WgpuBackend};

fn device() -> Arc<Gpu> {
    Gpu::new().expect("a wgpu adapter (lavapipe: Debian's mesa-vulkan-drivers)")
}

#[test]
fn sequential_engines_in_reused_memory_compute_as_alone() {
    let gpu = device();
    checks::sequential_engines(|| WgpuBackend::on(&gpu, AllocMode::PlacementArena));
}

#[test]
fn concurrent_engines_on_one_backend_compute_as_alone() {
    let gpu = device();
    checks::concurrent_engines(|| WgpuBackend::on(&gpu, AllocMode::PlacementArena));
}

/// 10 cycles a pair in each allocator mode (the CPU runs 100): every cycle's memory must be back, so a leak shows in
/// the first few; lavapipe runs each model on the two CI cores.
#[test]
fn build_run_drop_cycles_give_all_memory_back() {
    for mode in [AllocMode::PlacementArena, AllocMode::System] {
        check_each(&moe_pairs(), |pair| {
            checks::build_run_drop_cycles(&WgpuBackend::with_mode(mode).unwrap(), pair, 10)
        });
    }
}

/// The experts are held once: building a layer's expert table (its resident slot, which every
/// MoE call reads) adds no copy of them, only NVFP4's global scales (a 256-byte block a stack
/// piece), whatever the weight format.
#[test]
fn expert_tables_hold_no_second_copy_of_the_experts() {
    let gpu = device();
    check_each(&moe_pairs(), |pair| {
        let b = WgpuBackend::on(&gpu, AllocMode::System);
        let model = vt_models::Model::load(&b, &pair.a).expect("load fixture");
        b.synchronize().unwrap();
        let loaded = b.memory().bytes_live;
        model.prepare().unwrap();
        b.synchronize().unwrap();
        let prepared = b.memory().bytes_live;
        let layers = model.moe_experts().count();
        let experts: usize = (model.moe_experts().flat_map(|m| &m.experts))
            .map(|e| e.gate.resident_bytes() + e.up.resident_bytes() + e.down.resident_bytes())
            .sum();
        println!(
            "{}: {loaded} bytes live after loading ({experts} of them experts in {layers} layers), {prepared} with \
             the expert tables",
            pair.name
        );
        assert!(
            prepared - loaded <= layers * 2 * 256,
            "{}: the expert tables took {} bytes beside the experts' {experts}",
            pair.name,
            prepared - loaded
        );
    });
}
