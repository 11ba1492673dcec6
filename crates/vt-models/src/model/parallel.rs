//! Tensor parallelism: a model split over ranks (docs/parallel.md). Each rank holds its part of
//! every layer (split.rs), cut from the mapped checkpoint as it loads, and its own sequence state;
//! rank 0 is the `Model` the caller holds, ranks 1.. are its `peers`, and a sequence's state on
//! rank 0 holds the other ranks' states. A step runs every rank at once, each on a thread of its
//! own over its backend; the ranks sum their parts of each mixer's and each feed-forward block's
//! output (one all-reduce each) and gather the logits of their parts of the vocabulary.

use std::sync::Arc;
use std::thread;

use vt_core::checkpoint::Checkpoint;
use vt_core::{Backend, Communicator, DType, Error, Linear, Result, Tensor};

use super::state::SeqState;
use super::{Draft, DraftInput, Logits, Model, StepOutput, StepSeq};
use crate::loader::{DummyWeights, Loader};
use crate::spec::ModelSpec;
use crate::split::Shard;

/// A rank's collectives' peer ends, one per rank (rank `r` gets `comms[r]`).
pub type Comms<B> = Vec<Arc<dyn Communicator<B>>>;

fn no_progress(_: u64, _: u64) {}

impl<B: Backend> Model<B> {
    /// The checkpoint split over `backends.len()` ranks: rank `r` loads its part onto
    /// `backends[r]` and exchanges through `comms[r]`. The ranks load at once, a thread each.
    pub fn load_ranks(backends: &[B], ckpt: &Checkpoint, comms: Comms<B>, expert_parallel: bool) -> Result<Self> {
        Self::build_ranks(backends, ckpt, comms, expert_parallel, |b| Loader::new(ckpt, b, &no_progress))
    }

    /// As `load_ranks`, with random weights at the config's shapes (`Model::dummy`).
    pub fn dummy_ranks(
        backends: &[B],
        ckpt: &Checkpoint,
        comms: Comms<B>,
        expert_parallel: bool,
        weights: DummyWeights,
    ) -> Result<Self> {
        Self::build_ranks(backends, ckpt, comms, expert_parallel, |b| Ok(Loader::dummy(ckpt, b, weights, &no_progress)))
    }

    fn build_ranks<'c>(
        backends: &'c [B],
        ckpt: &'c Checkpoint,
        comms: Comms<B>,
        expert_parallel: bool,
        loader: impl Fn(&'c B) -> Result<Loader<'c, B>> + Sync,
    ) -> Result<Self> {
        let ranks = backends.len();
        if ranks == 0
            || comms.len() != ranks
            || comms.iter().enumerate().any(|(r, c)| c.rank() != r || c.ranks() != ranks)
        {
            return Err(Error::input(format!(
                "a model split over {ranks} ranks needs one backend and one communicator per rank, in rank order ({} given)",
                comms.len()
            )));
        }
        let loader = &loader;
        let mut models = thread::scope(|s| {
            let handles: Vec<_> = (backends.iter().zip(comms).enumerate())
                .map(|(rank, (b, comm))| {
                    s.spawn(move || {
                        let shard = Shard { rank, ranks, expert_parallel };
                        Self::build(b, ckpt, loader(b)?, &shard, Some(comm))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(panicked()))).collect::<Result<Vec<_>>>()
        })?;
        let mut first = models.remove(0);
        first.peers = models;
        Ok(first)
    }

    /// How many ranks the model is split over (1: not split).
    pub fn ranks(&self) -> usize {
        1 + self.peers.len()
    }

    /// The sum over ranks of this rank's part of a block's output (as it is alone).
    pub(super) fn reduce(&self, b: &B, part: Tensor<B>) -> Result<Tensor<B>> {
        match &self.comm {
            Some(c) => c.all_reduce_sum(b, &part),
            None => Ok(part),
        }
    }

    /// The logits of the normed hidden states `h`: each rank's part of the vocabulary, gathered.
    pub(super) fn logits(&self, b: &B, h: &Tensor<B>) -> Result<Tensor<B>> {
        let part = b.linear(h, self.lm_head.as_ref().unwrap_or(&self.embed))?;
        match &self.comm {
            Some(c) => c.all_gather_cols(b, &part),
            None => Ok(part),
        }
    }

    /// `run` over every rank at once: rank 0 here, the peers on threads of their own, each over
    /// its part of every sequence's state; rank 0's output (all ranks have the logits). A
    /// verifying sequence's state on every rank keeps what that rank's `settle` needs.
    pub(super) fn run_ranks(&self, seqs: &mut [StepSeq<'_, B>], which: Logits, hidden: bool) -> Result<StepOutput<B>> {
        let n = self.peers.len();
        if seqs.iter().any(|s| s.state.peers.len() != n) {
            return Err(Error::input("sequence state belongs to another model"));
        }
        let ids: Vec<(&[u32], bool)> = seqs.iter().map(|s| (s.ids, s.verify)).collect();
        let mut peer_states: Vec<Vec<SeqState<B>>> =
            seqs.iter_mut().map(|s| std::mem::take(&mut s.state.peers)).collect();
        let mut per_rank: Vec<Vec<StepSeq<'_, B>>> = (0..n).map(|_| Vec::with_capacity(ids.len())).collect();
        for (&(ids, verify), states) in ids.iter().zip(peer_states.iter_mut()) {
            for (r, state) in states.iter_mut().enumerate() {
                per_rank[r].push(StepSeq { ids, state, verify });
            }
        }
        // The peers' hidden states are rank 0's (each all-reduce hands every rank the same sum).
        let out = self.on_ranks(
            per_rank,
            |m, mut batch| m.guarded(|| m.run_rank(&mut batch, which, false)).map(drop),
            || self.guarded(|| self.run_rank(seqs, which, hidden)),
        );
        for (s, p) in seqs.iter_mut().zip(peer_states) {
            s.state.peers = p;
        }
        out
    }

    /// `draft` over every rank at once. The MTP layer is split as the model's layers are, so every
    /// rank runs every row; the peers hand zeros where rank 0 hands the hidden states, and the MTP
    /// sums them first (exact: rank 0's values on every rank). Rank 0's drafts (every rank picks
    /// the same: the gathered logits are the same bits on every rank).
    pub(super) fn draft_ranks(&self, seqs: &mut [DraftInput<'_, B>], k: usize) -> Result<Vec<Draft<B>>> {
        let n = self.peers.len();
        if seqs.iter().any(|s| s.state.peers.len() != n) {
            return Err(Error::input("sequence state belongs to another model"));
        }
        let zeros = (self.peers.iter())
            .map(|m| {
                seqs.iter().map(|s| s.hidden.map(|h| zeros_like(&m.backend, h)).transpose()).collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let next: Vec<&[u32]> = seqs.iter().map(|s| s.next).collect();
        let mut peer_states: Vec<Vec<SeqState<B>>> =
            seqs.iter_mut().map(|s| std::mem::take(&mut s.state.peers)).collect();
        let mut per_rank: Vec<Vec<DraftInput<'_, B>>> = (0..n).map(|_| Vec::with_capacity(next.len())).collect();
        for (i, states) in peer_states.iter_mut().enumerate() {
            for (r, state) in states.iter_mut().enumerate() {
                per_rank[r].push(DraftInput { state, hidden: zeros[r][i].as_ref(), next: next[i] });
            }
        }
        let out = self.on_ranks(
            per_rank,
            |m, mut inputs| m.guarded(|| m.draft_rank(&mut inputs, k)).map(drop),
            || self.guarded(|| self.draft_rank(seqs, k)),
        );
        for (s, p) in seqs.iter_mut().zip(peer_states) {
            s.state.peers = p;
        }
        out
    }

    /// `settle` on every rank at once (each reruns its own delta-net heads; nothing is
    /// exchanged). The inputs are checked first, on rank 0, whose sequences' verifications every
    /// rank's mirror.
    pub(super) fn settle_ranks(&self, seqs: &mut [(&mut SeqState<B>, usize)]) -> Result<()> {
        let n = self.peers.len();
        if seqs.iter().any(|(s, _)| s.peers.len() != n) {
            return Err(Error::input("sequence state belongs to another model"));
        }
        Self::check_settle(seqs)?;
        let mut peer_states: Vec<Vec<SeqState<B>>> =
            seqs.iter_mut().map(|(s, _)| std::mem::take(&mut s.peers)).collect();
        let mut per_rank: Vec<Vec<(&mut SeqState<B>, usize)>> =
            (0..n).map(|_| Vec::with_capacity(seqs.len())).collect();
        for ((_, keep), states) in seqs.iter().zip(peer_states.iter_mut()) {
            for (r, state) in states.iter_mut().enumerate() {
                per_rank[r].push((state, *keep));
            }
        }
        let out = self.on_ranks(per_rank, |m, mut part| m.settle_rank(&mut part), || self.settle_rank(seqs));
        for ((s, _), p) in seqs.iter_mut().zip(peer_states) {
            s.peers = p;
        }
        out
    }

    /// Runs `first` on rank 0 (this thread) and `peer` on each peer with its `work`, a thread
    /// each, at once; rank 0's result, or the failure of the rank that failed first (not the
    /// others' "aborted").
    fn on_ranks<W: Send, T>(
        &self,
        work: Vec<W>,
        peer: impl Fn(&Self, W) -> Result<()> + Sync,
        first: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let (first, peers) = thread::scope(|s| {
            let peer = &peer;
            let handles: Vec<_> = (self.peers.iter().zip(work)).map(|(m, w)| s.spawn(move || peer(m, w))).collect();
            let first = first();
            (first, handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(panicked()))).collect::<Vec<_>>())
        });
        let errors = first.as_ref().err().into_iter().chain(peers.iter().filter_map(|r| r.as_ref().err()));
        if let Some(e) = errors.clone().find(|e| !e.to_string().contains(ABORTED)).or(errors.clone().next()) {
            return Err(Error::input(format!("a tensor-parallel rank failed: {e}")));
        }
        first
    }

    /// This rank's part of a step over the group: a failure aborts the group, so that no other
    /// rank waits for it in a collective.
    fn guarded<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let guard = AbortOnPanic(self.comm.as_deref());
        let out = f();
        if let (Err(e), Some(c)) = (&out, guard.0) {
            c.abort(&e.to_string());
        }
        out
    }
}

/// Zeros of `t`'s shape and dtype on `b` (f32, or `b`'s activations).
fn zeros_like<B: Backend>(b: &B, t: &Tensor<B>) -> Result<Tensor<B>> {
    match t.dtype() {
        DType::F32 => b.zeros_f32(t.shape()),
        d if d == b.activation_dtype() => b.zeros(t.shape()),
        d => Err(Error::input(format!("draft: hidden states in {d:?}, not f32 or the model's activation dtype"))),
    }
}

/// What `Communicator` errors after an abort say (vt-core's host communicator and vt-cuda's NCCL one).
const ABORTED: &str = "aborted";

fn panicked() -> Error {
    Error::input("a tensor-parallel rank panicked")
}

/// Aborts the group when a rank's thread unwinds, so that the other ranks stop waiting.
struct AbortOnPanic<'a, B: Backend>(Option<&'a dyn Communicator<B>>);

impl<B: Backend> Drop for AbortOnPanic<'_, B> {
    fn drop(&mut self) {
        if let (true, Some(c)) = (thread::panicking(), self.0) {
            c.abort("a rank panicked");
        }
    }
}

/// `shard`'s LM head: its rows of the vocabulary (of the embeddings where they are tied: alone,
/// the model reads them in place; split, each rank holds a copy of its rows); `None` for the tied
/// head of a model alone.
pub(super) fn lm_head<B: Backend>(ld: &Loader<B>, spec: &ModelSpec, shard: &Shard) -> Result<Option<Linear<B>>> {
    let name = match (spec.tie_embeddings, shard.is_alone()) {
        (true, true) => return Ok(None),
        (true, false) => format!("{}embed_tokens", ld.prefix),
        (false, _) => "lm_head".to_string(),
    };
    let rows = shard.even(spec.vocab);
    if rows.is_empty() {
        return Err(Error::UnsupportedModel(format!(
            "tensor parallelism over {} ranks: rank {} gets none of the {} vocabulary rows",
            shard.ranks, shard.rank, spec.vocab
        )));
    }
    ld.linear_rows(&name, [spec.vocab, spec.hidden], &[rows]).map(Some)
}
