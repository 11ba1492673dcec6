//! The sequence-state pool on the CPU backend, on every fixture: sequences that share a pool (their
//! blocks interleaved, so each reads through a scattered block table) compute bit for bit what a
//! sequence alone in its own pool (consecutive blocks) computes; blocks are taken as positions
//! arrive, sliding-window layers give back what leaves their window, and everything goes back to
//! the pool, and the pool's memory to the backend, when the states and the pool are dropped.

use vt_core::backend::prelude::*;
use vt_cpu::CpuBackend;
use vt_models::{Logits, Model};
use vt_test_support::all_fixtures;

fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 1 + (i * 7 + salt) % 97).collect()
}

type State = vt_models::SeqState<CpuBackend>;

/// Runs prompts `pa` and `pb` in three chunks each, then 9 decode steps each, on `sa` and `sb`:
/// with `interleave`, a chunk of one then of the other (so their blocks alternate), else all of
/// A's chunks first; decode steps of both at once where `batched` (every other step), else one at
/// a time. Returns each sequence's logits, in order.
fn script(
    model: &Model<CpuBackend>,
    (sa, sb): (&mut State, &mut State),
    interleave: bool,
    batched: bool,
) -> [Vec<f32>; 2] {
    let b = model.backend();
    let (pa, pb) = (ids(37, 0), ids(23, 5));
    let ca = [&pa[..5], &pa[5..20], &pa[20..]];
    let cb = [&pb[..3], &pb[3..17], &pb[17..]];
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let fwd = |ids: &[u32], st: &mut State, out: &mut Vec<f32>| {
        out.extend(b.to_f32(&model.forward(ids, st, Logits::All).unwrap()).unwrap())
    };
    if interleave {
        for (a, bb) in ca.iter().zip(&cb) {
            fwd(a, sa, &mut got_a);
            fwd(bb, sb, &mut got_b);
        }
    } else {
        ca.iter().for_each(|a| fwd(a, sa, &mut got_a));
        cb.iter().for_each(|bb| fwd(bb, sb, &mut got_b));
    }
    for i in 0..9 {
        let step = [3 + i as u32 % 11];
        if batched && i % 2 == 0 {
            let l = b.to_f32(&model.forward_batch(&mut [(&step, &mut *sa), (&step, &mut *sb)]).unwrap()).unwrap();
            let (ra, rb) = l.split_at(l.len() / 2);
            got_a.extend(ra);
            got_b.extend(rb);
        } else {
            fwd(&step, sa, &mut got_a);
            fwd(&step, sb, &mut got_b);
        }
    }
    [got_a, got_b]
}

#[test]
fn interleaved_sequences_in_one_pool_compute_as_alone() {
    for dir in all_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let b = CpuBackend::new();
        let model = Model::load(&b, &dir).unwrap();
        let shared = || model.new_pool(&model.pool_config(2, 64, 64)).unwrap();
        // Each in a pool of its own: consecutive blocks.
        let alone =
            script(&model, (&mut model.new_state(64).unwrap(), &mut model.new_state(64).unwrap()), false, false);
        let pool = shared();
        let (mut sa, mut sb) = (pool.new_state().unwrap(), pool.new_state().unwrap());
        let together = script(&model, (&mut sa, &mut sb), true, false);
        assert!(together == alone, "{name}: sequences with alternating blocks differ from each alone");
        drop((sa, sb));
        assert_eq!(pool.stats().blocks_used, 0, "{name}: dropped states give their blocks back");
        assert_eq!(pool.stats().slots_used, 0, "{name}: and their slots");
        // The batched decode path reads through tables too: alternating blocks or not, the same.
        let (p1, p2) = (shared(), shared());
        let apart = script(&model, (&mut p1.new_state().unwrap(), &mut p1.new_state().unwrap()), false, true);
        let mixed = script(&model, (&mut p2.new_state().unwrap(), &mut p2.new_state().unwrap()), true, true);
        assert!(apart == mixed, "{name}: batched decodes over alternating blocks differ");
    }
}

#[test]
fn blocks_follow_positions_and_windows() {
    for dir in all_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let b = CpuBackend::new();
        let model = Model::load(&b, &dir).unwrap();
        // The expert tables are the weights' memory, not the pool's: built first.
        model.prepare().unwrap();
        let before = b.memory();
        let chunk = 8;
        let pool = model.new_pool(&model.pool_config(1, 300, chunk)).unwrap();
        let shape = pool.shape();
        let block = shape.block_size();
        let mut st = pool.new_state().unwrap();
        let prompt = ids(21, 1);
        for c in prompt.chunks(chunk) {
            model.forward(c, &mut st, Logits::Last).unwrap();
        }
        for n in st.len()..300 {
            model.forward(&[5 + n as u32 % 13], &mut st, Logits::Last).unwrap();
            let held = st.blocks_held();
            let peak = shape.peak_blocks(n + 1, chunk);
            for (g, (&h, &p)) in held.iter().zip(&peak).enumerate() {
                assert!(h <= p, "{name}: group {g} holds {h} blocks at {} positions, over its peak {p}", n + 1);
            }
            // A full-attention group holds exactly the blocks its positions cover.
            let full = (n + 1).div_ceil(block);
            assert!(held.contains(&full) || held.iter().all(|&h| h < full), "{name}: {held:?} at {}", n + 1);
        }
        assert_eq!(st.blocks_to_run(1).iter().sum::<usize>(), usize::from(300 % block == 0) * st.blocks_held().len());
        model.reset_state(&mut st).unwrap();
        assert_eq!((st.len(), pool.stats().blocks_used), (0, 0), "{name}: a reset state holds no blocks");
        drop((st, pool));
        let after = b.memory();
        assert_eq!(
            (after.bytes_live, after.blocks_live),
            (before.bytes_live, before.blocks_live),
            "{name}: pool memory back"
        );
    }
}

/// A step the pool has no blocks for is refused before it runs: the state is as it was.
#[test]
fn a_step_past_the_pool_is_refused_and_harms_nothing() {
    let b = CpuBackend::new();
    let model = Model::load(&b, &vt_test_support::fixture("qwen35moe_text")).unwrap();
    let mut st = model.new_state(20).unwrap();
    let first = b.to_f32(&model.forward(&ids(20, 2), &mut st, Logits::Last).unwrap()).unwrap();
    // 20 positions fill the pool's blocks exactly where the block size divides 20; either way a
    // long step past it cannot fit.
    let err = model.forward(&ids(64, 3), &mut st, Logits::Last).unwrap_err().to_string();
    assert!(err.contains("out of blocks"), "{err}");
    assert_eq!(st.len(), 20);
    let mut fresh = model.new_state(20).unwrap();
    assert_eq!(b.to_f32(&model.forward(&ids(20, 2), &mut fresh, Logits::Last).unwrap()).unwrap(), first);
}
