//! The memory every sequence's state lives in: one pool per engine (or per lone sequence).
//!
//! - Attention layers' keys and values: the backend's block pool (`KvOps::KvPool`). Layers are
//!   grouped by their sliding window (one group of full-attention layers, one per distinct
//!   window): a sequence has one block table per group, which every layer of the group reads, and
//!   each group has its own block ids and free list (`BlockAllocator`), because a sliding group
//!   gives back the blocks that leave its window while a full group keeps them.
//! - Gated DeltaNet layers' convolution and recurrent states: a slot pool, preallocated, one
//!   tensor per (slot, layer) (a state's storage never moves, so a recorded step can bake it in);
//!   a sequence holds one slot index for its whole life.
//!
//! Sizing: slots first (one per sequence the engine runs at once), then the blocks, shared out
//! between the groups in the proportion one sequence of the expected length uses them (a sliding
//! group needs its window's worth, a full group the whole length), so that the pool holds as many
//! whole sequences of that length as the bytes allow.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use vt_core::blocks::BlockAllocator;
use vt_core::{Backend, DType, Error, KvLayout, Result, Tensor};

use super::decode_graph::{BatchStep, StepShape};
use super::layer::{Layer, Mixer};
use super::Model;

/// Where a model layer's state lives in a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LayerSlot {
    /// An attention layer: its group (block table) and its layer in the backend's pool.
    Kv { group: usize, pool_layer: usize },
    /// A Gated DeltaNet layer: its index among the model's delta-net layers.
    Gdn(usize),
}

/// What a model's sequence state is made of: fixed at load, compared when a state meets a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct StateLayout {
    pub(super) layers: Vec<LayerSlot>,
    /// The MTP layer's, where the model runs one.
    pub(super) mtp: Option<LayerSlot>,
    /// Each group's sliding window (`None`: full attention).
    pub(super) windows: Vec<Option<usize>>,
    /// Each pool layer's `(kv_heads, head_dim, group)`.
    pub(super) kv: Vec<(usize, usize, usize)>,
    /// Each delta-net layer's convolution state shape and recurrent state shape.
    pub(super) gdn: Vec<([usize; 2], [usize; 3])>,
    /// Positions per block (the backend's).
    pub(super) block: usize,
    /// Bytes of one group's block (every layer of the group, keys and values).
    pub(super) block_bytes: Vec<usize>,
    /// Bytes of one slot (every delta-net layer's two states).
    pub(super) slot_bytes: usize,
}

impl StateLayout {
    /// The layout of `layers`, then of the MTP layer `mtp` where the model has one (its attention
    /// is one more pool layer, in the group of its window: its KV covers the sequence's positions
    /// as the model's own layers do).
    pub(super) fn of<B: Backend>(b: &B, layers: &[Layer<B>], mtp: Option<&Layer<B>>) -> Self {
        let mut out = StateLayout {
            layers: Vec::new(),
            mtp: None,
            windows: Vec::new(),
            kv: Vec::new(),
            gdn: Vec::new(),
            block: b.kv_block_size().max(1),
            block_bytes: Vec::new(),
            slot_bytes: 0,
        };
        let act = b.activation_dtype();
        for layer in layers {
            let slot = out.add(layer, act);
            out.layers.push(slot);
        }
        out.mtp = mtp.map(|l| out.add(l, act));
        out
    }

    /// Places `layer`'s state: a pool layer in its window's group, or a delta-net slot.
    fn add<B: Backend>(&mut self, layer: &Layer<B>, act: DType) -> LayerSlot {
        match &layer.mixer {
            Mixer::Attention(a) => {
                let s = &a.spec;
                let group = match self.windows.iter().position(|&w| w == s.window) {
                    Some(g) => g,
                    None => {
                        self.windows.push(s.window);
                        self.block_bytes.push(0);
                        self.windows.len() - 1
                    }
                };
                let layout = KvLayout { kv_heads: s.kv_heads, head_dim: s.head_dim, blocks: 0 };
                self.block_bytes[group] += self.block * layout.bytes_per_position(act);
                self.kv.push((s.kv_heads, s.head_dim, group));
                LayerSlot::Kv { group, pool_layer: self.kv.len() - 1 }
            }
            Mixer::DeltaNet(d) => {
                let s = &d.spec;
                let conv = [s.conv_channels(), s.conv_kernel - 1];
                let rec = [s.value_heads, s.key_dim, s.value_dim];
                self.slot_bytes += act.bytes_for(conv[0] * conv[1]).unwrap_or(0) + 4 * rec.iter().product::<usize>();
                self.gdn.push((conv, rec));
                LayerSlot::Gdn(self.gdn.len() - 1)
            }
        }
    }

    /// Blocks of a group a sequence holds at most while it runs to `tokens` positions in steps of
    /// at most `chunk` tokens (a sliding group: its window plus a chunk, whole blocks either side).
    pub(super) fn peak_blocks(&self, group: usize, tokens: usize, chunk: usize) -> usize {
        let all = tokens.div_ceil(self.block);
        match self.windows[group] {
            None => all,
            Some(w) => all.min((w - 1).saturating_add(chunk.max(1)).div_ceil(self.block) + 1),
        }
    }
}

/// How big a pool to make (`Model::new_pool`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes of sequence state: KV blocks and delta-net slots together.
    pub bytes: usize,
    /// Sequences at once (delta-net slots, and what the sliding groups are sized for).
    pub seqs: usize,
    /// Most tokens a sequence runs in one step (a prompt chunk).
    pub chunk: usize,
    /// The sequence length to size the groups for (the longest an engine allows).
    pub tokens: usize,
    /// Delta-net slots beyond one per sequence, for snapshots of sequences' states (share.rs) and
    /// verifications' rollback points (batch.rs); `bytes` holds them too.
    pub snapshots: usize,
}

/// A pool's occupancy, summed over its groups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub blocks_used: usize,
    pub blocks_total: usize,
    pub slots_used: usize,
    pub slots_total: usize,
}

/// A pool's block groups and their sizes, apart from the pool (a copy, for checking requests
/// where the pool is not at hand).
#[derive(Clone, Debug)]
pub struct PoolShape {
    layout: StateLayout,
    /// Blocks of each group.
    totals: Vec<usize>,
}

impl PoolShape {
    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.layout.block
    }

    /// Blocks of each group.
    pub fn totals(&self) -> &[usize] {
        &self.totals
    }

    /// Blocks of each group a sequence of `tokens` positions holds at most, run in steps of at
    /// most `chunk` tokens.
    pub fn peak_blocks(&self, tokens: usize, chunk: usize) -> Vec<usize> {
        (0..self.totals.len()).map(|g| self.layout.peak_blocks(g, tokens, chunk)).collect()
    }

    /// Whether a sequence of `tokens` positions fits the pool alone (run in steps of at most
    /// `chunk` tokens); if not, an error naming the sizes.
    pub fn check_fits(&self, tokens: usize, chunk: usize) -> Result<()> {
        let l = &self.layout;
        for (g, (need, &total)) in self.peak_blocks(tokens, chunk).into_iter().zip(&self.totals).enumerate() {
            if need > total {
                let kind = l.windows[g].map_or("full-attention".to_string(), |w| format!("{w}-position window"));
                return Err(Error::input(format!(
                    "a sequence of {tokens} tokens needs {need} KV blocks of {} positions ({} bytes each) for its \
                     {kind} layers; the pool holds {total} ({} bytes)",
                    l.block,
                    l.block_bytes[g],
                    total * l.block_bytes[g]
                )));
            }
        }
        Ok(())
    }
}

/// One delta-net layer's state in one slot.
pub(super) struct GdnSlot<B: Backend> {
    pub(super) conv: Tensor<B>,
    pub(super) recurrent: Tensor<B>,
}

/// A pool's contents, behind its lock.
pub(super) struct PoolInner<B: Backend> {
    pub(super) backend: B,
    pub(super) layout: StateLayout,
    pub(super) kv: B::KvPool,
    /// Each group's block ownership.
    pub(super) groups: Vec<BlockAllocator>,
    /// `[delta-net layer][slot]`.
    pub(super) slots: Vec<Vec<GdnSlot<B>>>,
    free_slots: BTreeSet<usize>,
    slots_total: usize,
    /// Recorded steps of several sequences, with their rows and shape (decode_graph.rs).
    pub(super) batch_steps: Vec<((usize, StepShape), BatchStep<B>)>,
    /// Recorded steps of several sequences made so far.
    pub(super) batch_recordings: usize,
    /// Where a recorded step's padding rows write, one each, taken as padded steps first need
    /// them.
    pub(super) padding: Vec<Padding>,
}

/// A padding row of a pool's recorded steps: a block of each group, at position 0, and a
/// delta-net slot past the sequences' ones.
#[derive(Clone)]
pub(super) struct Padding {
    pub(super) tables: Vec<Vec<u32>>,
    pub(super) slot: Option<usize>,
}

pub(super) type Shared<B> = Arc<Mutex<PoolInner<B>>>;

pub(super) fn lock<B: Backend>(shared: &Shared<B>) -> MutexGuard<'_, PoolInner<B>> {
    // A panic elsewhere while holding the lock leaves block counts as they were: still usable.
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

impl<B: Backend> PoolInner<B> {
    pub(super) fn stats(&self) -> PoolStats {
        PoolStats {
            blocks_used: self.groups.iter().map(BlockAllocator::used).sum(),
            blocks_total: self.groups.iter().map(BlockAllocator::total).sum(),
            slots_used: self.slots_total - self.free_slots.len(),
            slots_total: self.slots_total,
        }
    }

    pub(super) fn take_slot(&mut self) -> Option<usize> {
        self.free_slots.pop_first()
    }

    pub(super) fn give_slot(&mut self, slot: usize) {
        self.free_slots.insert(slot);
    }
}

/// A pool of sequence state for one model (`Model::new_pool`): sequences made from it
/// (`new_state`) take blocks as they grow and give them back when reset or dropped. The pool's
/// memory is freed when it and every state made from it are gone.
pub struct StatePool<B: Backend> {
    pub(super) shared: Shared<B>,
    /// A split model's other ranks' pools (parallel.rs), with the same blocks and slots.
    pub(super) peers: Vec<StatePool<B>>,
}

impl<B: Backend> StatePool<B> {
    /// Blocks and slots in use and in all.
    pub fn stats(&self) -> PoolStats {
        lock(&self.shared).stats()
    }

    /// Recorded steps of several sequences made so far, and why any failed to record.
    pub fn batch_recordings(&self) -> (usize, Vec<String>) {
        let p = lock(&self.shared);
        let failed = p.batch_steps.iter().filter_map(|((rows, _), s)| match s {
            BatchStep::Failed { error, .. } => Some(format!("{rows} rows: {error}")),
            BatchStep::Step(_) => None,
        });
        (p.batch_recordings, failed.collect())
    }

    /// Free blocks of each group.
    pub fn free_blocks(&self) -> Vec<usize> {
        lock(&self.shared).groups.iter().map(BlockAllocator::free).collect()
    }

    /// The pool's groups and their sizes (what admission checks a request against).
    pub fn shape(&self) -> PoolShape {
        let p = lock(&self.shared);
        PoolShape { layout: p.layout.clone(), totals: p.groups.iter().map(BlockAllocator::total).collect() }
    }

    /// An empty sequence in this pool: takes a delta-net slot where the model has such layers
    /// (an error when none is free), and no blocks yet.
    pub fn new_state(&self) -> Result<super::SeqState<B>> {
        let mut state = super::SeqState::in_pool(&self.shared)?;
        state.peers = self.peers.iter().map(StatePool::new_state).collect::<Result<_>>()?;
        Ok(state)
    }
}

impl<B: Backend> Model<B> {
    /// The pool that holds `seqs` sequences of `tokens` positions each at once, run in steps of
    /// at most `chunk` tokens: its bytes, exactly.
    pub fn pool_config(&self, seqs: usize, tokens: usize, chunk: usize) -> PoolConfig {
        let l = &self.state_layout;
        let kv: usize = (0..l.windows.len()).map(|g| l.peak_blocks(g, tokens, chunk) * l.block_bytes[g]).sum();
        let slot = if l.gdn.is_empty() { 0 } else { l.slot_bytes };
        PoolConfig { bytes: seqs * (kv + slot), seqs, chunk, tokens, snapshots: 0 }
    }

    /// A pool of `config.bytes` for this model's sequence state (sized as the module says; a
    /// split model's ranks each get `config.bytes`, and the blocks the tightest rank can hold).
    pub fn new_pool(&self, config: &PoolConfig) -> Result<StatePool<B>> {
        let (mut blocks, slots) = self.pool_blocks(config)?;
        for peer in &self.peers {
            let (theirs, _) = peer.pool_blocks(config)?;
            blocks.iter_mut().zip(theirs).for_each(|(b, t)| *b = (*b).min(t));
        }
        self.pool_of(&blocks, slots)
    }

    /// The blocks of each group and the delta-net slots `config` makes room for on this rank.
    fn pool_blocks(&self, config: &PoolConfig) -> Result<(Vec<usize>, usize)> {
        let l = &self.state_layout;
        let seqs = config.seqs.max(1);
        let slots = if l.gdn.is_empty() { 0 } else { seqs + config.snapshots };
        let kv_bytes = config.bytes.checked_sub(slots * l.slot_bytes).ok_or_else(|| {
            Error::input(format!(
                "a state budget of {} bytes cannot hold {slots} linear-attention states of {} bytes",
                config.bytes, l.slot_bytes
            ))
        })?;
        // Blocks of each group one sequence of the expected length needs, and their bytes.
        let per_seq: Vec<usize> =
            (0..l.windows.len()).map(|g| l.peak_blocks(g, config.tokens.max(1), config.chunk)).collect();
        let seq_bytes: usize = per_seq.iter().zip(&l.block_bytes).map(|(n, b)| n * b).sum();
        let blocks: Vec<usize> =
            per_seq.iter().map(|&n| (n as u128 * kv_bytes as u128 / seq_bytes.max(1) as u128) as usize).collect();
        if let Some(g) = blocks.iter().position(|&b| b == 0) {
            return Err(Error::input(format!(
                "a state budget of {} bytes leaves no KV block of {} bytes for the {} layers",
                config.bytes,
                l.block_bytes[g],
                l.windows[g].map_or("full-attention".to_string(), |w| format!("{w}-position window"))
            )));
        }
        Ok((blocks, slots))
    }

    /// A pool of `blocks[g]` blocks for each group and `slots` delta-net slots (on every rank).
    pub(super) fn pool_of(&self, blocks: &[usize], slots: usize) -> Result<StatePool<B>> {
        let mut pool = self.rank_pool(blocks, slots)?;
        pool.peers = self.peers.iter().map(|p| p.rank_pool(blocks, slots)).collect::<Result<_>>()?;
        Ok(pool)
    }

    /// `pool_of` on this rank.
    fn rank_pool(&self, blocks: &[usize], slots: usize) -> Result<StatePool<B>> {
        let (b, l) = (&self.backend, &self.state_layout);
        let layouts: Vec<KvLayout> =
            l.kv.iter().map(|&(kv_heads, head_dim, g)| KvLayout { kv_heads, head_dim, blocks: blocks[g] }).collect();
        let groups = blocks.iter().map(|&n| BlockAllocator::new(n)).collect::<Result<Vec<_>>>()?;
        let slot_tensors = l
            .gdn
            .iter()
            .map(|(conv, rec)| {
                (0..slots)
                    .map(|_| Ok(GdnSlot { conv: b.zeros(conv)?, recurrent: b.zeros_f32(rec)? }))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let inner = PoolInner {
            backend: b.clone(),
            layout: l.clone(),
            kv: b.new_kv_pool(&layouts)?,
            groups,
            slots: slot_tensors,
            free_slots: (0..slots).collect(),
            slots_total: slots,
            batch_steps: Vec::new(),
            batch_recordings: 0,
            padding: Vec::new(),
        };
        Ok(StatePool { shared: Arc::new(Mutex::new(inner)), peers: Vec::new() })
    }
}
