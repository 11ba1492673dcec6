//! The CPU's KV block pool, and causal GQA attention through a sequence's block table,
//! optionally windowed.

use std::sync::Arc;

use rayon::prelude::*;
use vt_core::backend::check::AttentionDims;
use vt_core::{AttentionParams, KvLayout, KvSeq, Result};

use super::rows::dot;
use crate::alloc::{Allocator, CpuBuffer};

/// Positions per KV block: the unit of pool memory a sequence takes and gives back.
pub const KV_BLOCK: usize = 16;

/// Keys and values of `KV_BLOCK` consecutive positions.
struct KvBlock {
    k: CpuBuffer,
    v: CpuBuffer,
}

/// One attention layer's blocks; a block's memory is taken from the backend's allocator when it
/// is first written (host memory is not reserved ahead) and kept until the pool is dropped.
struct PoolLayer {
    layout: KvLayout,
    blocks: Vec<Option<KvBlock>>,
}

/// The CPU's KV pool: every attention layer's keys and values in blocks of `KV_BLOCK` positions,
/// f32 `[KV_BLOCK, kv_heads, head_dim]` each.
pub struct CpuKvPool {
    alloc: Arc<Allocator>,
    layers: Vec<PoolLayer>,
}

impl CpuKvPool {
    pub(crate) fn new(alloc: Arc<Allocator>, layouts: &[KvLayout]) -> Self {
        let layers = layouts
            .iter()
            .map(|&layout| PoolLayer { layout, blocks: (0..layout.blocks).map(|_| None).collect() })
            .collect();
        CpuKvPool { alloc, layers }
    }

    /// Blocks of host memory taken so far (written at least once), over all layers.
    pub fn blocks_allocated(&self) -> usize {
        self.layers.iter().map(|l| l.blocks.iter().filter(|b| b.is_some()).count()).sum()
    }

    /// The layout of pool layer `layer`, or an error naming `op`.
    pub(crate) fn layout(&self, layer: usize, op: &str) -> Result<KvLayout> {
        self.layers.get(layer).map(|l| l.layout).ok_or_else(|| no_layer(op, layer, self.layers.len()))
    }

    /// Block `id` of `layer`, its memory taken if this is its first write.
    fn block_mut(&mut self, layer: usize, id: u32) -> Result<&mut KvBlock> {
        let alloc = &self.alloc;
        let l = &mut self.layers[layer];
        let bytes = KV_BLOCK * l.layout.kv_heads * l.layout.head_dim * 4;
        let slot = &mut l.blocks[id as usize];
        if slot.is_none() {
            *slot = Some(KvBlock { k: CpuBuffer::new(alloc, bytes)?, v: CpuBuffer::new(alloc, bytes)? });
        }
        Ok(slot.as_mut().expect("filled above"))
    }

    /// `KvOps::copy_kv_block`.
    pub(crate) fn copy_block(&mut self, layer: usize, src: u32, dst: u32) -> Result<()> {
        let blocks = self.layout(layer, "copy_kv_block")?.blocks;
        if src as usize >= blocks || dst as usize >= blocks {
            return Err(crate::err(format!("copy_kv_block: blocks {src} -> {dst} in a layer of {blocks}")));
        }
        let Some(from) = &self.layers[layer].blocks[src as usize] else {
            // Never written: its contents are undefined, so are the copy's.
            return Ok(());
        };
        let (k, v) = (from.k.f32s().to_vec(), from.v.f32s().to_vec());
        let to = self.block_mut(layer, dst)?;
        to.k.f32s_mut().copy_from_slice(&k);
        to.v.f32s_mut().copy_from_slice(&v);
        Ok(())
    }
}

fn no_layer(op: &str, layer: usize, layers: usize) -> vt_core::Error {
    crate::err(format!("{op}: pool layer {layer} of a pool of {layers} layers"))
}

/// A sequence's view of one pool layer, for reading.
struct SeqView<'a> {
    layer: &'a PoolLayer,
    table: &'a [u32],
    row: usize,
}

impl SeqView<'_> {
    /// Keys (or values) of all kv heads at position `pos`; its block is written (checked).
    fn read(&self, pos: usize, which_v: bool) -> &[f32] {
        let off = (pos % KV_BLOCK) * self.row;
        let block =
            self.layer.blocks[self.table[pos / KV_BLOCK] as usize].as_ref().expect("visible positions are written");
        let buf = if which_v { &block.v } else { &block.k };
        &buf.f32s()[off..off + self.row]
    }
}

/// Writes `k`, `v` at the sequence's new positions and attends `q` over every visible position
/// (`seq`'s table checked against the pool layer, whose shape is `s`'s).
pub(crate) fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionDims,
    pool: &mut CpuKvPool,
    seq: KvSeq<'_>,
    p: &AttentionParams,
) -> Result<Vec<f32>> {
    let row = s.kv_heads * s.head_dim;
    for i in 0..s.t {
        let pos = seq.start + i;
        let block = pool.block_mut(seq.layer, seq.table[pos / KV_BLOCK])?;
        let off = (pos % KV_BLOCK) * row;
        block.k.f32s_mut()[off..off + row].copy_from_slice(&k[i * row..(i + 1) * row]);
        block.v.f32s_mut()[off..off + row].copy_from_slice(&v[i * row..(i + 1) * row]);
    }
    let view = SeqView { layer: &pool.layers[seq.layer], table: seq.table, row };
    Ok(attend(q, &view, s, seq.start, p))
}

/// `q` rows are positions `q_start..`, each attending over the cache up to its own position.
fn attend(q: &[f32], cache: &SeqView<'_>, s: &AttentionDims, q_start: usize, p: &AttentionParams) -> Vec<f32> {
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
