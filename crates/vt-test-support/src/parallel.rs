//! The tensor-parallel bodies, generic over the backend: every committed fixture split over ranks
//! computes what it computes alone (full forward, prefill then decode, a batched step), and each
//! rank's memory goes back to where it was when the split model and its states are dropped, cycle
//! after cycle in the same (placement-arena) memory. vt-models' tests/parallel.rs runs them on CPU
//! ranks over the host communicator; the GPU suite on CUDA devices over NCCL.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vt_core::backend::Backend;
use vt_core::checkpoint::Checkpoint;
use vt_core::{Communicator, HostComm};
use vt_cpu::CpuBackend;
use vt_models::{Comms, Logits, Model};

use crate::{all_fixtures, max_abs_diff, Reference};

/// A new host communicator group over `backends`: the ranks are threads of this process.
pub fn host_comms<B: Backend>(backends: &[B]) -> Comms<B> {
    let group = HostComm::group(backends.len()).unwrap();
    group.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator<B>>).collect()
}

/// `dir`'s model split over `ranks` CPU ranks (threads over the host communicator), its routed
/// experts partitioned by expert with `expert_parallel`.
pub fn cpu_ranks(dir: &Path, ranks: usize, expert_parallel: bool) -> Model<CpuBackend> {
    let bs: Vec<CpuBackend> = (0..ranks).map(|_| CpuBackend::new()).collect();
    Model::load_ranks(&bs, &Checkpoint::open(dir).unwrap(), host_comms(&bs), expert_parallel).unwrap()
}

/// The fixtures that split over 2 ranks: all but qwen35moe_fp8, whose 16-wide delta-net key heads
/// no rank's FP8 blocks of 32 can start on (vt-models' tests/parallel.rs checks the refusal).
pub fn two_rank_fixtures() -> Vec<PathBuf> {
    all_fixtures().into_iter().filter(|d| !d.ends_with("qwen35moe_fp8")).collect()
}

/// How close a split model's logits must come to the model's alone.
#[derive(Clone, Copy, Debug)]
pub enum Tol {
    /// Bit for bit.
    Exact,
    /// Every logit within this.
    Max(f32),
    /// The median position's max |Δlogit| within this fraction of the largest |logit| (bf16
    /// devices: top-k routing turns a rounding difference at a near tie into another expert, so a
    /// few positions of the ill-conditioned fixtures move by O(1); see vt-cuda's tests/parity.rs).
    MedianRow(f32),
}

impl Tol {
    fn holds(&self, got: &[f32], want: &[f32], vocab: usize) -> bool {
        match *self {
            Tol::Exact => got == want,
            Tol::Max(t) => max_abs_diff(got, want) <= t,
            Tol::MedianRow(rel) => {
                let mut rows: Vec<f32> =
                    got.chunks(vocab).zip(want.chunks(vocab)).map(|(a, b)| max_abs_diff(a, b)).collect();
                rows.sort_by(f32::total_cmp);
                let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                rows.get(rows.len() / 2).is_some_and(|&m| m <= rel * largest)
            }
        }
    }
}

fn name(dir: &std::path::Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// What a model computes over a fixture's reference: the logits of a full forward, of a prefill
/// then one decode step per continuation token, and of one batched step of two sequences.
fn run_fixture<B: Backend>(m: &Model<B>, r: &Reference) -> Vec<f32> {
    let b = m.backend();
    let seq = r.sequence();
    let mut out = Vec::new();
    let mut st = m.new_state(seq.len()).unwrap();
    out.extend(b.to_f32(&m.forward(&seq, &mut st, Logits::All).unwrap()).unwrap());
    let mut st = m.new_state(seq.len()).unwrap();
    let t = r.prompt_ids.len();
    out.extend(b.to_f32(&m.forward(&r.prompt_ids, &mut st, Logits::Last).unwrap()).unwrap());
    for &id in &seq[t..] {
        out.extend(b.to_f32(&m.forward(&[id], &mut st, Logits::Last).unwrap()).unwrap());
    }
    let pool = m.new_pool(&m.pool_config(2, seq.len(), seq.len())).unwrap();
    let (mut s1, mut s2) = (pool.new_state().unwrap(), pool.new_state().unwrap());
    m.forward(&seq[..2], &mut s2, Logits::Last).unwrap();
    let mut batch = [(&r.prompt_ids[..], &mut s1), (&seq[2..3], &mut s2)];
    out.extend(b.to_f32(&m.forward_batch(&mut batch).unwrap()).unwrap());
    out
}

/// Every fixture split over each of `rank_counts` ranks (routed experts partitioned by expert with
/// `expert_parallel`, else by hidden unit), on `backends(n)` (kept across cycles) and `comms` (a
/// new group per load), against `alone` (the model on one backend): logits within `tol`, except
/// for the `refused` (fixture, ranks) pairs, which must fail to load with an error that says why.
/// Each split runs two build/run/drop cycles on the same
/// backends: every cycle computes the same bits and ends with every rank's memory where it began.
/// Returns each pair's max |Δlogit|.
#[allow(clippy::too_many_arguments)]
pub fn split_matches_alone<B: Backend>(
    alone: &B,
    rank_counts: &[usize],
    expert_parallel: bool,
    tol: Tol,
    refused: &[(&str, usize)],
    backends: impl Fn(usize) -> Vec<B>,
    comms: impl Fn(&[B]) -> Comms<B>,
) -> Vec<(String, usize, f32)> {
    let mut seen = Vec::new();
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let (want, alone_bytes) = {
            let before = alone.memory().bytes_live;
            let m = Model::load(alone, &dir).unwrap();
            (run_fixture(&m, &r), alone.memory().bytes_live - before)
        };
        for &n in rank_counts {
            let bs = backends(n);
            let baseline: Vec<_> = bs.iter().map(|b| b.memory()).collect();
            let mut first: Option<Vec<f32>> = None;
            for cycle in 0..2 {
                let m = match Model::load_ranks(&bs, &ckpt, comms(&bs), expert_parallel) {
                    Ok(m) => m,
                    Err(e) if refused.contains(&(name(&dir).as_str(), n)) => {
                        let e = e.to_string();
                        assert!(e.contains("tensor parallelism") && e.contains("rank"), "{}: {e}", name(&dir));
                        println!("{} over {n} ranks: refused: {e}", name(&dir));
                        break;
                    }
                    Err(e) => panic!("{} over {n} ranks: {e}", name(&dir)),
                };
                assert!(!refused.contains(&(name(&dir).as_str(), n)), "{} over {n} ranks loaded", name(&dir));
                assert_eq!(m.ranks(), n);
                for (rank, b) in bs.iter().enumerate() {
                    let held = b.memory().bytes_live - baseline[rank].bytes_live;
                    assert!(
                        n == 1 || held < alone_bytes,
                        "{} rank {rank} of {n} holds {held} bytes, alone {alone_bytes}",
                        name(&dir)
                    );
                }
                let got = run_fixture(&m, &r);
                drop(m);
                for (rank, b) in bs.iter().enumerate() {
                    let (now, then) = (b.memory(), baseline[rank]);
                    assert_eq!(
                        (now.bytes_live, now.blocks_live),
                        (then.bytes_live, then.blocks_live),
                        "{} over {n} ranks, cycle {cycle}: rank {rank}'s memory did not go back",
                        name(&dir)
                    );
                }
                let d = max_abs_diff(&got, &want);
                assert!(
                    tol.holds(&got, &want, r.vocab),
                    "{} over {n} ranks: max |dlogit| {d:e}, not {tol:?}",
                    name(&dir)
                );
                match &first {
                    None => {
                        println!("{} over {n} ranks: max |dlogit| against one rank = {d:.3e}", name(&dir));
                        seen.push((name(&dir), n, d));
                        first = Some(got);
                    }
                    Some(f) => assert!(*f == got, "{} over {n} ranks: cycle {cycle} computed other bits", name(&dir)),
                }
            }
        }
    }
    seen
}
