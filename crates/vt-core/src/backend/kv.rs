//! Attention's per-sequence state: the key/value cache and the attention that appends to it, and
//! how the cache's storage grows (so that a sequence's state can be costed before it exists; the
//! engine reserves memory by it).

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
    /// How this backend's KV caches grow: what a sequence's caches will hold, before they exist.
    fn kv_growth(&self) -> KvGrowth;
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

/// The storage rule of a backend's KV caches. Keys and values are held in the backend's
/// `activation_dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvGrowth {
    /// Blocks of `block` positions, taken as positions arrive and never moved; a sliding-window
    /// cache gives back each block wholly outside its window (holding at most `window / block + 2`
    /// blocks). Reservations (`kv_reserve`) take nothing ahead.
    Blocks { block: usize },
    /// One region per cache: when it must grow it takes the larger of what it needs and twice
    /// what it held, at least `min` positions, and `kv_reserve` takes what it is asked. A
    /// sliding-window cache is a ring of exactly `window` positions.
    Doubling { min: usize },
}

impl KvGrowth {
    /// The most positions of storage a cache holds once it has seen `seen` positions, if every
    /// reservation asked at most `reserve_ahead` positions past the position it was made at.
    pub fn positions_held(&self, window: Option<usize>, seen: usize, reserve_ahead: usize) -> usize {
        if seen == 0 {
            return 0;
        }
        match *self {
            KvGrowth::Blocks { block } => {
                let block = block.max(1);
                window.map_or(seen, |w| seen.min(w + 2 * block)).div_ceil(block) * block
            }
            // A move happens only when the storage is smaller than what is asked, so it at most
            // doubles past the largest ask, `seen` or a reservation's `seen + reserve_ahead`.
            KvGrowth::Doubling { min } => window.unwrap_or(((seen + reserve_ahead) * 2).max(min)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::KvGrowth;

    /// Every growth path of a doubling cache stays within the bound: appends of any size and
    /// reservations `reserve_ahead` ahead, in any interleaving.
    #[test]
    fn a_doubling_cache_never_outgrows_the_bound() {
        let (min, ahead) = (16, 256);
        let rule = KvGrowth::Doubling { min };
        for chunk in [1, 3, 17, 100, 600] {
            for reserve_every in [0, 2, 5, 40] {
                let (mut cap, mut seen) = (0usize, 0usize);
                // Step 1 appends: a reservation is made at a position a sequence has reached.
                for step in 1..400 {
                    let reserve = reserve_every > 0 && step % reserve_every == 0;
                    if !reserve {
                        seen += chunk;
                    }
                    let ask = if reserve { seen + ahead } else { seen };
                    if ask > cap {
                        cap = ask.max(2 * cap).max(min);
                    }
                    let bound = rule.positions_held(None, seen, ahead);
                    assert!(cap <= bound, "chunk {chunk}, reserve every {reserve_every}: {cap} > {bound} at {seen}");
                }
            }
        }
        assert_eq!(rule.positions_held(Some(64), 3, ahead), 64, "a ring is its window");
        assert_eq!(rule.positions_held(None, 0, ahead), 0);
    }

    #[test]
    fn blocks_round_up_and_stop_at_the_window() {
        let rule = KvGrowth::Blocks { block: 16 };
        assert_eq!(rule.positions_held(None, 17, 256), 32);
        assert_eq!(rule.positions_held(Some(40), 1000, 0), 80);
        assert_eq!(rule.positions_held(Some(40), 20, 0), 32);
    }
}
