//! The CUDA KV pool: for every attention layer, bf16 keys and values `[blocks, KV_BLOCK, kv_heads,
//! head_dim]`, taken from the backend's allocator when the pool is made.
//!
//! INTERIM, until the paged attention kernels (which read a block table themselves) are wired:
//! the attention kernels here still take one contiguous run of rows per sequence (position p at
//! row p, or at row p % window for a sliding layer's ring). A sequence of a full-attention layer
//! whose table names consecutive blocks is such a run inside the pool, read and written in place
//! (and recordable); any other (scattered blocks, sliding windows) is gathered into a scratch
//! run (`Rows::Gathered`), attended there, and its new rows written back to its blocks.

use std::sync::Arc;

use cudarc::driver::result;
use vt_core::backend::check as args;
use vt_core::{KvLayout, KvSeq, Result};

use crate::alloc::{Allocator, CudaBuffer};
use crate::capture::RecordedCache;
use crate::device::CudaBackend;
use crate::error::{driver_err, err};

/// Positions per block: one key tile of the flash kernels.
pub const KV_BLOCK: usize = 64;

struct PoolLayer {
    layout: KvLayout,
    k: CudaBuffer,
    v: CudaBuffer,
}

pub struct CudaKvPool {
    layers: Vec<PoolLayer>,
}

impl CudaKvPool {
    pub(crate) fn new(alloc: &Arc<Allocator>, layouts: &[KvLayout]) -> Result<Self> {
        let layers = layouts
            .iter()
            .map(|&layout| {
                let bytes = layout.blocks * KV_BLOCK * row_bytes(&layout);
                Ok(PoolLayer { layout, k: CudaBuffer::new(alloc, bytes)?, v: CudaBuffer::new(alloc, bytes)? })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaKvPool { layers })
    }

    fn layer(&self, layer: usize, op: &str) -> Result<&PoolLayer> {
        self.layers
            .get(layer)
            .ok_or_else(|| err(format!("{op}: pool layer {layer} of a pool of {} layers", self.layers.len())))
    }

    /// The layout of pool layer `layer`, or an error naming `op`.
    pub(crate) fn layout(&self, layer: usize, op: &str) -> Result<KvLayout> {
        self.layer(layer, op).map(|l| l.layout)
    }

    /// Copies block `src` of `layer` to `dst`, keys and values, on `b`'s stream.
    pub(crate) fn copy_block(&self, b: &CudaBackend, layer: usize, src: u32, dst: u32) -> Result<()> {
        let op = "copy_kv_block";
        let l = self.layer(layer, op)?;
        if src as usize >= l.layout.blocks || dst as usize >= l.layout.blocks {
            return Err(err(format!("{op}: blocks {src} -> {dst} in a layer of {}", l.layout.blocks)));
        }
        let block = KV_BLOCK * row_bytes(&l.layout);
        for buf in [&l.k, &l.v] {
            copy(b, buf.ptr() + dst as u64 * block as u64, buf.ptr() + src as u64 * block as u64, block)?;
        }
        Ok(())
    }
}

fn row_bytes(l: &KvLayout) -> usize {
    l.kv_heads * l.head_dim * 2
}

/// `bytes` from `src` to `dst` on `b`'s stream.
fn copy(b: &CudaBackend, dst: u64, src: u64, bytes: usize) -> Result<()> {
    // SAFETY: callers pass ranges inside live buffers (pool blocks a checked table names, scratch
    // sized for the rows, a call's k/v tensors); the copy is ordered on the stream with the
    // kernels that read and write them.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, b.stream().cu_stream()) }
        .map_err(|e| driver_err("copying KV rows", e))
}

/// One sequence's rows of one pool layer as the attention kernels take them.
pub(crate) struct Rows {
    /// Keys and values: position p at row p (`window` None) or p % window.
    pub k: u64,
    pub v: u64,
    /// Rows the run holds.
    pub capacity: usize,
    /// Scratch the rows were gathered into (the new rows are written back to the blocks).
    gathered: Option<(CudaBuffer, CudaBuffer)>,
}

impl Rows {
    /// `seq`'s rows in `pool` for a call writing `t` positions with `window`: in place where its
    /// table's blocks are consecutive (full attention), else gathered (every position a query of
    /// the call sees before `seq.start`).
    pub(crate) fn of(
        b: &CudaBackend,
        pool: &CudaKvPool,
        seq: &KvSeq<'_>,
        t: usize,
        window: Option<usize>,
        op: &str,
    ) -> Result<Rows> {
        let l = pool.layer(seq.layer, op)?;
        args::kv_table(b, op, seq, t, KV_BLOCK, l.layout.blocks, window)?;
        let row = row_bytes(&l.layout) as u64;
        if window.is_none() {
            if let Some(rows) = Rows::in_place(pool, seq, t) {
                return Ok(rows);
            }
        }
        let capacity = window.unwrap_or(seq.start + t).max(1);
        let (gk, gv) = (b.buffer(capacity * row as usize)?, b.buffer(capacity * row as usize)?);
        let first = window.map_or(0, |w| (seq.start + 1).saturating_sub(w));
        for (p, n) in runs(first, seq.start, capacity, window.is_some()) {
            let from = seq.table[p / KV_BLOCK] as u64 * KV_BLOCK as u64 + (p % KV_BLOCK) as u64;
            let to = if window.is_some() { p % capacity } else { p } as u64;
            copy(b, gk.ptr() + to * row, l.k.ptr() + from * row, n * row as usize)?;
            copy(b, gv.ptr() + to * row, l.v.ptr() + from * row, n * row as usize)?;
        }
        let (k, v) = (gk.ptr(), gv.ptr());
        Ok(Rows { k, v, capacity, gathered: Some((gk, gv)) })
    }

    /// `seq`'s rows in place, where its table (checked) names consecutive blocks through the
    /// call's last position: they start at its first block and run to the end of the run.
    pub(crate) fn in_place(pool: &CudaKvPool, seq: &KvSeq<'_>, t: usize) -> Option<Rows> {
        let l = pool.layers.get(seq.layer)?;
        let run = consecutive(seq.table);
        if run * KV_BLOCK < seq.start + t {
            return None;
        }
        let at = seq.table[0] as u64 * (KV_BLOCK * row_bytes(&l.layout)) as u64;
        Some(Rows { k: l.k.ptr() + at, v: l.v.ptr() + at, capacity: run * KV_BLOCK, gathered: None })
    }

    /// The storage a recorded step over these rows bakes in; `None` where they were gathered
    /// (scratch that the next step gathers again: not recordable).
    pub(crate) fn recorded(&self) -> Option<RecordedCache> {
        self.gathered.is_none().then_some(RecordedCache { keys: self.k, capacity: self.capacity })
    }

    /// Writes the call's rows `k`, `v` (`[t, kv_heads, head_dim]` at positions `seq.start..`) to
    /// `seq`'s blocks where they were gathered (in place, the kernels wrote them).
    pub(crate) fn write_back(
        &self,
        b: &CudaBackend,
        pool: &CudaKvPool,
        seq: &KvSeq<'_>,
        t: usize,
        k: u64,
        v: u64,
    ) -> Result<()> {
        if self.gathered.is_none() {
            return Ok(());
        }
        let l = pool.layer(seq.layer, "attention")?;
        let row = row_bytes(&l.layout) as u64;
        for (p, n) in runs(seq.start, seq.start + t, usize::MAX, false) {
            let to = seq.table[p / KV_BLOCK] as u64 * KV_BLOCK as u64 + (p % KV_BLOCK) as u64;
            let from = (p - seq.start) as u64;
            copy(b, l.k.ptr() + to * row, k + from * row, n * row as usize)?;
            copy(b, l.v.ptr() + to * row, v + from * row, n * row as usize)?;
        }
        Ok(())
    }
}

/// Blocks at the start of `table` whose ids follow each other.
fn consecutive(table: &[u32]) -> usize {
    table.windows(2).take_while(|w| w[1] == w[0].wrapping_add(1)).count() + usize::from(!table.is_empty())
}

/// Positions `from..to` as runs `(first, len)` that stay within one block and, in a ring of
/// `ring` rows, do not wrap.
fn runs(from: usize, to: usize, ring: usize, wraps: bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut p = from;
    while p < to {
        let mut n = (KV_BLOCK - p % KV_BLOCK).min(to - p);
        if wraps {
            n = n.min(ring - p % ring);
        }
        out.push((p, n));
        p += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{consecutive, runs, KV_BLOCK};

    #[test]
    fn runs_stay_in_blocks_and_rings() {
        assert_eq!(runs(0, 0, 8, false), vec![]);
        assert_eq!(runs(60, 130, usize::MAX, false), vec![(60, 4), (64, 64), (128, 2)]);
        assert_eq!(runs(5, 12, 8, true), vec![(5, 3), (8, 4)]);
        assert_eq!(consecutive(&[4, 5, 6, 9, 10]), 3);
        assert_eq!(consecutive(&[]), 0);
        assert_eq!(KV_BLOCK % 16, 0);
    }
}
