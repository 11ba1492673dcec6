//! The target's side of speculative decoding: a verification runs a sequence's last accepted
//! token and its drafts as consecutive single-token steps in one batched forward
//! (`Model::step`, `StepSeq::verify`), so every position computes exactly what a decode step
//! there would; `Model::settle` then keeps the accepted positions.
//!
//! Rolling back: attention keys and values of rejected positions are simply forgotten (the
//! table gives back the blocks past the kept length; stale rows in the last kept block are
//! overwritten before anything reads them). The Gated DeltaNet layers' conv and recurrent states
//! cannot be truncated, so they are kept or recomputed: the step writes each verifying
//! sequence's states after its first position into a spare slot as well (`gated_delta_waves`'
//! `firsts`: no extra launch, one more state write) and keeps every delta-net layer's projected
//! inputs (a few rows). A sequence that rejects some drafts takes the spare slot as its own (its
//! slot from the step goes back to the pool): keeping only the first position, it is done; keeping
//! more, it reruns the single-token delta rule over the kept rows after the first (no weight
//! reads). Rejecting the first draft, the commonest rollback, so costs nothing after the step
//! (docs/performance.md, "Speculative decoding").

use std::sync::Arc;

use vt_core::{Backend, Error, GdnState, Result, Tensor};

use super::batch::{StepOutput, StepSeq};
use super::layer::Mixer;
use super::layout::Layout;
use super::pool::{lock, GdnSlot, LayerSlot};
use super::state::SeqState;
use super::{Logits, Model};

/// Each delta-net layer's projected inputs of a verification step (`qkv`, `a`, `b`, every row of
/// the step).
pub(super) type Saved<B> = Vec<[Tensor<B>; 3]>;

/// A verified sequence before `settle`.
pub(super) struct Unsettled<B: Backend> {
    /// Its position before the step, and the tokens the step ran.
    pub(super) start: usize,
    pub(super) len: usize,
    /// The slot holding its linear-attention state after its first position (none where it has
    /// no such layers, or verified one position).
    pub(super) first: Option<usize>,
    /// Its row in the step, for each position.
    pub(super) rows: Vec<usize>,
    /// The step's delta-net inputs (shared by the step's verifying sequences).
    pub(super) saved: Arc<Saved<B>>,
}

impl<B: Backend> Model<B> {
    /// One step for many sequences, each running its `ids` after what its state holds:
    /// `forward_batch` where a sequence may verify drafts (`StepSeq::verify`) and the hidden
    /// states may be asked for. A failed call leaves every state in the batch unusable.
    pub fn step(&self, seqs: &mut [StepSeq<'_, B>], hidden: bool) -> Result<StepOutput<B>> {
        self.run(seqs, Logits::Last, hidden)
    }

    /// Ends each verifying sequence's step: it keeps the first `keep` of the positions it verified
    /// (1 ..= the tokens it ran: the last accepted token and the accepted drafts) and ends
    /// exactly as a sequence that had run only those: its attention blocks past them go back to
    /// the pool and its linear-attention state is the one after them, bit for bit. A failed call
    /// leaves the states unusable.
    pub fn settle(&self, seqs: &mut [(&mut SeqState<B>, usize)]) -> Result<()> {
        match (seqs.is_empty(), self.peers.is_empty()) {
            (true, _) => Ok(()),
            (false, true) => self.settle_rank(seqs),
            (false, false) => self.settle_ranks(seqs),
        }
    }

    /// An error unless every sequence verified, keeps 1 to all of its positions, and shares the
    /// first one's pool.
    pub(super) fn check_settle(seqs: &[(&mut SeqState<B>, usize)]) -> Result<()> {
        let Some(shared) = seqs.first().map(|(s, _)| &s.pool) else { return Ok(()) };
        for (s, keep) in seqs.iter() {
            let Some(u) = &s.unsettled else {
                return Err(Error::input("settle: a sequence that did not verify"));
            };
            if !(1..=u.len).contains(keep) || !Arc::ptr_eq(&s.pool, shared) {
                return Err(Error::input(format!(
                    "settle: keeping {keep} of {} verified positions (1 to all, sequences of one pool)",
                    u.len
                )));
            }
        }
        Ok(())
    }

    /// `settle` on one rank (the whole model where it is not split).
    pub(super) fn settle_rank(&self, seqs: &mut [(&mut SeqState<B>, usize)]) -> Result<()> {
        Self::check_settle(seqs)?;
        let Some(shared) = seqs.first().map(|(s, _)| s.pool.clone()) else { return Ok(()) };
        let mut units: Vec<(Unsettled<B>, usize)> =
            seqs.iter_mut().map(|(s, keep)| (s.unsettled.take().expect("checked"), *keep)).collect();
        let mut p = lock(&shared);
        let redone = self.rerun_kept(seqs, &mut units, &mut p);
        for ((s, _), (u, keep)) in seqs.iter_mut().zip(&units) {
            if let Some(slot) = u.first {
                p.give_slot(slot);
            }
            s.truncate(&mut p, u.start + keep)?;
            s.release_outside_windows(&mut p)?;
        }
        redone
    }

    /// Gives each sequence that rejected drafts its state after its first position and reruns the
    /// delta rule over its kept positions after that one: a `gated_delta_waves` call per layer for
    /// the sequences of one step that keep more than one. The slot of that state becomes the
    /// sequence's (no copy), and the unit then holds the slot the sequence had, for the caller to
    /// give back.
    fn rerun_kept(
        &self,
        seqs: &mut [(&mut SeqState<B>, usize)],
        units: &mut [(Unsettled<B>, usize)],
        p: &mut super::pool::PoolInner<B>,
    ) -> Result<()> {
        let mut own = Vec::new();
        for (i, ((s, _), (u, keep))) in seqs.iter_mut().zip(units.iter_mut()).enumerate() {
            if *keep == u.len {
                continue;
            }
            let (Some(first), Some(slot)) = (u.first, s.slot) else { continue };
            (s.slot, u.first) = (Some(first), Some(slot));
            if *keep > 1 {
                own.push((i, first));
            }
        }
        let units = &*units;
        let b = &self.backend;
        let mut done = vec![false; own.len()];
        while let Some(first) = done.iter().position(|d| !d) {
            // The sequences verified in the same step as `first`.
            let step = &units[own[first].0].0.saved;
            let group: Vec<usize> =
                (0..own.len()).filter(|&j| !done[j] && Arc::ptr_eq(&units[own[j].0].0.saved, step)).collect();
            group.iter().for_each(|&j| done[j] = true);
            // The kept positions after the first laid out as a step's single-token waves (most kept
            // first): wave `j` reruns position `j + 1` of the first `waves[j]` of `wave_order`.
            let group: Vec<(usize, usize)> = group.iter().map(|&j| own[j]).collect();
            let kept = Layout::new(&group.iter().map(|&(i, _)| (units[i].1 - 1, 0, true)).collect::<Vec<_>>());
            let wave_order: Vec<(usize, usize)> = kept.order.iter().map(|&k| group[k]).collect();
            let waves = kept.wave_sizes();
            let rows: Vec<usize> = (waves.iter().enumerate())
                .flat_map(|(j, &n)| wave_order[..n].iter().map(move |&(i, _)| units[i].0.rows[j + 1]))
                .collect();
            for (layer, &slot) in self.layers.iter().zip(&self.state_layout.layers) {
                let (Mixer::DeltaNet(d), LayerSlot::Gdn(g)) = (&layer.mixer, slot) else { continue };
                let inputs = step.get(g).ok_or_else(|| Error::input("settle: the step kept no delta-net inputs"))?;
                let mut by_slot: Vec<Option<&mut GdnSlot<B>>> = p.slots[g].iter_mut().map(Some).collect();
                let mut states = (wave_order.iter())
                    .map(|&(_, s)| {
                        let slot = by_slot.get_mut(s).and_then(Option::take);
                        let slot = slot.ok_or_else(|| Error::input("settle: a slot outside the pool"))?;
                        Ok(GdnState { conv: &mut slot.conv, recurrent: &mut slot.recurrent })
                    })
                    .collect::<Result<Vec<_>>>()?;
                d.rerun(b, inputs, &rows, &waves, &mut states)?;
            }
        }
        Ok(())
    }
}
