//! Causal GQA attention over a paged per-sequence KV cache, optionally windowed.

use std::sync::Arc;

use rayon::prelude::*;
use vt_core::backend::check::AttentionDims;
use vt_core::{AttentionParams, Result};

use super::rows::dot;
use crate::alloc::{Allocator, CpuBuffer};

/// Positions per KV block: the unit of cache memory a sequence takes and gives back.
pub const KV_BLOCK: usize = 16;

/// Keys and values of `KV_BLOCK` consecutive positions.
struct KvBlock {
    k: CpuBuffer,
    v: CpuBuffer,
}

/// One attention layer's keys and values for one sequence, in fixed-size blocks from the backend's
/// allocator (the block pool: in arena mode a freed block is the next one handed out).
///
/// The block table maps position `p` to block `p / KV_BLOCK`, so growing never copies. A
/// sliding-window layer gives back every block that has fallen wholly out of the window, so it
/// holds at most `window / KV_BLOCK + 2` blocks between calls.
pub struct CpuKvCache {
    alloc: Arc<Allocator>,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    /// `None` where a sliding layer has released the block.
    blocks: Vec<Option<KvBlock>>,
    /// Positions seen so far.
    len: usize,
}

impl CpuKvCache {
    pub(crate) fn new(alloc: Arc<Allocator>, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Self {
        CpuKvCache { alloc, kv_heads, head_dim, window, blocks: Vec::new(), len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// No positions and no blocks, as new (nothing is recorded over a CPU cache, so nothing is
    /// gained by keeping them).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.len = 0;
    }

    /// Blocks of backend memory held.
    pub fn blocks_held(&self) -> usize {
        self.blocks.iter().filter(|b| b.is_some()).count()
    }

    /// Positions of backend memory held.
    pub fn capacity(&self) -> usize {
        self.blocks_held() * KV_BLOCK
    }

    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Appends `t` rows of keys and values, taking new blocks as needed.
    fn append(&mut self, k: &[f32], v: &[f32], t: usize) -> Result<()> {
        let row = self.row();
        for i in 0..t {
            let pos = self.len + i;
            let (b, off) = (pos / KV_BLOCK, (pos % KV_BLOCK) * row);
            if b == self.blocks.len() {
                let bytes = KV_BLOCK * row * 4;
                self.blocks.push(Some(KvBlock {
                    k: CpuBuffer::new(&self.alloc, bytes)?,
                    v: CpuBuffer::new(&self.alloc, bytes)?,
                }));
            }
            let block = self.blocks[b].as_mut().expect("the newest block is never released");
            block.k.f32s_mut()[off..off + row].copy_from_slice(&k[i * row..(i + 1) * row]);
            block.v.f32s_mut()[off..off + row].copy_from_slice(&v[i * row..(i + 1) * row]);
        }
        self.len += t;
        Ok(())
    }

    /// Keys (or values) of all kv heads at position `pos`; the block must be held.
    fn read(&self, pos: usize, which_v: bool) -> &[f32] {
        let (row, off) = (self.row(), (pos % KV_BLOCK) * self.row());
        let block = self.blocks[pos / KV_BLOCK].as_ref().expect("visible positions are held");
        let buf = if which_v { &block.v } else { &block.k };
        &buf.f32s()[off..off + row]
    }

    /// Frees the blocks no future query can see: the next query is at `len` and sees `> len - w`.
    fn release_outside_window(&mut self) {
        let Some(w) = self.window else { return };
        let first_needed = (self.len + 1).saturating_sub(w);
        for block in self.blocks.iter_mut().take(first_needed / KV_BLOCK) {
            *block = None;
        }
    }
}

/// Appends `k`, `v` and attends `q` over every visible cached position.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionDims,
    cache: &mut CpuKvCache,
    p: &AttentionParams,
) -> Result<Vec<f32>> {
    let start = cache.len;
    cache.append(k, v, s.t)?;
    let out = attend(q, cache, s, start, p);
    cache.release_outside_window();
    Ok(out)
}

/// `q` rows are positions `q_start..`, each attending over the cache up to its own position.
fn attend(q: &[f32], cache: &CpuKvCache, s: &AttentionDims, q_start: usize, p: &AttentionParams) -> Vec<f32> {
    let (d, hq, hkv) = (s.head_dim, s.q_heads, s.kv_heads);
    let group = hq / hkv;
    let mut out = vec![0.0f32; s.t * hq * d];
    out.par_chunks_mut(d).enumerate().for_each(|(idx, o)| {
        let (i, h) = (idx / hq, idx % hq);
        let head = (h / group) * d..(h / group + 1) * d;
        let pos = q_start + i;
        let lo = match p.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let qv = &q[(i * hq + h) * d..(i * hq + h + 1) * d];
        let scores: Vec<f32> = (lo..=pos).map(|j| dot(qv, &cache.read(j, false)[head.clone()]) * p.scale).collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = scores.iter().map(|&x| (x - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        for (j, &e) in (lo..=pos).zip(&exps) {
            let wgt = e / sum;
            for (oo, &vv) in o.iter_mut().zip(&cache.read(j, true)[head.clone()]) {
                *oo += wgt * vv;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::HostMemory;
    use crate::AllocMode;

    #[test]
    fn sliding_layer_gives_back_blocks_outside_the_window() {
        let alloc = Arc::new(Allocator::new(AllocMode::System, HostMemory));
        let (w, row) = (20, 2);
        let mut cache = CpuKvCache::new(alloc.clone(), 1, row, Some(w));
        let s = AttentionDims { t: 1, q_heads: 1, kv_heads: 1, head_dim: row };
        let p = AttentionParams { scale: 1.0, window: Some(w) };
        for i in 0..200 {
            let x = [i as f32, 1.0];
            attention(&x, &x, &x, &s, &mut cache, &p).unwrap();
            assert!(cache.blocks_held() <= w / KV_BLOCK + 2, "{} blocks at {i}", cache.blocks_held());
        }
        let mut full = CpuKvCache::new(alloc, 1, row, None);
        let p = AttentionParams { scale: 1.0, window: None };
        let x = vec![1.0; 40 * row];
        attention(&x, &x, &x, &AttentionDims { t: 40, ..s }, &mut full, &p).unwrap();
        assert_eq!(full.blocks_held(), 40usize.div_ceil(KV_BLOCK));
    }
}
