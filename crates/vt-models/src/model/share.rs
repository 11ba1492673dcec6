//! Sharing state between sequences of one pool: snapshots of a sequence's linear-attention state
//! in spare slots, a new sequence that starts from cached blocks and a snapshot (a prefix-cache
//! hit), and forks (one prompt, several continuations).
//!
//! Keys and values of a full block never change once written, so sequences share full blocks by
//! reference count. A sequence's partial last block is still being written: a fork gets a copy.
//! The linear-attention state is one slot per sequence, rewritten every step, so it is never
//! shared: a snapshot is a copy into a spare slot, and a hit copies the snapshot back into the
//! sequence's own slot (which keeps its address, so a recorded step over it stays valid).

use vt_core::{Backend, Error, Result, RELEASED};

use super::pool::{lock, PoolInner, StatePool};
use super::state::SeqState;

impl<B: Backend> PoolInner<B> {
    /// Copies slot `src`'s delta-net states into slot `dst`, every layer, in one `copy_many` (one
    /// launch where the backend can).
    pub(super) fn copy_slot(&mut self, src: usize, dst: usize) -> Result<()> {
        if src == dst {
            return Ok(());
        }
        let b = self.backend.clone();
        let mut all = Vec::with_capacity(2 * self.slots.len());
        for layer in &mut self.slots {
            let n = layer.len();
            let [from, to] = layer
                .get_disjoint_mut([src, dst])
                .map_err(|_| Error::input(format!("copying slot {src} into slot {dst} of a pool of {n} slots")))?;
            all.push((&from.conv, &mut to.conv));
            all.push((&from.recurrent, &mut to.recurrent));
        }
        b.copy_many(&mut all)
    }
}

impl<B: Backend> StatePool<B> {
    /// An error unless every one of `states` lives in this pool.
    fn check_own(&self, op: &str, states: &[&SeqState<B>]) -> Result<()> {
        match states.iter().all(|s| std::sync::Arc::ptr_eq(&s.pool, &self.shared)) {
            true => Ok(()),
            false => Err(Error::input(format!("{op}: a sequence of another pool"))),
        }
    }

    /// Whether a prefix of one sequence can start another: every attention layer sees every
    /// earlier position (a sliding-window layer's blocks leave as the sequence moves on, so a
    /// block table's prefix is not what a shorter sequence would hold).
    pub fn shares_prefixes(&self) -> bool {
        // A split model's pools would have to snapshot and share on every rank: not yet.
        self.peers.is_empty() && lock(&self.shared).layout.windows.iter().all(Option::is_none)
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        lock(&self.shared).layout.block
    }

    /// Whether the model has linear-attention layers (whose state a snapshot copies).
    pub fn has_slots(&self) -> bool {
        !lock(&self.shared).layout.gdn.is_empty()
    }

    /// A free slot, for a snapshot; `None` when every slot is taken.
    pub fn take_slot(&self) -> Option<usize> {
        lock(&self.shared).take_slot()
    }

    /// Gives back a slot `take_slot` gave.
    pub fn free_slot(&self, slot: usize) {
        lock(&self.shared).give_slot(slot);
    }

    /// Copies `state`'s linear-attention state into `slot` (a snapshot after `state.len()`
    /// positions).
    pub fn snapshot(&self, state: &SeqState<B>, slot: usize) -> Result<()> {
        self.check_own("snapshot", &[state])?;
        let own = state.slot.ok_or_else(|| Error::input("snapshot: the sequence has no linear-attention slot"))?;
        lock(&self.shared).copy_slot(own, slot)
    }

    /// `state`'s linear-attention states as f32: every delta-net layer's convolution state, then
    /// its recurrent state (empty where the model has none); split over ranks, rank 0's, then each
    /// other rank's. For inspection (tests).
    pub fn linear_state(&self, state: &SeqState<B>) -> Result<Vec<f32>> {
        self.check_own("linear_state", &[state])?;
        let p = lock(&self.shared);
        let mut out = Vec::new();
        for layer in state.slot.iter().flat_map(|&s| p.slots.iter().map(move |l| &l[s])) {
            out.extend(p.backend.to_f32(&layer.conv)?);
            out.extend(p.backend.to_f32(&layer.recurrent)?);
        }
        drop(p);
        if state.peers.len() != self.peers.len() {
            return Err(Error::input("linear_state: the state was made by a model split over other ranks"));
        }
        for (pool, s) in self.peers.iter().zip(&state.peers) {
            out.extend(pool.linear_state(s)?);
        }
        Ok(out)
    }

    /// The blocks that hold `state`'s first `positions` positions, whole blocks of a
    /// single-group pool (`shares_prefixes`); an error unless `state` has written them all.
    pub fn blocks_of(&self, state: &SeqState<B>, positions: usize) -> Result<Vec<u32>> {
        self.check_own("blocks_of", &[state])?;
        let block = self.block_size();
        let n = positions / block;
        match state.tables.as_slice() {
            [table] if positions.is_multiple_of(block) && positions <= state.pos && n <= table.len() => Ok(table[..n].to_vec()),
            _ => Err(Error::input(format!(
                "blocks_of: {positions} positions of a sequence at {} in a pool of {} groups of {block}-position blocks",
                state.pos,
                state.tables.len()
            ))),
        }
    }

    /// Adds a holder (the prefix cache) to a block a sequence holds.
    pub fn share_block(&self, block: u32) -> Result<()> {
        let mut p = lock(&self.shared);
        p.groups.first_mut().ok_or_else(|| Error::input("share_block: the pool has no KV blocks"))?.share(block)
    }

    /// Removes a holder of `block`; `true` when it was the last and the block is free.
    pub fn release_block(&self, block: u32) -> Result<bool> {
        let mut p = lock(&self.shared);
        p.groups.first_mut().ok_or_else(|| Error::input("release_block: the pool has no KV blocks"))?.release(block)
    }

    /// Holders of `block` (1: only whoever asks, e.g. the prefix cache).
    pub fn block_refs(&self, block: u32) -> u32 {
        lock(&self.shared).groups.first().map_or(0, |g| g.refs(block))
    }

    /// Starts the empty `state` from a cached prefix: `blocks` hold its first `tokens` positions
    /// (whole blocks; `state` shares them), and `snapshot` (a slot) the linear-attention state
    /// after them, which is copied into `state`'s slot. On an error `state` holds what it took
    /// and is to be reset or dropped.
    pub fn start_from(
        &self,
        state: &mut SeqState<B>,
        blocks: &[u32],
        tokens: usize,
        snapshot: Option<usize>,
    ) -> Result<()> {
        self.check_own("start_from", &[state])?;
        let mut p = lock(&self.shared);
        let block = p.layout.block;
        if state.pos != 0 || state.tables.iter().any(|t| !t.is_empty()) {
            return Err(Error::input("start_from: the sequence is not empty"));
        }
        if state.tables.len() != 1 || tokens != blocks.len() * block {
            return Err(Error::input(format!(
                "start_from: {} blocks of {block} positions for {tokens} tokens, in a pool of {} groups",
                blocks.len(),
                state.tables.len()
            )));
        }
        match (state.slot, snapshot) {
            (Some(own), Some(snap)) => p.copy_slot(snap, own)?,
            (None, None) => {}
            _ => {
                return Err(Error::input(
                    "start_from: a snapshot must come exactly where the model has linear-attention state",
                ))
            }
        }
        for &id in blocks {
            p.groups[0].share(id)?;
            state.tables[0].push(id);
        }
        state.pos = tokens;
        // The MTP layer's KV lives in the same blocks: the sequences that wrote them fed it there
        // (an engine drafting with the MTP feeds every position it runs).
        state.mtp_pos = tokens;
        state.mtp_out = None;
        Ok(())
    }

    /// Makes the empty `child` (a new state of this pool, or one reset) continue exactly as
    /// `state` would: it shares `state`'s full blocks, gets a copy of its partial last block in
    /// each group, and a copy of its linear-attention state in its own slot. An error when the
    /// pool has no free block for the copy (nothing taken) or a copy fails (`child` then holds
    /// what it took and is to be reset or dropped).
    pub fn fork_into(&self, state: &SeqState<B>, child: &mut SeqState<B>) -> Result<()> {
        self.check_own("fork_into", &[state, child])?;
        let mut p = lock(&self.shared);
        if child.pos != 0 || child.tables.iter().any(|t| !t.is_empty()) || child.tables.len() != state.tables.len() {
            return Err(Error::input("fork_into: the child is not an empty sequence of this pool"));
        }
        let block = p.layout.block;
        let written = state.pos.div_ceil(block);
        let partial = (!state.pos.is_multiple_of(block)).then_some(state.pos / block);
        let copies = |t: &Vec<u32>| partial.and_then(|i| t.get(i)).is_some_and(|&id| id != RELEASED);
        if let Some(g) = (0..state.tables.len()).find(|&g| copies(&state.tables[g]) && p.groups[g].free() == 0) {
            return Err(Error::input(format!("fork: group {g} of the KV pool has no free block for the copy")));
        }
        if let (Some(src), Some(dst)) = (state.slot, child.slot) {
            p.copy_slot(src, dst)?;
        }
        let b = p.backend.clone();
        for (g, table) in state.tables.iter().enumerate() {
            for (i, &id) in table.iter().take(written).enumerate() {
                if id == RELEASED {
                    child.tables[g].push(RELEASED);
                } else if Some(i) == partial {
                    let fresh = p.groups[g].alloc().expect("a free block, checked");
                    child.tables[g].push(fresh);
                    let layers: Vec<usize> =
                        (p.layout.kv.iter().enumerate()).filter(|(_, l)| l.2 == g).map(|(l, _)| l).collect();
                    for layer in layers {
                        b.copy_kv_block(&mut p.kv, layer, id, fresh)?;
                    }
                } else {
                    p.groups[g].share(id)?;
                    child.tables[g].push(id);
                }
            }
        }
        child.pos = state.pos;
        // The MTP layer's KV lives in the same blocks: the child has it as far as `state` has.
        child.mtp_pos = state.mtp_len();
        child.mtp_out = None;
        drop(p);
        let pairs = state.peers.iter().zip(child.peers.iter_mut());
        self.peers.iter().zip(pairs).try_for_each(|(pool, (s, c))| pool.fork_into(s, c))
    }
}
