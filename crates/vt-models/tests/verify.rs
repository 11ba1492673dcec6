//! The target's side of speculative decoding (vt-models' `verify.rs`) on the CPU backend, on
//! every fixture: a verification step computes, for every position it runs, the logits a decode
//! step there computes, bit for bit, batched with plain decodes and prompt chunks; settling
//! leaves the sequence's linear-attention state, blocks and later logits bit-identical to a
//! sequence that never saw the rejected drafts; every block and slot goes back to the pool.

use vt_core::backend::prelude::*;
use vt_cpu::CpuBackend;
use vt_models::{Logits, Model, SeqState, StatePool, StepSeq};
use vt_test_support::all_fixtures;
use vt_test_support::parallel::{cpu_ranks, two_rank_fixtures};

type State = SeqState<CpuBackend>;

/// Deterministic ids within the vocabulary.
fn ids(vocab: usize, n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|j| ((j * 37 + salt * 11 + 5) % vocab) as u32).collect()
}

/// `prompt` run in chunks of `chunk`, then each of `stream` as a decode step: the logits of each
/// decode position, as bits.
fn reference(
    m: &Model<CpuBackend>,
    pool: &StatePool<CpuBackend>,
    (prompt, chunk): (&[u32], usize),
    stream: &[u32],
) -> (State, Vec<Vec<u32>>) {
    let b = m.backend();
    let mut st = pool.new_state().unwrap();
    for c in prompt.chunks(chunk) {
        m.forward(c, &mut st, Logits::Last).unwrap();
    }
    let rows =
        stream.iter().map(|&id| bits(&b.to_f32(&m.forward(&[id], &mut st, Logits::Last).unwrap()).unwrap())).collect();
    (st, rows)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A pool for `seqs` sequences with a spare slot each for a verification's snapshot.
fn pool(m: &Model<CpuBackend>, seqs: usize) -> StatePool<CpuBackend> {
    let c = m.pool_config(seqs, 160, 64);
    let spare = m.pool_config(seqs, 0, 64).bytes;
    m.new_pool(&vt_models::PoolConfig { bytes: c.bytes + spare, snapshots: seqs, ..c }).unwrap()
}

/// One verifying sequence: its true continuation, how far it has got, and the pattern of its
/// steps (drafts per step, how many positions it keeps).
struct Verifier {
    state: State,
    stream: Vec<u32>,
    at: usize,
    salt: usize,
}

impl Verifier {
    /// This step's tokens (the kept ones from the stream, then wrong drafts) and how many it keeps.
    fn plan(&self, step: usize, vocab: usize) -> (Vec<u32>, usize) {
        let left = self.stream.len() - self.at;
        let len = (1 + (step + self.salt) % 5).min(left);
        // Keep all, none of the drafts, or some: 1 ..= len.
        let keep = 1 + (step * 7 + self.salt) % len;
        let mut toks = self.stream[self.at..self.at + keep].to_vec();
        for j in keep..len {
            // A draft that differs from the true token there.
            toks.push((self.stream[self.at + j] + 1 + j as u32) % vocab as u32);
        }
        (toks, keep)
    }
}

#[test]
fn verification_computes_decode_steps_and_settles_to_the_kept_state() {
    for dir in all_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        verify_and_settle(&Model::load(&CpuBackend::new(), &dir).unwrap(), &name);
    }
}

/// The same on models split over 2 ranks, tensor- and expert-parallel: every rank runs the
/// verification over its part of each state, and settling reruns every rank's delta-net heads
/// from its own snapshot, so each rank's linear-attention state (`linear_state` reads every
/// rank's) and the logits after it are those of a sequence that never saw the rejected drafts.
/// The split model's decode steps sum the ranks' parts as its verifications do: bit for bit.
#[test]
fn split_verification_settles_every_rank() {
    for dir in two_rank_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        for ep in [false, true] {
            let m = cpu_ranks(&dir, 2, ep);
            assert_eq!(m.ranks(), 2);
            verify_and_settle(&m, &format!("{name} over 2 ranks, expert-parallel {ep}"));
        }
    }
}

/// Sequences a and b verify drafts (some kept, some rejected) in steps beside c's prompt chunks
/// and plain decodes; checked against sequences that ran only the kept tokens.
fn verify_and_settle(m: &Model<CpuBackend>, name: &str) {
    let b = m.backend();
    let vocab = m.spec().vocab;
    let (pa, pb, pc) = (ids(vocab, 21, 0), ids(vocab, 9, 3), ids(vocab, 30, 1));
    let (sa, sb, sc) = (ids(vocab, 60, 7), ids(vocab, 45, 2), ids(vocab, 20, 5));
    let refs = pool(m, 3);
    let (mut ra, rows_a) = reference(m, &refs, (&pa, pa.len()), &sa);
    let (mut rb, rows_b) = reference(m, &refs, (&pb, pb.len()), &sb);
    let (mut rc, rows_c) = reference(m, &refs, (&pc, 7), &sc);

    let spec = pool(m, 3);
    let (mut a, mut bb, mut c) = (spec.new_state().unwrap(), spec.new_state().unwrap(), spec.new_state().unwrap());
    m.forward_batch(&mut [(&pa, &mut a), (&pb, &mut bb)]).unwrap();
    let mut va = Verifier { state: a, stream: sa.clone(), at: 0, salt: 0 };
    let mut vb = Verifier { state: bb, stream: sb.clone(), at: 0, salt: 3 };
    // C runs its prompt in chunks of 7 beside the verifications, then decodes plainly.
    let (mut c_prompt, mut c_at) = (0, 0);
    let mut step = 0;
    while va.at < sa.len() || vb.at < sb.len() {
        let (ta, ka) = if va.at < sa.len() { va.plan(step, vocab) } else { (Vec::new(), 0) };
        let (tb, kb) = if vb.at < sb.len() { vb.plan(step, vocab) } else { (Vec::new(), 0) };
        let tc: Vec<u32> = if c_prompt < pc.len() {
            pc[c_prompt..(c_prompt + 7).min(pc.len())].to_vec()
        } else {
            sc.get(c_at).map(|&t| vec![t]).unwrap_or_default()
        };
        let mut seqs = Vec::new();
        let mut who = Vec::new();
        if !ta.is_empty() {
            seqs.push(StepSeq { ids: &ta, state: &mut va.state, verify: true });
            who.push('a');
        }
        if !tc.is_empty() {
            seqs.push(StepSeq { ids: &tc, state: &mut c, verify: false });
            who.push('c');
        }
        if !tb.is_empty() {
            seqs.push(StepSeq { ids: &tb, state: &mut vb.state, verify: true });
            who.push('b');
        }
        let out = m.step(&mut seqs, false).unwrap();
        drop(seqs);
        let logits = b.to_f32(&out.logits).unwrap();
        let row = |r: usize| bits(&logits[r * vocab..(r + 1) * vocab]);
        for (range, w) in out.rows.iter().zip(&who) {
            match w {
                'a' | 'b' => {
                    let (v, keep, want) = if *w == 'a' { (&va, ka, &rows_a) } else { (&vb, kb, &rows_b) };
                    assert_eq!(range.len(), if *w == 'a' { ta.len() } else { tb.len() });
                    for j in 0..keep {
                        assert!(
                            row(range.start + j) == want[v.at + j],
                            "{name}: step {step}: sequence {w}'s verified position {j} differs from its decode step"
                        );
                    }
                }
                _ => {
                    assert_eq!(range.len(), 1);
                    if c_prompt >= pc.len() {
                        assert!(row(range.start) == rows_c[c_at], "{name}: step {step}: the plain decode differs");
                    }
                }
            }
        }
        let mut settle: Vec<(&mut State, usize)> = Vec::new();
        if !ta.is_empty() {
            settle.push((&mut va.state, ka));
        }
        if !tb.is_empty() {
            settle.push((&mut vb.state, kb));
        }
        m.settle(&mut settle).unwrap();
        va.at += ka;
        vb.at += kb;
        if c_prompt < pc.len() {
            c_prompt += tc.len();
        } else if !tc.is_empty() {
            c_at += 1;
        }
        step += 1;
    }
    while c_at < sc.len() {
        m.forward(&[sc[c_at]], &mut c, Logits::Last).unwrap();
        c_at += 1;
    }
    assert!(step > 10, "{name}: the script ran {step} steps");
    for (v, r, w) in [(&mut va.state, &mut ra, 'a'), (&mut vb.state, &mut rb, 'b'), (&mut c, &mut rc, 'c')] {
        assert_eq!(v.len(), r.len(), "{name}: sequence {w}'s length");
        assert_eq!(v.blocks_held(), r.blocks_held(), "{name}: sequence {w}'s blocks");
        let (mine, theirs) = (spec.linear_state(v).unwrap(), refs.linear_state(r).unwrap());
        assert!(bits(&mine) == bits(&theirs), "{name}: sequence {w}'s linear-attention state differs");
        // What the blocks hold shows in what comes next.
        let next = ids(vocab, 6, 9);
        for &id in &next {
            let mine = b.to_f32(&m.forward(&[id], v, Logits::Last).unwrap()).unwrap();
            let theirs = b.to_f32(&m.forward(&[id], r, Logits::Last).unwrap()).unwrap();
            assert!(bits(&mine) == bits(&theirs), "{name}: sequence {w} decodes differently after settling");
        }
    }
    drop((va, vb, c));
    let stats = spec.stats();
    assert_eq!((stats.blocks_used, stats.slots_used), (0, 0), "{name}: blocks and slots go back");
}

/// A verification must be settled before the sequence runs again; settling checks what it keeps;
/// a pool without a spare slot refuses to verify a model with linear-attention layers, and a
/// dropped unsettled state gives its snapshot slot back.
#[test]
fn settling_is_checked() {
    let b = CpuBackend::new();
    let m = Model::load(&b, &vt_test_support::fixture("qwen35moe_text")).unwrap();
    let vocab = m.spec().vocab;
    let p = pool(&m, 1);
    let mut st = p.new_state().unwrap();
    m.forward(&ids(vocab, 5, 1), &mut st, Logits::Last).unwrap();
    let toks = ids(vocab, 3, 2);
    m.step(&mut [StepSeq { ids: &toks, state: &mut st, verify: true }], false).unwrap();
    assert_eq!(p.stats().slots_used, 2, "the snapshot takes the spare slot");
    let err = m.forward(&[1], &mut st, Logits::Last).unwrap_err().to_string();
    assert!(err.contains("not settled"), "{err}");
    for keep in [0, 4] {
        let err = m.settle(&mut [(&mut st, keep)]).unwrap_err().to_string();
        assert!(err.contains("verified positions"), "{err}");
    }
    m.settle(&mut [(&mut st, 2)]).unwrap();
    assert_eq!((st.len(), p.stats().slots_used), (7, 1));
    let err = m.settle(&mut [(&mut st, 1)]).unwrap_err().to_string();
    assert!(err.contains("did not verify"), "{err}");
    m.step(&mut [StepSeq { ids: &toks, state: &mut st, verify: true }], false).unwrap();
    drop(st);
    assert_eq!(p.stats().slots_used, 0, "a dropped unsettled state gives its snapshot slot back");
    // A lone state's pool has no spare slot.
    let mut lone = m.new_state(16).unwrap();
    m.forward(&ids(vocab, 5, 1), &mut lone, Logits::Last).unwrap();
    let err = m.step(&mut [StepSeq { ids: &toks, state: &mut lone, verify: true }], false).err().unwrap().to_string();
    assert!(err.contains("spare linear-attention slot"), "{err}");
}

/// The hidden states a drafter reads: every position's, before the final norm, each sequence's
/// together; the logits are the final norm and head of them.
#[test]
fn hidden_states_come_back_in_the_sequences_order() {
    let b = CpuBackend::new();
    let m = Model::load(&b, &vt_test_support::fixture("qwen35moe_text")).unwrap();
    let vocab = m.spec().vocab;
    let p = pool(&m, 2);
    let (mut x, mut y) = (p.new_state().unwrap(), p.new_state().unwrap());
    m.forward(&ids(vocab, 5, 1), &mut x, Logits::Last).unwrap();
    let (tx, ty) = (ids(vocab, 3, 2), ids(vocab, 4, 3));
    let out = m
        .step(
            &mut [
                StepSeq { ids: &tx, state: &mut x, verify: true },
                StepSeq { ids: &ty, state: &mut y, verify: false },
            ],
            true,
        )
        .unwrap();
    let hidden = out.hidden.expect("asked for");
    assert_eq!(hidden.shape(), [7, m.spec().hidden]);
    assert_eq!(out.rows, [0..3, 3..4]);
    // y alone, from scratch: its hidden rows are the last four.
    let q = pool(&m, 1);
    let mut y2 = q.new_state().unwrap();
    let alone = m.step(&mut [StepSeq { ids: &ty, state: &mut y2, verify: false }], true).unwrap();
    let h = b.to_f32(&hidden).unwrap();
    let width = m.spec().hidden;
    assert!(bits(&h[3 * width..]) == bits(&b.to_f32(&alone.hidden.unwrap()).unwrap()));
    m.settle(&mut [(&mut x, 3)]).unwrap();
}
