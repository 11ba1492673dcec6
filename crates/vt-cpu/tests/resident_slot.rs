//! The lifetime invariant at the slot level (docs/lifetime.md), on one MoE layer's experts and the
//! expert table the CPU backend derives from them: derived state dies with its owner, weights
//! re-created in the same storage start with an empty slot and build from their own values, and a
//! slot is never read by another backend instance. CI also runs this file with
//! `vt-core/mutation-address-keyed-cache` (the original bug) and requires the first two to fail.

use half::bf16;
use vt_core::backend::prelude::*;
use vt_core::{DType, Expert, Linear, MoeExperts, Router, RouterKind, Tensor, Weight};
use vt_cpu::{AllocMode, CpuBackend};

const HIDDEN: usize = 32;
const INTER: usize = 16;
const EXPERTS: usize = 4;
const TOKENS: usize = 3;

fn arena() -> CpuBackend {
    CpuBackend::with_mode(AllocMode::PlacementArena)
}

/// A bf16 tensor of deterministic values in [-0.5, 0.5) drawn from `seed`.
fn bf16_tensor(b: &CpuBackend, shape: &[usize], seed: u64) -> Tensor<CpuBackend> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let bytes: Vec<u8> = (0..n)
        .flat_map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5).to_bits().to_le_bytes()
        })
        .collect();
    b.upload(DType::BF16, shape, &bytes).unwrap()
}

fn experts(b: &CpuBackend, seed: u64) -> MoeExperts<CpuBackend> {
    let list = (0..EXPERTS as u64)
        .map(|e| {
            let s = seed * 100 + e * 3;
            Expert {
                gate: Weight::Dense(bf16_tensor(b, &[INTER, HIDDEN], s)),
                up: Weight::Dense(bf16_tensor(b, &[INTER, HIDDEN], s + 1)),
                down: Weight::Dense(bf16_tensor(b, &[HIDDEN, INTER], s + 2)),
            }
        })
        .collect();
    MoeExperts::new(b, "experts", list, HIDDEN, INTER).unwrap()
}

fn storage(b: &CpuBackend, m: &MoeExperts<CpuBackend>) -> Vec<usize> {
    m.experts.iter().flat_map(|e| [&e.gate, &e.up, &e.down]).map(|w| w.storage_addr(b)).collect()
}

/// A router and an input, fixed across the experts they are used with.
struct Layer {
    router: Router<CpuBackend>,
    x: Tensor<CpuBackend>,
}

impl Layer {
    fn new(b: &CpuBackend) -> Layer {
        let weight = Linear::new(b, Weight::Dense(bf16_tensor(b, &[EXPERTS, HIDDEN], 7))).unwrap();
        let router =
            Router { weight, kind: RouterKind::Softmax { top_k: 2, renormalize: true }, correction_bias: None };
        let x: Vec<f32> = (0..TOKENS * HIDDEN).map(|i| ((i * 37 % 23) as f32 - 11.0) / 8.0).collect();
        Layer { router, x: b.from_f32(&[TOKENS, HIDDEN], &x).unwrap() }
    }

    fn moe(&self, b: &CpuBackend, experts: &MoeExperts<CpuBackend>) -> Vec<u32> {
        let y = b.moe(&self.x, &self.router, experts).unwrap();
        b.to_f32(&y).unwrap().iter().map(|v| v.to_bits()).collect()
    }
}

#[test]
fn derived_state_is_freed_with_its_owner() {
    let b = arena();
    let layer = Layer::new(&b);
    let before = b.memory();
    let owner = experts(&b, 1);
    let weights_only = b.memory().bytes_live;
    layer.moe(&b, &owner);
    assert!(!owner.resident.is_empty(), "the first MoE call fills the slot");
    assert!(b.memory().bytes_live > weights_only, "the expert table holds backend memory");
    drop(owner);
    let after = b.memory();
    assert_eq!(
        (after.bytes_live, after.blocks_live),
        (before.bytes_live, before.blocks_live),
        "the expert table outlived the experts it was derived from"
    );
}

#[test]
fn weights_recreated_in_same_storage_start_empty_and_build_from_new_values() {
    let b = arena();
    let layer = Layer::new(&b);
    let first = experts(&b, 1);
    let first_storage = storage(&b, &first);
    let first_out = layer.moe(&b, &first);
    drop(first);

    let second = experts(&b, 2);
    assert_eq!(storage(&b, &second), first_storage, "the arena must place the new experts in the freed storage");
    assert!(second.resident.is_empty(), "new weights in reused storage start with an empty slot");
    let out = layer.moe(&b, &second);

    let fresh = arena();
    let alone = Layer::new(&fresh).moe(&fresh, &experts(&fresh, 2));
    assert!(alone != first_out, "the two expert sets must compute differently, or this test proves nothing");
    assert!(out == alone, "experts re-created in reused storage computed with the dropped experts' derived state");
}

#[test]
fn slot_is_never_read_by_another_backend_instance() {
    let (b, other) = (arena(), arena());
    let owner = experts(&b, 1);
    let err = other.moe(&Layer::new(&other).x, &Layer::new(&other).router, &owner).unwrap_err();
    assert!(err.to_string().contains("resident slot"), "unexpected error: {err}");
    assert!(owner.resident.is_empty(), "another instance must not fill the slot");
}
