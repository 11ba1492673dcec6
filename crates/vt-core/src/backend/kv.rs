//! Attention's key/value memory: one pool of fixed-size blocks per engine, and the attention that
//! reads and writes it through a sequence's block table.
//!
//! A pool holds, for every attention layer, keys and values `[blocks, block_size, kv_heads,
//! head_dim]` in the backend's `activation_dtype`. A sequence owns no storage: its block table
//! (one per group of layers that share a window, kept by the model) maps position `p` to row
//! `p % block_size` of block `table[p / block_size]`. Which blocks are free, shared or cached is
//! the host's business (`crate::blocks::BlockAllocator`); the backend only reads and writes the
//! blocks a table names.

use super::Ops;
use crate::tensor::Tensor;
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
pub struct AttentionParams {
    pub scale: f32,
    /// Sliding window: a query at position p sees keys at positions `p - window < j <= p`.
    pub window: Option<usize>,
}

/// One attention layer's storage in a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Blocks of `kv_block_size` positions.
    pub blocks: usize,
}

impl KvLayout {
    /// Bytes of keys and values one position takes in `dtype`.
    pub fn bytes_per_position(&self, dtype: crate::DType) -> usize {
        2 * dtype.bytes_for(self.kv_heads * self.head_dim).unwrap_or(0)
    }
}

/// A table entry of a block a sliding-window layer gave back: no query can see its positions
/// any more, so the backend never reads it.
pub const RELEASED: u32 = u32::MAX;

/// One sequence in one pooled attention layer.
#[derive(Clone, Copy, Debug)]
pub struct KvSeq<'a> {
    /// The layer's index in the pool (the order of `new_kv_pool`'s layouts).
    pub layer: usize,
    /// Block ids: position `p` lives in block `table[p / kv_block_size]`. It covers every position
    /// the call writes; entries of positions no query of the call can see may be `RELEASED`.
    pub table: &'a [u32],
    /// Positions already written: the call's tokens are positions `start..start + t`.
    pub start: usize,
}

pub trait KvOps: Ops {
    /// Keys and values of every attention layer of an engine, in blocks.
    type KvPool: Send + Sync + 'static;

    /// Positions per block. The backend's choice: the unit its attention kernels read.
    fn kv_block_size(&self) -> usize;
    /// A pool with one layer per layout (its storage taken now, or as blocks are first written,
    /// as the backend allocates).
    fn new_kv_pool(&self, layers: &[KvLayout]) -> Result<Self::KvPool>;
    /// Copies block `src` of pool layer `layer` to block `dst` (copy-on-write of a shared block).
    fn copy_kv_block(&self, pool: &mut Self::KvPool, layer: usize, src: u32, dst: u32) -> Result<()>;
    /// Writes `k`, `v` `[t, kv_heads, head_dim]` at positions `seq.start..seq.start + t` of
    /// `seq`'s blocks, then causal (optionally windowed) GQA attention of `q` `[t, q_heads,
    /// head_dim]`, row `i` at position `seq.start + i`, over positions `0..=seq.start + i` ->
    /// `[t, q_heads, head_dim]`.
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        pool: &mut Self::KvPool,
        seq: KvSeq<'_>,
        params: &AttentionParams,
    ) -> Result<Tensor<Self>>;
}
