//! `Model::state_bytes` against what a state holds on the CPU backend, on every fixture: after a
//! state has seen `n` positions (prompt chunks and decode steps), the memory it holds is at most
//! the estimate and short of it by no more than the backend's growth rule allows.

use vt_core::backend::prelude::*;
use vt_core::KvGrowth;
use vt_cpu::CpuBackend;
use vt_models::{Logits, Model};
use vt_test_support::all_fixtures;

/// vt-cpu's allocator rounds every block up to this many bytes.
const ALIGN: usize = 64;

#[test]
fn state_bytes_bound_what_a_state_holds() {
    for dir in all_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let b = CpuBackend::new();
        let model = Model::load(&b, &dir).unwrap();
        // The expert tables are the weights' memory, not the sequence's: built first.
        model.prepare().unwrap();
        let est = model.state_bytes();
        let KvGrowth::Blocks { block } = est.growth else { panic!("vt-cpu grows KV caches by blocks") };
        let gdn_layers = model.spec().layers.len() - est.kv_layers.len();
        // Each Gated DeltaNet layer's two state tensors may be rounded up; KV blocks are whole
        // multiples of ALIGN (16 positions of 4-byte values).
        let rounding = gdn_layers * 2 * (ALIGN - 1);
        // A sliding layer's estimate caps at `window + 2 * block` positions rounded up to blocks;
        // past the window the cache holds at least the blocks covering `window - 1` positions.
        let slack: usize = est.kv_layers.iter().filter(|(_, w)| w.is_some()).map(|(p, _)| 3 * block * p).sum();
        for (prompt, decode) in [(1, 0), (5, 3), (16, 1), (40, 9), (3, 60)] {
            let before = b.memory().bytes_live;
            let mut state = model.new_state().unwrap();
            let ids: Vec<u32> = (0..prompt as u32).map(|i| 1 + i % 7).collect();
            drop(model.forward(&ids, &mut state, Logits::Last).unwrap());
            for i in 0..decode {
                drop(model.forward(&[2 + i as u32 % 5], &mut state, Logits::Last).unwrap());
            }
            let n = prompt + decode;
            let held = b.memory().bytes_live - before;
            let bound = est.at(n);
            println!("{name}: {n} positions hold {held} bytes, estimate {bound}");
            assert!(held <= bound + rounding, "{name}: {n} positions hold {held} bytes, over the estimate {bound}");
            assert!(bound <= held + slack, "{name}: the estimate {bound} for {n} positions is loose (held {held})");
            drop(state);
            assert_eq!(b.memory().bytes_live, before, "{name}: a dropped state gives its memory back");
        }
    }
}
