//! Sequences that share state (vt-models' `share.rs`): a sequence started from another's blocks
//! and snapshot computes exactly what the other computed from that point, bit for bit, and a fork
//! continues exactly as its parent; every block and slot goes back to the pool.

use vt_core::backend::prelude::*;
use vt_cpu::CpuBackend;
use vt_models::{Logits, Model, SeqState, StatePool};
use vt_test_support::{all_fixtures, argmax};

fn name(dir: &std::path::Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// Deterministic ids within the vocabulary.
fn prompt(vocab: usize, n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|j| ((j * 31 + salt * 7 + 3) % vocab) as u32).collect()
}

/// Logits of every position of `ids` run after `state`, then of `steps` greedy decode steps.
fn continue_from(m: &Model<CpuBackend>, state: &mut SeqState<CpuBackend>, ids: &[u32], steps: usize) -> Vec<u32> {
    let b = m.backend();
    let vocab = m.spec().vocab;
    let mut logits = b.to_f32(&m.forward(ids, state, Logits::All).unwrap()).unwrap();
    let mut next = argmax(&logits[logits.len() - vocab..]);
    for _ in 0..steps {
        let row = b.to_f32(&m.forward(&[next], state, Logits::Last).unwrap()).unwrap();
        next = argmax(&row);
        logits.extend_from_slice(&row);
    }
    logits.iter().map(|x| x.to_bits()).collect()
}

fn pool(m: &Model<CpuBackend>, seqs: usize) -> StatePool<CpuBackend> {
    m.new_pool(&m.pool_config(seqs, 256, 256)).unwrap()
}

#[test]
fn a_sequence_started_from_a_snapshot_computes_the_cold_runs_bits() {
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let m = Model::load(&b, &dir).unwrap();
        let pool = pool(&m, 4);
        if !pool.shares_prefixes() {
            continue; // sliding-window layers: no prefix sharing (share.rs)
        }
        let block = pool.block_size();
        let p = prompt(m.spec().vocab, 2 * block + 5, 1);
        let at = 2 * block;
        // Cold: the prefix, a snapshot there, then the rest.
        let mut cold = pool.new_state().unwrap();
        m.forward(&p[..at], &mut cold, Logits::Last).unwrap();
        let snap = if pool.has_slots() {
            let s = pool.take_slot().unwrap();
            pool.snapshot(&cold, s).unwrap();
            Some(s)
        } else {
            None
        };
        let blocks = pool.blocks_of(&cold, at).unwrap();
        let used_before = pool.stats().blocks_used;
        // Hit: a new sequence from those blocks and that snapshot, while the cold one goes on.
        let mut hit = pool.new_state().unwrap();
        pool.start_from(&mut hit, &blocks, at, snap).unwrap();
        assert_eq!(hit.len(), at);
        assert_eq!(pool.stats().blocks_used, used_before, "{}: the hit shares the blocks", name(&dir));
        let want = continue_from(&m, &mut cold, &p[at..], 4);
        let got = continue_from(&m, &mut hit, &p[at..], 4);
        assert!(got == want, "{}: the hit's logits differ from the cold run's", name(&dir));
        drop((cold, hit));
        if let Some(s) = snap {
            pool.free_slot(s);
        }
        let st = pool.stats();
        assert_eq!((st.blocks_used, st.slots_used), (0, 0), "{}: blocks or slots left taken", name(&dir));
    }
}

#[test]
fn a_fork_continues_as_its_parent() {
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let m = Model::load(&b, &dir).unwrap();
        let pool = pool(&m, 4);
        let block = pool.block_size();
        // Mid-block, so the fork copies the partial last block.
        let p = prompt(m.spec().vocab, block + block / 2 + 1, 2);
        let mut parent = pool.new_state().unwrap();
        m.forward(&p, &mut parent, Logits::Last).unwrap();
        let mut child = pool.new_state().unwrap();
        pool.fork_into(&parent, &mut child).unwrap();
        assert_eq!(child.len(), parent.len());
        let next = prompt(m.spec().vocab, 3, 9);
        let want = continue_from(&m, &mut parent, &next, 4);
        let got = continue_from(&m, &mut child, &next, 4);
        assert!(got == want, "{}: the fork's logits differ from its parent's", name(&dir));
        drop((parent, child));
        let st = pool.stats();
        assert_eq!((st.blocks_used, st.slots_used), (0, 0), "{}: blocks or slots left taken", name(&dir));
    }
}

#[test]
fn sharing_refuses_what_does_not_fit() {
    let dir = &all_fixtures()[0];
    let b = CpuBackend::new();
    let m = Model::load(&b, dir).unwrap();
    let pool = pool(&m, 2);
    let mut s = pool.new_state().unwrap();
    m.forward(&prompt(m.spec().vocab, 5, 0), &mut s, Logits::Last).unwrap();
    let block = pool.block_size();
    // Not whole blocks, or more than were written.
    assert!(pool.blocks_of(&s, 3).is_err());
    assert!(pool.blocks_of(&s, 10 * block).is_err());
    // A sequence that already holds positions cannot start from a prefix.
    let err = pool.start_from(&mut s, &[], 0, None).unwrap_err().to_string();
    assert!(err.contains("not empty"), "{err}");
}
