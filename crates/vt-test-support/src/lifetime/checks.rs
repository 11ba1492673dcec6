//! The lifetime test bodies, generic over the backend: each backend's test file calls them with a
//! constructor of fresh placement-arena backends, so address reuse is commanded, not hoped for.
//! docs/lifetime.md says what each proves and how the mutation arm shows it can fail.

use vt_core::Backend;
use vt_models::{Logits, Model, SeqState};

use crate::argmax;

use super::{assert_bit_identical, check_each, differs, expert_storage, moe_pairs, run, slots_empty, solo, Pair};

/// Greedy steps after the prompt.
const STEPS: usize = 4;

/// A, B, A on one backend, each dropped before the next is built: B's experts land exactly where
/// A's were, start with empty slots, and every round is bit-identical to the same checkpoint built
/// on a fresh backend.
pub fn sequential_engines<B: Backend>(arena: impl Fn() -> B) {
    check_each(&moe_pairs(), |pair| {
        let alone = pair.dirs().map(|d| solo(&arena(), d, &pair.prompt, STEPS));
        assert!(differs(&alone[0], &alone[1]), "{}: the variant computes what A does; this proves nothing", pair.name);
        let shared = arena();
        let mut a_storage = None;
        for (round, which) in [0, 1, 0].into_iter().enumerate() {
            let what = format!("{} round {round} ({})", pair.name, ["A", "B"][which]);
            let model = Model::load(&shared, pair.dirs()[which]).unwrap();
            let storage = expert_storage(&model);
            match &a_storage {
                None => a_storage = Some(storage),
                Some(a) => assert_eq!(&storage, a, "{what}: expert storage is not at the dropped engine's addresses"),
            }
            assert!(slots_empty(&model), "{what}: a new engine starts with filled resident slots");
            assert_bit_identical(&what, &run(&model, &pair.prompt, STEPS), &alone[which]);
        }
    });
}

/// Every fixture and its variant built and run on its own thread, all on one backend at once, each
/// engine run by two threads racing to its first use of every resident slot; afterwards only what a
/// fresh backend holds is live.
pub fn concurrent_engines<B: Backend>(arena: impl Fn() -> B) {
    let pairs = moe_pairs();
    let jobs: Vec<_> =
        pairs.iter().flat_map(|p| [0, 1].map(|w| (p, w, solo(&arena(), p.dirs()[w], &p.prompt, STEPS)))).collect();
    let shared = arena();
    std::thread::scope(|s| {
        for (pair, which, alone) in &jobs {
            let shared = &shared;
            s.spawn(move || {
                let model = Model::load(shared, pair.dirs()[*which]).unwrap();
                std::thread::scope(|s| {
                    let runs = [0, 1].map(|_| s.spawn(|| run(&model, &pair.prompt, STEPS)));
                    for (t, h) in runs.into_iter().enumerate() {
                        let what = format!("{} ({}) thread {t}", pair.name, ["A", "B"][*which]);
                        assert_bit_identical(&what, &h.join().unwrap(), alone);
                    }
                });
            });
        }
    });
    // What a fresh backend holds (nothing on the CPU; cuBLASLt's workspace on CUDA) is all that stays.
    let (m, fresh) = (shared.memory(), arena().memory());
    assert_eq!(
        (m.bytes_live, m.blocks_live),
        (fresh.bytes_live, fresh.blocks_live),
        "memory live after every concurrent engine dropped"
    );
}

/// `cycles` build/run/drop cycles of `pair` (A and B alternately, short prompt) on `b`, next to a
/// long-lived engine. Prints the memory figures, then asserts: bytes and blocks live end exactly at
/// the baseline, the peak is the one reached in the first two cycles, and the long-lived engine
/// computes what it did before.
pub fn build_run_drop_cycles<B: Backend>(b: &B, pair: &Pair, cycles: usize) {
    let (prompt, steps) = (&pair.prompt[..8], 2);
    let resident = Model::load(b, &pair.a).unwrap();
    let resident_run = run(&resident, prompt, steps);
    let baseline = b.memory();
    let mut peak_after_warmup = 0;
    for cycle in 0..cycles {
        run(&Model::load(b, pair.dirs()[cycle % 2]).unwrap(), prompt, steps);
        if cycle == 1 {
            peak_after_warmup = b.memory().peak_bytes;
        }
    }
    let end = b.memory();
    println!(
        "{} on {}: {cycles} cycles: baseline {} bytes / {} blocks live; peak {} bytes; final {} bytes / {} blocks live",
        pair.name,
        b.name(),
        baseline.bytes_live,
        baseline.blocks_live,
        end.peak_bytes,
        end.bytes_live,
        end.blocks_live
    );
    assert_eq!(
        (end.bytes_live, end.blocks_live),
        (baseline.bytes_live, baseline.blocks_live),
        "{}: bytes and blocks live after {cycles} cycles differ from the baseline",
        pair.name
    );
    assert_eq!(end.peak_bytes, peak_after_warmup, "{}: peak memory grew over the cycles", pair.name);
    assert_bit_identical(&format!("{} long-lived engine", pair.name), &run(&resident, prompt, steps), &resident_run);
}

/// `cycles` build/run/drop cycles of `pair` (A and B alternately) whose sequences share state in
/// one pool: a snapshot in a spare slot, a sequence started from it and the first one's blocks
/// (it picks the first one's greedy ids), and a fork (likewise). Each cycle's pool ends with no
/// block or slot taken once its sequences are gone, and bytes and blocks live end exactly at the
/// baseline.
pub fn sharing_cycles<B: Backend>(b: &B, pair: &Pair, cycles: usize) {
    let baseline = b.memory();
    for cycle in 0..cycles {
        let model = Model::load(b, pair.dirs()[cycle % 2]).unwrap();
        let pool = model.new_pool(&model.pool_config(4, 128, 128)).unwrap();
        let block = pool.block_size();
        let vocab = model.spec().vocab;
        let prompt: Vec<u32> = (0..block + 3).map(|i| (i * 7 % vocab) as u32).collect();
        let mut first = pool.new_state().unwrap();
        model.forward(&prompt[..block], &mut first, Logits::Last).unwrap();
        let snapshot = pool.has_slots().then(|| pool.take_slot().unwrap());
        if let Some(s) = snapshot {
            pool.snapshot(&first, s).unwrap();
        }
        let mut second = pool.new_state().unwrap();
        if pool.shares_prefixes() {
            pool.start_from(&mut second, &pool.blocks_of(&first, block).unwrap(), block, snapshot).unwrap();
        } else {
            model.forward(&prompt[..block], &mut second, Logits::Last).unwrap();
        }
        let next = |state: &mut SeqState<B>, ids: &[u32]| {
            argmax(&b.to_f32(&model.forward(ids, state, Logits::Last).unwrap()).unwrap())
        };
        let want = next(&mut first, &prompt[block..]);
        assert_eq!(next(&mut second, &prompt[block..]), want, "{} cycle {cycle}: the hit's greedy id", pair.name);
        let mut fork = pool.new_state().unwrap();
        pool.fork_into(&first, &mut fork).unwrap();
        let after = next(&mut first, &[want]);
        assert_eq!(next(&mut fork, &[want]), after, "{} cycle {cycle}: the fork's greedy id", pair.name);
        drop((first, second, fork));
        if let Some(s) = snapshot {
            pool.free_slot(s);
        }
        let st = pool.stats();
        assert_eq!(
            (st.blocks_used, st.slots_used),
            (0, 0),
            "{} cycle {cycle}: the pool kept blocks or slots",
            pair.name
        );
    }
    let end = b.memory();
    assert_eq!(
        (end.bytes_live, end.blocks_live),
        (baseline.bytes_live, baseline.blocks_live),
        "{}: bytes and blocks live after {cycles} sharing cycles differ from the baseline",
        pair.name
    );
}
