//! Causal GQA attention over a per-sequence KV cache, optionally windowed.

use std::sync::Arc;

use rayon::prelude::*;
use vt_core::{AttentionParams, Result};

use super::rows::dot;
use crate::alloc::{Allocator, CpuBuffer};

/// One attention layer's keys and values for one sequence, in backend memory.
///
/// Full attention keeps every position and grows by doubling. A sliding-window layer keeps a ring
/// of the last `window` positions, so its cache never grows past the window.
pub struct CpuKvCache {
    alloc: Arc<Allocator>,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    k: Option<CpuBuffer>,
    v: Option<CpuBuffer>,
    /// Rows the buffers hold.
    capacity: usize,
    /// Positions seen so far.
    len: usize,
}

impl CpuKvCache {
    pub(crate) fn new(alloc: Arc<Allocator>, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Self {
        CpuKvCache { alloc, kv_heads, head_dim, window, k: None, v: None, capacity: 0, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows of backend memory held (the window for a sliding layer, at most).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn ensure_capacity(&mut self, rows: usize) -> Result<()> {
        if rows <= self.capacity {
            return Ok(());
        }
        let new_cap = match self.window {
            Some(w) => w,
            None => rows.max(self.capacity * 2).max(16),
        };
        let bytes = new_cap * self.row() * 4;
        let mut k = CpuBuffer::new(&self.alloc, bytes)?;
        let mut v = CpuBuffer::new(&self.alloc, bytes)?;
        if let (Some(ok), Some(ov)) = (&self.k, &self.v) {
            let used = self.capacity * self.row();
            k.f32s_mut()[..used].copy_from_slice(&ok.f32s()[..used]);
            v.f32s_mut()[..used].copy_from_slice(&ov.f32s()[..used]);
        }
        self.k = Some(k);
        self.v = Some(v);
        self.capacity = new_cap;
        Ok(())
    }

    /// Cache row of absolute position `pos`.
    fn slot(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => pos % w,
            None => pos,
        }
    }

    fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let (row, slot) = (self.row(), self.slot(pos));
        let kb = self.k.as_mut().expect("capacity ensured");
        kb.f32s_mut()[slot * row..(slot + 1) * row].copy_from_slice(k);
        let vb = self.v.as_mut().expect("capacity ensured");
        vb.f32s_mut()[slot * row..(slot + 1) * row].copy_from_slice(v);
    }

    fn read(&self, pos: usize, which_v: bool) -> &[f32] {
        let (row, slot) = (self.row(), self.slot(pos));
        let b = if which_v { &self.v } else { &self.k };
        &b.as_ref().expect("read only after a write").f32s()[slot * row..(slot + 1) * row]
    }
}

pub struct AttnShape {
    pub t: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Appends `k`, `v` and attends `q` over every visible cached position.
pub fn attention(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape, cache: &mut CpuKvCache, p: &AttentionParams) -> Result<Vec<f32>> {
    let row = s.kv_heads * s.head_dim;
    let start = cache.len;
    // Keys visible to any query of this call, in position order: the cached tail, then the new ones.
    let first_visible = match p.window {
        Some(w) => start.saturating_sub(w - 1),
        None => 0,
    };
    let Some(w) = p.window else {
        cache.ensure_capacity(start + s.t)?;
        for i in 0..s.t {
            cache.write(start + i, &k[i * row..(i + 1) * row], &v[i * row..(i + 1) * row]);
        }
        cache.len = start + s.t;
        let n = cache.len * row;
        let keys = &cache.k.as_ref().expect("written").f32s()[..n];
        let vals = &cache.v.as_ref().expect("written").f32s()[..n];
        return Ok(attend(q, keys, vals, s, start, 0, p));
    };
    let mut keys = Vec::with_capacity((start - first_visible + s.t) * row);
    let mut vals = Vec::with_capacity(keys.capacity());
    for pos in first_visible..start {
        keys.extend_from_slice(cache.read(pos, false));
        vals.extend_from_slice(cache.read(pos, true));
    }
    keys.extend_from_slice(k);
    vals.extend_from_slice(v);
    cache.ensure_capacity(w)?;
    for i in s.t.saturating_sub(w)..s.t {
        cache.write(start + i, &k[i * row..(i + 1) * row], &v[i * row..(i + 1) * row]);
    }
    cache.len = start + s.t;
    Ok(attend(q, &keys, &vals, s, start, first_visible, p))
}

/// `q` rows are positions `q_start..`, `keys`/`vals` rows positions `kv_start..`.
fn attend(q: &[f32], keys: &[f32], vals: &[f32], s: &AttnShape, q_start: usize, kv_start: usize, p: &AttentionParams) -> Vec<f32> {
    let (d, hq, hkv) = (s.head_dim, s.q_heads, s.kv_heads);
    let group = hq / hkv;
    let mut out = vec![0.0f32; s.t * hq * d];
    out.par_chunks_mut(d).enumerate().for_each(|(idx, o)| {
        let (i, h) = (idx / hq, idx % hq);
        let kvh = h / group;
        let pos = q_start + i;
        let lo = match p.window {
            Some(w) => (pos + 1).saturating_sub(w).max(kv_start),
            None => kv_start,
        };
        let qv = &q[(i * hq + h) * d..(i * hq + h + 1) * d];
        let kv_row = |j: usize| ((j - kv_start) * hkv + kvh) * d;
        let scores: Vec<f32> = (lo..=pos).map(|j| dot(qv, &keys[kv_row(j)..kv_row(j) + d]) * p.scale).collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = scores.iter().map(|&x| (x - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        for (j, &e) in (lo..=pos).zip(&exps) {
            let wgt = e / sum;
            for (oo, &vv) in o.iter_mut().zip(&vals[kv_row(j)..kv_row(j) + d]) {
                *oo += wgt * vv;
            }
        }
    });
    out
}
