//! Flash-style attention for prefill (kernels/flash_attn.cu): ops/attention launches it in place of
//! the one-warp-per-query kernel when a call brings several queries and the head dimension is one
//! the kernel is built for. Same arguments, same contract (positions before `start` from the pool
//! through the block table, this call's keys from k / v); the probabilities are rounded to bf16 for
//! the P V tensor-core product.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::Result;

use super::Operands;
use crate::device::CudaBackend;
use crate::kernels::allow_shared;
use crate::launch::{i32_of, launched};
use crate::limits::FA_BN;

/// Warps per block and 16-row tiles per warp for a head dimension (`FA_KERNEL` in flash_attn.cu).
fn shape(head_dim: usize) -> (usize, usize) {
    match head_dim {
        256 => (8, 1),
        128 => (4, 2),
        _ => (4, 1),
    }
}

/// Heads of one KV group a block takes: the largest power of two dividing the group that leaves
/// each warp's rows inside one head.
fn heads_per_block(group: usize, warps: usize) -> usize {
    let mut h = 1;
    while h * 2 <= warps && group.is_multiple_of(h * 2) {
        h *= 2;
    }
    h
}

/// Dynamic shared memory (bytes) of a block: its query rows and one K and one V tile.
fn shared_bytes(head_dim: usize) -> usize {
    let (warps, tiles) = shape(head_dim);
    (16 * tiles * warps + 2 * FA_BN) * head_dim * 2
}

/// Whether the flash kernel takes this call on a device whose blocks may use `max_shared` bytes
/// of shared memory (d = 256 needs 128 KiB: not sm_86 / sm_89, whose calls take the simple kernel).
pub(crate) fn fits(t: usize, head_dim: usize, max_shared: usize) -> bool {
    t > 1 && matches!(head_dim, 64 | 128 | 256) && shared_bytes(head_dim) <= max_shared
}

/// Key splits for `blocks` blocks of queries that see up to `keys` keys each: one, unless the
/// blocks are too few to fill the device (a short prompt chunk over a long cached context), then
/// enough for about two blocks per multiprocessor, each at least MIN_SPLIT_TILES key tiles.
pub(crate) fn splits(blocks: usize, keys: usize, sm_count: usize) -> usize {
    const MIN_SPLIT_TILES: usize = 4;
    let by_device = (2 * sm_count).div_ceil(blocks.max(1));
    let by_keys = keys.div_ceil(FA_BN) / MIN_SPLIT_TILES;
    by_device.min(by_keys).max(1)
}

/// Shapes as the attention op checked them: `t` queries from position `start`, `window` 0 for none,
/// over the block table at `table`. Several key splits (`splits`) merge through attn_dec_combine.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    b: &CudaBackend,
    p: &Operands,
    table: u64,
    t: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    start: usize,
    window: usize,
    scale: f32,
) -> Result<()> {
    let (f, name) = match head_dim {
        64 => (&b.k().flash_attn_d64, "flash_attn_d64"),
        128 => (&b.k().flash_attn_d128, "flash_attn_d128"),
        _ => (&b.k().flash_attn_d256, "flash_attn_d256"),
    };
    let (warps, tiles) = shape(head_dim);
    let rows = 16 * tiles * warps;
    let hpb = heads_per_block(q_heads / kv_heads, warps);
    let queries = rows / hpb;
    let shared = shared_bytes(head_dim);
    allow_shared(f, shared, name)?;
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let bq_log2 = queries.trailing_zeros() as i32;
    let (ti, hq, hkv, si, wi) = (
        i32_of(t, "tokens")?,
        i32_of(q_heads, "heads")?,
        i32_of(kv_heads, "kv heads")?,
        i32_of(start, "position")?,
        i32_of(window, "window")?,
    );
    let mut l = b.stream().launch_builder(f);
    l.arg(&p.out)
        .arg(&p.q)
        .arg(&p.k)
        .arg(&p.v)
        .arg(&p.kc)
        .arg(&p.vc)
        .arg(&table)
        .arg(&ti)
        .arg(&hq)
        .arg(&hkv)
        .arg(&si)
        .arg(&wi)
        .arg(&scale_log2)
        .arg(&bq_log2);
    let blocks = t.div_ceil(queries) * (q_heads / hpb);
    let keys = if window > 0 { window.min(start + t) } else { start + t };
    let splits = splits(blocks, keys, b.k().sm_count);
    let part = if splits > 1 { Some(b.buffer(t * q_heads * splits * (head_dim + 2) * 4)?) } else { None };
    let part_ptr = part.as_ref().map_or(0, |p| p.ptr());
    l.arg(&part_ptr);
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(queries) as u32, (q_heads / hpb) as u32, splits as u32),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    // SAFETY: flash_attn_d{D}(bf16* out, const bf16* q, k, v, const bf16* kc, const bf16* vc,
    // const int* table, int t, int q_heads, int kv_heads, int start, int window, float scale_log2,
    // int bq_log2, float* part) with D = head_dim and (WARPS, MI) = shape(D): one block per
    // 2^bq_log2 = 16 * MI
    // * WARPS / hpb queries (at least 16 * MI: hpb <= WARPS) and hpb heads of one group (hpb
    // divides q_heads / kv_heads), (16 * MI * WARPS + 2 * 64) * D bf16 of shared memory (allowed
    // above); out/q hold t * q_heads * D values, k/v t * kv_heads * D, and the table names a block
    // of the pool layer for every position before `start` a query can see (the attention op
    // checked it); q_heads % kv_heads == 0; with `splits` > 1 z-blocks, part holds t * q_heads *
    // splits * (D + 2) floats (else it is null and out is written).
    launched(unsafe { l.launch(cfg) }, name)?;
    match part {
        Some(part) => super::decode::combine(b, p.out, part.ptr(), t * q_heads, head_dim, splits),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::{fits, heads_per_block, splits};

    #[test]
    fn head_dims_whose_blocks_exceed_the_device_take_the_simple_kernel() {
        let (h200, ada) = (232_448, 101_376);
        assert!(fits(100, 256, h200) && fits(100, 128, h200) && fits(100, 64, h200));
        assert!(!fits(100, 256, ada) && fits(100, 128, ada));
        assert!(!fits(1, 128, h200) && !fits(100, 96, h200));
    }

    #[test]
    fn a_block_takes_whole_warps_of_one_head() {
        assert_eq!(heads_per_block(8, 8), 8);
        assert_eq!(heads_per_block(8, 4), 4);
        assert_eq!(heads_per_block(6, 8), 2);
        assert_eq!(heads_per_block(1, 8), 1);
        assert_eq!(heads_per_block(16, 8), 8);
        assert_eq!(heads_per_block(3, 4), 1);
    }

    #[test]
    fn only_chunks_too_small_for_the_device_split_their_keys() {
        // Qwen3.5 (d = 256, 16 heads of 2 groups: 2 head blocks) on 132 multiprocessors.
        assert_eq!(splits(2 * 512, 8192, 132), 1, "a whole prompt fills the device");
        assert_eq!(splits(2 * 2, 8224, 132), 32, "32 queries over 8k keys: 4 tiles a split at most");
        assert_eq!(splits(2, 300, 132), 1, "too few keys to split");
    }
}
