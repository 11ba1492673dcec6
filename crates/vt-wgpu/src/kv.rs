//! Attention's key/value pool: for every attention layer, keys and values f32 `[blocks, KV_BLOCK,
//! kv_heads, head_dim]`, one buffer each, taken when the pool is made. A call writes its rows into
//! the blocks its sequence's table names (copies, in command order), then attention.wgsl reads
//! every visible position through the table, in as many dispatches as keep within `LOOP_BUDGET`.

use vt_core::backend::check::{self, AttentionDims};
use vt_core::{AttentionParams, KvLayout, KvSeq, Result, Tensor};

use crate::gpu::{err, Range, LOOP_BUDGET};
use crate::shaders::Kernel;
use crate::{act, u32_of, GpuBuffer, WgpuBackend};

/// Positions per block.
pub const KV_BLOCK: usize = 16;
/// The largest head dimension attention.wgsl takes (its per-invocation accumulators).
const MAX_HEAD_DIM: usize = 512;

struct Layer {
    layout: KvLayout,
    k: GpuBuffer,
    v: GpuBuffer,
}

impl Layer {
    fn row_bytes(&self) -> usize {
        self.layout.kv_heads * self.layout.head_dim * 4
    }
}

/// Every attention layer's keys and values of one engine.
pub struct WgpuKvPool {
    layers: Vec<Layer>,
}

pub fn new_pool(b: &WgpuBackend, layouts: &[KvLayout]) -> Result<WgpuKvPool> {
    let layers = layouts
        .iter()
        .map(|&layout| {
            let bytes = layout.blocks * KV_BLOCK * layout.kv_heads * layout.head_dim * 4;
            Ok(Layer { layout, k: b.buffer(bytes)?, v: b.buffer(bytes)? })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(WgpuKvPool { layers })
}

fn layer<'p>(pool: &'p WgpuKvPool, index: usize, op: &str) -> Result<&'p Layer> {
    pool.layers.get(index).ok_or_else(|| err(format!("{op}: layer {index} of a pool of {}", pool.layers.len())))
}

pub fn copy_block(b: &WgpuBackend, pool: &mut WgpuKvPool, index: usize, src: u32, dst: u32) -> Result<()> {
    let op = "copy_kv_block";
    let l = layer(pool, index, op)?;
    if src.max(dst) as usize >= l.layout.blocks {
        return Err(err(format!("{op}: blocks {src} -> {dst} of a pool layer of {}", l.layout.blocks)));
    }
    if src == dst {
        return Ok(());
    }
    let bytes = KV_BLOCK * l.row_bytes();
    // WebGPU copies never read and write one buffer: through a block of its own.
    let tmp = b.buffer(bytes)?;
    for buf in [&l.k, &l.v] {
        b.copy(buf, src as usize * bytes, &tmp, 0, bytes);
        b.copy(&tmp, 0, buf, dst as usize * bytes, bytes);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    b: &WgpuBackend,
    q: &Tensor<WgpuBackend>,
    k: &Tensor<WgpuBackend>,
    v: &Tensor<WgpuBackend>,
    pool: &mut WgpuKvPool,
    seq: KvSeq<'_>,
    p: &AttentionParams,
    d: &AttentionDims,
) -> Result<Tensor<WgpuBackend>> {
    let op = "attention";
    let l = layer(pool, seq.layer, op)?;
    if (l.layout.kv_heads, l.layout.head_dim) != (d.kv_heads, d.head_dim) {
        return Err(err(format!(
            "{op}: k {:?} for a pool layer of {} kv heads x {}",
            k.shape(),
            l.layout.kv_heads,
            l.layout.head_dim
        )));
    }
    check::kv_table(b, op, &seq, d.t, KV_BLOCK, l.layout.blocks, p.window)?;
    if d.head_dim > MAX_HEAD_DIM {
        return Err(err(format!("{op}: head dimension {} exceeds the shader's {MAX_HEAD_DIM}", d.head_dim)));
    }
    let (qb, kb, vb) = (act(q, op)?, act(k, op)?, act(v, op)?);
    let out = b.output(q.shape())?;
    if d.t == 0 {
        return Ok(out);
    }
    // The call's rows into their blocks, a run of positions per block.
    let row = l.row_bytes();
    let mut pos = seq.start;
    while pos < seq.start + d.t {
        let run = (seq.start + d.t - pos).min(KV_BLOCK - pos % KV_BLOCK);
        let to = (seq.table[pos / KV_BLOCK] as usize * KV_BLOCK + pos % KV_BLOCK) * row;
        let (from, bytes) = ((pos - seq.start) * row, run * row);
        b.copy(kb, from, &l.k, to, bytes);
        b.copy(vb, from, &l.v, to, bytes);
        pos += run;
    }
    let table = b.host_data(bytemuck::cast_slice(seq.table))?;
    // Keys 0..keys in dispatches of `per`, from the first any query's window sees.
    let (keys, per) = (seq.start + d.t, keys_per_dispatch(d.head_dim));
    let from = p.window.map_or(0, |w| (seq.start + 1).saturating_sub(w)) / per;
    let dispatches = keys.div_ceil(per) - from;
    // What a query carries from one dispatch to the next: its max, sum and unnormalized output.
    let run = b.buffer(if dispatches > 1 { d.t * d.q_heads * (2 + d.head_dim) * 4 } else { 4 })?;
    for c in from..from + dispatches {
        let params = [
            u32_of(d.t, op)?,
            u32_of(d.q_heads, op)?,
            u32_of(d.kv_heads, op)?,
            u32_of(d.head_dim, op)?,
            u32_of(seq.start, op)?,
            u32_of(p.window.unwrap_or(0), op)?,
            KV_BLOCK as u32,
            p.scale.to_bits(),
            u32_of(c * per, op)?,
            u32_of(((c + 1) * per).min(keys), op)?,
            (c == from) as u32,
            (c + 1 == from + dispatches) as u32,
        ];
        let bindings = [
            (1, qb.range()),
            (2, Range { buffer: &table, offset: 0, size: table.size() }),
            (3, l.k.range()),
            (4, l.v.range()),
            (5, out.buffer().range()),
            (6, run.range()),
        ];
        let groups = [b.gpu.axis(d.q_heads, op)?, b.gpu.axis(d.t, op)?, 1];
        b.gpu.dispatch(Kernel::Attention, &params, &bindings, groups)?;
    }
    Ok(out)
}

/// Keys one attention.wgsl dispatch reads: tiles of 64, as many as keep its busiest invocation
/// within `LOOP_BUDGET`. A tile takes two passes of a score each (d + 2 iterations with the key
/// loop's test), then the tile loop's own, a score (d + 1), the key loop (65) and 64 keys' value
/// loops (at most (d + 63) / 64 + 1 each): at most 4d + 198; the reductions and the output loop
/// take under 64 more.
fn keys_per_dispatch(head_dim: usize) -> usize {
    64 * ((LOOP_BUDGET - 64) / (4 * head_dim + 198)).max(1)
}
