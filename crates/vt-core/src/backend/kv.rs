//! Attention's per-sequence state: the key/value cache and the attention that appends to it.

use super::Ops;
use crate::tensor::Tensor;
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
pub struct AttentionParams {
    pub scale: f32,
    /// Sliding window: a query at position p sees keys at positions `p - window < j <= p`.
    pub window: Option<usize>,
}

pub trait KvOps: Ops {
    /// Key/value cache of one attention layer for one sequence.
    type KvCache: Send + Sync + 'static;

    fn new_kv_cache(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Result<Self::KvCache>;
    /// Empties `cache` (no positions), as `new_kv_cache` made it except that it may keep its
    /// storage (a recorded step over it then stays valid).
    fn kv_clear(&self, cache: &mut Self::KvCache) -> Result<()>;
    /// Moves `cache`'s storage now, if it must, so that it holds `positions` positions without
    /// moving again (before recording, so that replays can follow it for a while).
    fn kv_reserve(&self, cache: &mut Self::KvCache, positions: usize) -> Result<()> {
        let _ = (cache, positions);
        Ok(())
    }
    /// Appends `k`, `v` `[t, kv_heads, head_dim]` to `cache`, then causal (optionally windowed)
    /// GQA attention of `q` `[t, q_heads, head_dim]` over everything cached -> `[t, q_heads, head_dim]`.
    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        cache: &mut Self::KvCache,
        params: &AttentionParams,
    ) -> Result<Tensor<Self>>;
}
