//! The engine's prefix cache: full KV blocks of earlier sequences and snapshots of their
//! linear-attention state at block ends (`prefix_index` keeps which), so that a prompt that starts
//! with a cached prefix skips its prefill.
//!
//! Where snapshots are taken: a prompt's prefill is split at its last block boundary before its
//! last token, and where it leaves the blocks the cache has of it (a prompt that shares only a
//! cached one's system prompt: the next such prompt hits there); the state at each split is
//! copied into a spare slot and cached with the blocks before it. A decoding sequence copies its
//! state into one slot of its own at each block boundary it reaches, and that latest snapshot is
//! cached when it finishes (the next turn of a conversation resends the reply). A hit restores a
//! snapshot into the new sequence's slot, shares the blocks, and runs only the rest of the prompt.
//!
//! Why a hit computes exactly what the cold run computed, bit for bit: the cold run of a prompt
//! with the cache on runs its tokens up to the snapshot point, then the rest; the hit of the same
//! prefix restores exactly that state (a byte copy) and that step's keys and values (the same
//! blocks), then runs the same rest from the same position. Every op after that point sees the
//! same inputs, so it gives the same bits. (Splitting a prefill elsewhere would not: the chunked
//! delta rule and a decode step round differently from one long chunk, so the split point is part
//! of the computation, and the cache fixes it at block boundaries.)
//!
//! The cache holds one reference on each block it keeps and the spare slots of its snapshots; it
//! lives in the engine, so it is freed with the engine's pool and never seen by another engine.

use vt_core::{Backend, Result};
use vt_models::{SeqState, StatePool};

use crate::prefix_index::{PrefixIndex, PrefixStats};

pub(crate) struct PrefixCache {
    /// Snapshots are slots of the pool, or nothing where the model has no linear-attention layers.
    index: PrefixIndex<u32, Option<usize>>,
    slots: bool,
    /// Slots the cache and the running sequences' latest snapshots may hold, and hold: the rest
    /// of the pool's are the sequences' own.
    slot_limit: usize,
    slots_held: usize,
}

/// One running sequence's part in the cache.
#[derive(Debug, Default)]
pub(crate) struct SeqPrefix {
    /// Tokens of the prompt (what the sequence started with).
    prompt: usize,
    /// Where its prefill stops for snapshots, ascending, until they are taken.
    splits: Vec<usize>,
    /// Positions cached so far (a hit's, then the split's).
    cached: usize,
    /// Its latest snapshot while decoding: the slot (none where the model has no
    /// linear-attention layers) and the position it was taken at.
    latest: Option<(Option<usize>, usize)>,
}

impl SeqPrefix {
    /// The part of a fork of this sequence (it shares what this one cached, and keeps its own
    /// latest snapshot).
    pub(crate) fn fork(&self) -> SeqPrefix {
        SeqPrefix { prompt: self.prompt, splits: self.splits.clone(), cached: self.cached, latest: None }
    }

    /// Of `want` tokens to run from position `pos`, those before the next snapshot split.
    pub(crate) fn cap(&self, pos: usize, want: usize) -> usize {
        match self.splits.iter().find(|&&at| at > pos) {
            Some(&at) => want.min(at - pos),
            None => want,
        }
    }
}

/// Where a prompt of `len` tokens whose first `cached` positions were found with a snapshot and
/// first `matched` with their blocks is split for snapshots: where it leaves the cached blocks
/// (so that the next prompt that shares that much hits there), and its last block boundary
/// before its last token; each only past what is there.
fn split_points(len: usize, cached: usize, matched: usize, block: usize) -> Vec<usize> {
    let last = (len.saturating_sub(1) / block) * block;
    let mut at = Vec::with_capacity(2);
    for point in [matched, last] {
        if point > at.last().copied().unwrap_or(cached) {
            at.push(point);
        }
    }
    at
}

impl PrefixCache {
    /// A cache for sequences of `pool`, where the model allows one (`StatePool::shares_prefixes`),
    /// whose snapshots take at most `slot_limit` of its slots.
    pub(crate) fn new<B: Backend>(pool: &StatePool<B>, slot_limit: usize) -> Option<Self> {
        pool.shares_prefixes().then(|| PrefixCache {
            index: PrefixIndex::new(pool.block_size()),
            slots: pool.has_slots(),
            slot_limit,
            slots_held: 0,
        })
    }

    pub(crate) fn block_size(&self) -> usize {
        self.index.block_size()
    }

    pub(crate) fn stats(&self) -> PrefixStats {
        self.index.stats()
    }

    pub(crate) fn blocks(&self) -> usize {
        self.index.blocks()
    }

    /// Positions of `prompt` a start would take from the cache (nothing counted or touched).
    pub(crate) fn cached_len(&self, prompt: &[u32]) -> usize {
        self.index.peek(prompt)
    }

    /// Starts the empty `state`, which will run `tokens`, from their longest cached prefix, and
    /// returns the sequence's part (where its prefill stops for a snapshot). On an error `state`
    /// is to be reset.
    pub(crate) fn start<B: Backend>(
        &mut self,
        pool: &StatePool<B>,
        state: &mut SeqState<B>,
        tokens: &[u32],
    ) -> Result<SeqPrefix> {
        let matched = self.index.matched(tokens);
        let cached = match self.index.lookup(tokens) {
            Some(hit) => {
                pool.start_from(state, &hit.blocks, hit.tokens, hit.snapshot)?;
                hit.tokens
            }
            None => 0,
        };
        let splits = split_points(tokens.len(), cached, matched, self.block_size());
        Ok(SeqPrefix { prompt: tokens.len(), splits, cached, latest: None })
    }

    /// After a step that ran `seq` (its `state` now holds `tokens[..state.len()]`): at its split,
    /// caches its prefix with a snapshot; decoding at a block boundary, keeps a snapshot there.
    pub(crate) fn after_step<B: Backend>(
        &mut self,
        pool: &StatePool<B>,
        state: &SeqState<B>,
        tokens: &[u32],
        seq: &mut SeqPrefix,
    ) -> Result<()> {
        let pos = state.len();
        if seq.splits.first() == Some(&pos) {
            seq.splits.remove(0);
            seq.cached = pos;
            let slot = match self.snapshot_slot(pool, state)? {
                Some(slot) => slot,
                None => return Ok(()),
            };
            return self.insert(pool, state, tokens, pos, slot);
        }
        if pos > seq.cached && pos >= seq.prompt && pos.is_multiple_of(self.block_size()) {
            let slot = match seq.latest.take() {
                // The slot of the last one is overwritten.
                Some((Some(slot), _)) => {
                    if let Err(e) = pool.snapshot(state, slot) {
                        self.give_slot(pool, slot);
                        return Err(e);
                    }
                    Some(slot)
                }
                _ => match self.snapshot_slot(pool, state)? {
                    Some(slot) => slot,
                    None => return Ok(()),
                },
            };
            seq.latest = Some((slot, pos));
        }
        Ok(())
    }

    /// A sequence finished with `state` intact: its latest snapshot is cached.
    pub(crate) fn finish<B: Backend>(
        &mut self,
        pool: &StatePool<B>,
        state: &SeqState<B>,
        tokens: &[u32],
        seq: &mut SeqPrefix,
    ) -> Result<()> {
        match seq.latest.take() {
            Some((slot, at)) => self.insert(pool, state, tokens, at, slot),
            None => Ok(()),
        }
    }

    /// A sequence's state is gone or emptied (preempted, failed): its snapshot slot goes back.
    pub(crate) fn forget<B: Backend>(&mut self, pool: &StatePool<B>, seq: &mut SeqPrefix) {
        if let Some((Some(slot), _)) = seq.latest.take() {
            self.give_slot(pool, slot);
        }
        *seq = SeqPrefix::default();
    }

    /// A slot for a snapshot: a free one within the limit, else the least recently used cached
    /// snapshot's.
    fn take_slot<B: Backend>(&mut self, pool: &StatePool<B>) -> Option<usize> {
        let free = (self.slots_held < self.slot_limit).then(|| pool.take_slot()).flatten();
        if free.is_some() {
            self.slots_held += 1;
            return free;
        }
        self.index.evict_snapshot().flatten()
    }

    fn give_slot<B: Backend>(&mut self, pool: &StatePool<B>, slot: usize) {
        self.slots_held -= 1;
        pool.free_slot(slot);
    }

    /// Caches `state`'s first `at` positions (whole blocks, holding `tokens[..at]`) with the
    /// snapshot in `slot` (taken at `at`; `None` where the model has no linear-attention layers).
    /// The cache keeps the slot or frees it.
    fn insert<B: Backend>(
        &mut self,
        pool: &StatePool<B>,
        state: &SeqState<B>,
        tokens: &[u32],
        at: usize,
        slot: Option<usize>,
    ) -> Result<()> {
        let inserted = match pool.blocks_of(state, at) {
            Ok(blocks) => self.index.insert(&tokens[..at], &blocks, Some(slot)),
            Err(e) => {
                slot.into_iter().for_each(|s| self.give_slot(pool, s));
                return Err(e);
            }
        };
        if let Some(Some(s)) = inserted.unused {
            self.give_slot(pool, s);
        }
        inserted.taken.iter().try_for_each(|&b| pool.share_block(b))
    }

    /// A snapshot of `state` now, in a slot of its own (`Some(None)` where the model has no
    /// linear-attention layers; `None` when no slot can be had).
    fn snapshot_slot<B: Backend>(&mut self, pool: &StatePool<B>, state: &SeqState<B>) -> Result<Option<Option<usize>>> {
        if !self.slots {
            return Ok(Some(None));
        }
        let Some(s) = self.take_slot(pool) else { return Ok(None) };
        match pool.snapshot(state, s) {
            Ok(()) => Ok(Some(Some(s))),
            Err(e) => {
                self.give_slot(pool, s);
                Err(e)
            }
        }
    }

    /// Evicts the least recently used cached block no sequence holds; `false` when there is none.
    pub(crate) fn evict_one<B: Backend>(&mut self, pool: &StatePool<B>) -> bool {
        let Some(e) = self.index.evict(|&b| pool.block_refs(b) == 1) else { return false };
        // The cache holds a reference on each of its blocks: releasing it cannot fail.
        let _ = pool.release_block(e.block);
        if let Some(Some(s)) = e.snapshot {
            self.give_slot(pool, s);
        }
        true
    }
}
