//! Attention of one query token of each of n sequences over its positions in the KV pool
//! (kernels/attn_decode.cu): the positions are split over blocks (64 each, more for long
//! sequences) whose partial softmax results a second kernel merges, so decode reads the pool at
//! memory speed whatever the length. The split kernel also writes each step's own key and value
//! into the pool. Head dims 64, 128 and 256 run on tensor cores.

use cudarc::driver::{CudaFunction, LaunchConfig};
use vt_core::Result;

use super::Operands;
use crate::device::CudaBackend;
use crate::error::check;
use crate::kernels::allow_shared;
use crate::launch::{grid1, i32_of, Overlapped};
use crate::limits::{ATT_DEC_COMBINE_THREADS, ATT_DEC_MAX_D};

/// The shortest split (positions).
const SPLIT: usize = 64;

pub(crate) fn fits(t: usize, head_dim: usize) -> bool {
    t == 1 && head_dim.is_multiple_of(8) && head_dim <= ATT_DEC_MAX_D
}

/// The rows of one decode launch, as its kernels read them from device memory.
pub(crate) struct Batch {
    pub n: usize,
    /// The sequences the rows are of: a verification gives a sequence a row for each of its
    /// positions. The splits are chosen for them, as a decode step of those sequences chooses
    /// them, so that each row's arithmetic is that step's.
    pub seqs: usize,
    /// `n` i32 positions: sequence i's query sits at `positions[i]`.
    pub positions: u64,
    /// `n` block tables of `width` i32 entries each.
    pub tables: u64,
    pub width: usize,
    /// The most positions a query of the launch sees (its grid covers them).
    pub keys: usize,
    /// Whether the rows are in the pool already (`append`): rows that continue one another read
    /// the earlier ones from there, and the split kernels write none.
    pub appended: bool,
}

/// Row `i` of the operands (`out`, `q` `[n, q_heads, d]`, `k`, `v` `[n, kv_heads, d]`) is
/// sequence `i`'s, over the pool layer `o.kc`, `o.vc`; a window (0: none) limits what each sees.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    b: &CudaBackend,
    o: &Operands,
    batch: &Batch,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    window: usize,
    scale: f32,
) -> Result<()> {
    let n = batch.n;
    check(n <= u16::MAX as usize, "attention decode", || {
        format!("{n} sequences in one launch (the grid takes 65535)")
    })?;
    let split_kernel = SplitKernel::of(b, d)?;
    let head_blocks = split_kernel.head_blocks(q_heads, kv_heads);
    let split = split_kernel.split_len(b, batch.keys, batch.seqs * head_blocks);
    let splits = batch.keys.div_ceil(split);
    let part = b.buffer(n * q_heads * splits * (d + 2) * 4)?;
    let pp = part.ptr();
    let (width, hq, hkv, di, wi, sl, sp, appended) = (
        i32_of(batch.width, "table width")?,
        i32_of(q_heads, "heads")?,
        i32_of(kv_heads, "kv heads")?,
        d as i32,
        i32_of(window, "window")?,
        split as i32,
        i32_of(splits, "splits")?,
        batch.appended as i32,
    );
    let mut l = Overlapped::new(b, split_kernel.f);
    l.arg(&pp).arg(&o.q).arg(&o.k).arg(&o.v).arg(&o.kc).arg(&o.vc).arg(&batch.tables).arg(&width).arg(&batch.positions);
    l.arg(&hq).arg(&hkv).arg(&di).arg(&wi).arg(&scale).arg(&sl).arg(&sp).arg(&appended);
    let cfg = split_kernel.config(splits, head_blocks, n);
    // SAFETY: attn_dec_split_h{H} / attn_dec_mma_d{d}(float* part, q, k, v, bf16* kc, bf16* vc,
    // const int* tables, int width, const int* pos, int q_heads, int kv_heads, int d, int window,
    // float scale, int split, int splits, int appended) with H = split_kernel.heads: grid
    // (splits, kv_heads * ceil(group / H), n) of 128 threads with the kernel's dynamic shared
    // memory (allowed by SplitKernel::of), splits of `split` (a multiple of 64) positions
    // covering `keys`, the most any row sees; q [n, q_heads, d], k/v [n, kv_heads, d]; n
    // positions at `positions` and n tables of `width` entries at `tables`, each naming a block
    // of the layer for every position its row sees and for its own, which the kernel writes
    // unless `appended` (the caller checked them, and that no two rows write one place); part
    // holds n * q_heads * splits * (d + 2) floats; q_heads % kv_heads == 0, d % 8 == 0 and d <= 256
    // (the op and fits checked). The kernel starts with grid_dep_begin.
    unsafe { l.launch(cfg, "attn_dec_split")? };
    // Each sequence's heads' partials follow the previous sequence's: n * q_heads heads to merge.
    combine(b, o.out, pp, n * q_heads, d, splits)
}

/// Writes the `batch`'s rows of `o.k` and `o.v` (`row` values each) into the pool at their
/// positions, for a launch whose rows continue one another (`Batch::appended`).
pub(crate) fn append(b: &CudaBackend, o: &Operands, batch: &Batch, row: usize) -> Result<()> {
    let (width, n, ri) = (i32_of(batch.width, "table width")?, i32_of(batch.n, "rows")?, i32_of(row, "row")?);
    let mut l = Overlapped::new(b, &b.k().attn_dec_append);
    l.arg(&o.kc).arg(&o.vc).arg(&o.k).arg(&o.v).arg(&batch.tables).arg(&width).arg(&batch.positions).arg(&n).arg(&ri);
    // SAFETY: attn_dec_append(bf16* kc, bf16* vc, const bf16* k, const bf16* v, const int*
    // tables, int width, const int* pos, int n, int row): k and v hold n rows of `row` values (a
    // multiple of 8: d % 8 == 0, fits checked), n positions at `positions` and n tables of
    // `width` entries at `tables`, each naming a block of the layer at its row's position (the
    // caller checked them, and that no two rows write one place); one thread per 8 values. The
    // kernel starts with grid_dep_begin.
    unsafe { l.launch(grid1(batch.n * row / 8), "attn_dec_append") }
}

/// The kernel that writes a decode step's split partials for head dim `d`.
struct SplitKernel<'a> {
    f: &'a CudaFunction,
    /// Query heads of one KV head a block serves.
    heads: usize,
    shared: usize,
}

impl<'a> SplitKernel<'a> {
    /// Tensor cores at d = 64, 128 and 256 (16 heads a block: the MMA's rows); else the CUDA-core
    /// kernel, 4 heads a block up to d = 128 and 1 above.
    fn of(b: &'a CudaBackend, d: usize) -> Result<Self> {
        let k = b.k();
        let mma = match d {
            64 => Some(&k.attn_dec_mma_d64),
            128 => Some(&k.attn_dec_mma_d128),
            256 => Some(&k.attn_dec_mma_d256),
            _ => None,
        };
        if let Some(f) = mma {
            let shared = mma_shared(d);
            allow_shared(f, shared, "attn_dec_mma")?;
            return Ok(SplitKernel { f, heads: 16, shared });
        }
        let (f, heads) = if d <= 128 { (&k.attn_dec_split_h4, 4) } else { (&k.attn_dec_split_h1, 1) };
        Ok(SplitKernel { f, heads, shared: 0 })
    }

    /// Positions per split over `keys` positions, for `rows` blocks per split (KV heads' blocks
    /// times sequences): 64, doubled while the launch has more than 4 blocks per SM, so a long
    /// sequence is neither a handful of long splits nor waves of short ones (docs/performance.md).
    fn split_len(&self, b: &CudaBackend, keys: usize, rows: usize) -> usize {
        let mut split = SPLIT;
        while split < keys && keys.div_ceil(split) * rows > 4 * b.k().sm_count {
            split *= 2;
        }
        split
    }

    /// Blocks per split of one sequence: each KV head's query heads, `heads` a block.
    fn head_blocks(&self, q_heads: usize, kv_heads: usize) -> usize {
        kv_heads * (q_heads / kv_heads).div_ceil(self.heads)
    }

    fn config(&self, splits: usize, head_blocks: usize, seqs: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (splits as u32, head_blocks as u32, seqs as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: self.shared as u32,
        }
    }
}

/// `ATT_MMA_SHARED(d)` of kernels/attn_decode.cu: the 16 query rows and each of the 4 warps' K and
/// V tiles of 16 keys, bf16.
fn mma_shared(d: usize) -> usize {
    16 * d * 2 + 4 * 2 * 16 * d * 2
}

/// Positions a query at `start` sees: all up to its own, or the last `window` (0: none).
pub(crate) fn visible(start: usize, window: usize) -> usize {
    if window > 0 {
        (start + 1).min(window)
    } else {
        start + 1
    }
}

/// Merges `heads` heads' `splits` partials at `part` into `out`.
pub(crate) fn combine(b: &CudaBackend, out: u64, part: u64, heads: usize, d: usize, splits: usize) -> Result<()> {
    let (di, sp) = (d as i32, i32_of(splits, "splits")?);
    let mut l = Overlapped::new(b, &b.k().attn_dec_combine);
    l.arg(&out).arg(&part).arg(&di).arg(&sp);
    // A group of d threads per 8 splits, 256 threads at least, up to ATT_DEC_COMBINE_THREADS: a
    // large block only where there are many splits to share out (docs/performance.md).
    let groups = (splits / 8).clamp(1, ATT_DEC_COMBINE_THREADS / d);
    let threads = (d * groups).max(256).next_multiple_of(32).min(ATT_DEC_COMBINE_THREADS);
    let cfg = LaunchConfig { grid_dim: (heads as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: attn_dec_combine(bf16* out, const float* part, int d, int splits): one block per
    // head of d..=1024 threads (whole warps) over the partials written before it on this stream
    // (heads * splits * (d + 2) floats); out holds heads * d values.
    // The kernel starts with grid_dep_begin.
    unsafe { l.launch(cfg, "attn_dec_combine") }
}

/// The tensor-core kernels' shared memory is what `mma_shared` gives (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    [64, 128, 256].map(|d| crate::kernels::c_equal(&format!("ATT_MMA_SHARED({d})"), mma_shared(d))).to_vec()
}
