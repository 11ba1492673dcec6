//! A sequence's state: its block tables in its pool (pool.rs), its delta-net slot, its length and
//! its recorded steps. The state owns its blocks and slot: resetting or dropping it gives
//! them back to the pool.

use vt_core::{Backend, Error, Result, Tensor, RELEASED};

use super::decode_graph::{RecordedStep, StepShape};
use super::pool::{lock, PoolInner, Shared};
use super::verify::Unsettled;
use super::Model;

/// One sequence's state.
pub struct SeqState<B: Backend> {
    pub(super) pos: usize,
    /// Positions the MTP layer's KV holds from the model's hidden states (mtp.rs); at most `pos`.
    pub(super) mtp_pos: usize,
    /// The MTP layer's output (after its norm) at position `mtp_pos - 1`, `[1, hidden]`, kept by
    /// the call that fed that position: a later draft chains from it without feeding the row
    /// again. Dropped whenever `mtp_pos` moves back.
    pub(super) mtp_out: Option<Tensor<B>>,
    pub(super) pool: Shared<B>,
    /// One block table per group of the pool (`RELEASED` where a sliding group gave a block back).
    pub(super) tables: Vec<Vec<u32>>,
    /// The delta-net slot, where the model has delta-net layers.
    pub(super) slot: Option<usize>,
    /// Positions per block.
    block: usize,
    /// Its own recorded steps, one per shape it has stepped alone in (decode_graph.rs).
    pub(super) recorded: Vec<(StepShape, Recorded<B>)>,
    pub(super) recordings: usize,
    /// During a verification step, the spare delta-net slot its states after its first position
    /// go to (batch.rs); then `unsettled` holds it.
    pub(super) first_slot: Option<usize>,
    /// A verification step's positions, until `Model::settle` keeps some (verify.rs).
    pub(super) unsettled: Option<Unsettled<B>>,
    /// A split model's other ranks' states of this sequence (parallel.rs).
    pub(super) peers: Vec<SeqState<B>>,
}

/// A sequence's recorded step of one shape (decode_graph.rs).
pub(super) enum Recorded<B: Backend> {
    Step(RecordedStep<B>),
    /// Recording failed; this sequence runs steps of this shape unrecorded.
    Failed(Error),
}

impl<B: Backend> SeqState<B> {
    /// An empty sequence in `pool`, with a zeroed delta-net slot where the model has such layers.
    pub(super) fn in_pool(pool: &Shared<B>) -> Result<Self> {
        let mut p = lock(pool);
        let slot = if p.layout.gdn.is_empty() {
            None
        } else {
            let s = p.take_slot().ok_or_else(|| {
                Error::input(format!(
                    "every one of the pool's {} linear-attention state slots is taken",
                    p.stats().slots_total
                ))
            })?;
            if let Err(e) = zero_slot(&mut p, s) {
                p.give_slot(s);
                return Err(e);
            }
            Some(s)
        };
        let (tables, block) = (vec![Vec::new(); p.groups.len()], p.layout.block);
        drop(p);
        Ok(SeqState {
            pos: 0,
            mtp_pos: 0,
            mtp_out: None,
            pool: pool.clone(),
            tables,
            slot,
            block,
            recorded: Vec::new(),
            recordings: 0,
            first_slot: None,
            unsettled: None,
            peers: Vec::new(),
        })
    }

    /// Tokens processed so far.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    /// Positions the MTP layer has been fed (`Model::draft`), from 0: its KV holds them. Never more
    /// than `len()`: a sequence cut back below it (a rejected draft) cuts this too.
    pub fn mtp_len(&self) -> usize {
        self.mtp_pos.min(self.pos)
    }

    /// Keeps only the MTP layer's first `positions` positions: a drafter feeds it again from there
    /// (`Model::draft`; rows fed again overwrite their own KV).
    pub fn cut_mtp(&mut self, positions: usize) {
        self.cut_mtp_here(positions);
        self.peers.iter_mut().for_each(|p| p.cut_mtp(positions));
    }

    /// Whether a draft can chain from the MTP's last fed position without feeding it again
    /// (`DraftInput::hidden` `None`): the call that fed it kept its output.
    pub fn mtp_ready(&self) -> bool {
        self.mtp_out.is_some() && self.mtp_pos <= self.pos
    }

    /// `cut_mtp` of this rank's state.
    fn cut_mtp_here(&mut self, positions: usize) {
        if positions < self.mtp_pos {
            self.mtp_pos = positions;
            self.mtp_out = None;
        }
    }

    /// Steps recorded for this sequence so far (each replayed until its tables change).
    pub fn recordings(&self) -> usize {
        self.recordings
    }

    /// Why recording one of this sequence's steps failed, if one did.
    pub fn recording_error(&self) -> Option<&Error> {
        self.recorded.iter().find_map(|(_, r)| match r {
            Recorded::Failed(e) => Some(e),
            Recorded::Step(_) => None,
        })
    }

    /// Blocks of each group this sequence takes to run `tokens` more positions.
    pub fn blocks_to_run(&self, tokens: usize) -> Vec<usize> {
        let end = (self.pos + tokens).div_ceil(self.block);
        self.tables.iter().map(|t| end.saturating_sub(t.len())).collect()
    }

    /// Blocks of each group this sequence holds.
    pub fn blocks_held(&self) -> Vec<usize> {
        self.tables.iter().map(|t| t.iter().filter(|&&b| b != RELEASED).count()).collect()
    }

    /// Whether `self` and `other` live in the same pool.
    pub fn same_pool(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.pool, &other.pool)
    }

    /// Takes blocks so every table covers `positions` positions: all of them, or an error (and
    /// nothing taken) when a group has too few free.
    pub(super) fn grow(&mut self, p: &mut PoolInner<B>, positions: usize) -> Result<()> {
        let end = positions.div_ceil(self.block);
        for (g, (table, alloc)) in self.tables.iter().zip(&p.groups).enumerate() {
            let need = end.saturating_sub(table.len());
            if need > alloc.free() {
                return Err(Error::input(format!(
                    "the KV pool is out of blocks: a sequence at {} positions needs {need} more of group {g}, {} are \
                     free of {}",
                    self.pos,
                    alloc.free(),
                    alloc.total()
                )));
            }
        }
        for (table, alloc) in self.tables.iter_mut().zip(&mut p.groups) {
            while table.len() < end {
                table.push(alloc.alloc().expect("counted free"));
            }
        }
        Ok(())
    }

    /// Gives back each sliding group's blocks that no query from `self.pos` on can see.
    pub(super) fn release_outside_windows(&mut self, p: &mut PoolInner<B>) -> Result<()> {
        for ((table, alloc), window) in self.tables.iter_mut().zip(&mut p.groups).zip(&p.layout.windows) {
            let Some(w) = window else { continue };
            let first_needed = (self.pos + 1).saturating_sub(*w) / self.block;
            for id in table.iter_mut().take(first_needed) {
                if *id != RELEASED {
                    alloc.release(*id)?;
                    *id = RELEASED;
                }
            }
        }
        Ok(())
    }

    /// Gives back every block (the tables empty) and the first-position slot of an unsettled
    /// verification.
    fn release_blocks(&mut self, p: &mut PoolInner<B>) -> Result<()> {
        if let Some(slot) = self.unsettled.take().and_then(|u| u.first) {
            p.give_slot(slot);
        }
        self.truncate(p, 0)
    }

    /// Forgets every position from `positions` on: the blocks past them go back to the pool.
    pub(super) fn truncate(&mut self, p: &mut PoolInner<B>, positions: usize) -> Result<()> {
        let keep = positions.div_ceil(self.block);
        for (table, alloc) in self.tables.iter_mut().zip(&mut p.groups) {
            for id in table.drain(keep.min(table.len())..).filter(|&id| id != RELEASED) {
                alloc.release(id)?;
            }
        }
        self.pos = self.pos.min(positions);
        self.cut_mtp_here(positions);
        Ok(())
    }
}

impl<B: Backend> Drop for SeqState<B> {
    fn drop(&mut self) {
        let shared = self.pool.clone();
        let mut p = lock(&shared);
        // A block this state holds is one it took: releasing it cannot fail.
        let _ = self.release_blocks(&mut p);
        if let Some(s) = self.slot.take() {
            p.give_slot(s);
        }
    }
}

/// Zeroes slot `s`'s states in every delta-net layer.
fn zero_slot<B: Backend>(p: &mut PoolInner<B>, s: usize) -> Result<()> {
    let b = p.backend.clone();
    for layer in &mut p.slots {
        let slot = &mut layer[s];
        b.zero(&mut slot.conv)?;
        b.zero(&mut slot.recurrent)?;
    }
    Ok(())
}

impl<B: Backend> Model<B> {
    /// A fresh, empty sequence in a pool of its own that holds it up to `tokens` positions (run
    /// in steps of any size): for running one sequence alone. An engine makes one pool for all its
    /// sequences (`new_pool`).
    pub fn new_state(&self, tokens: usize) -> Result<SeqState<B>> {
        let l = &self.state_layout;
        let blocks: Vec<usize> = (0..l.windows.len()).map(|g| l.peak_blocks(g, tokens, tokens).max(1)).collect();
        let slots = usize::from(!l.gdn.is_empty());
        self.pool_of(&blocks, slots)?.new_state()
    }

    /// Empties `state` (a state of this model's layout) for a new sequence: it gives back its
    /// blocks, zeroes its delta-net states and keeps its slot and its recorded steps, so the
    /// sequence that reuses it records nothing while its tables allow. A recording that had failed
    /// is tried again.
    pub fn reset_state(&self, state: &mut SeqState<B>) -> Result<()> {
        let shared = state.pool.clone();
        let mut p = lock(&shared);
        if p.layout != self.state_layout {
            return Err(Error::input("reset_state: the state was made by a model of other layers"));
        }
        state.release_blocks(&mut p)?;
        if let Some(s) = state.slot {
            zero_slot(&mut p, s)?;
        }
        drop(p);
        state.pos = 0;
        state.cut_mtp_here(0);
        state.recorded.retain(|(_, r)| matches!(r, Recorded::Step(_)));
        if state.peers.len() != self.peers.len() {
            return Err(Error::input("reset_state: the state was made by a model split over other ranks"));
        }
        self.peers.iter().zip(&mut state.peers).try_for_each(|(m, s)| m.reset_state(s))
    }
}
