//! Attention of one query token over its sequence's KV cache (kernels/attn_decode.cu): the cached
//! positions are split over blocks (64 each, more for long caches) whose partial softmax results a
//! second kernel merges, so decode reads the cache at memory speed whatever its length. The split
//! kernel also writes the step's own key and value into the cache. Head dims 64, 128 and 256 run
//! on tensor cores.

use cudarc::driver::{CudaFunction, LaunchConfig};
use vt_core::Result;

use crate::device::CudaBackend;
use crate::kernels::allow_shared;
use crate::launch::{i32_of, Overlapped};
use crate::limits::{ATT_DEC_COMBINE_THREADS, ATT_DEC_MAX_D, SEQ_MAX};

/// The shortest split (positions).
const SPLIT: usize = 64;

pub(crate) fn fits(t: usize, head_dim: usize) -> bool {
    t == 1 && head_dim.is_multiple_of(8) && head_dim <= ATT_DEC_MAX_D
}

/// Device addresses of one decode call: out and q `[1, q_heads, d]`, k and v `[1, kv_heads, d]`,
/// the sequence's keys and values (rows of `kv_heads * d`, kv.rs's `Rows`).
pub(crate) struct Operands {
    pub out: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub kc: u64,
    pub vc: u64,
}

/// Where a recorded step reads its position, and the cache rows it sizes the splits for.
pub(crate) struct Recorded {
    pub pos: u64,
    pub rows: usize,
}

/// The query sits at position `start`; a window (0: none) limits what it sees.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    b: &CudaBackend,
    o: &Operands,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    start: usize,
    window: usize,
    scale: f32,
    recorded: Option<Recorded>,
) -> Result<()> {
    let visible = visible(start, window);
    let split_kernel = SplitKernel::of(b, d, false)?;
    // A recording covers every position the cache can hold; the splits past the step's visible
    // ones write empty partials.
    let keys = recorded.as_ref().map_or(visible, |r| r.rows.max(visible));
    let head_blocks = split_kernel.head_blocks(q_heads, kv_heads);
    let split = split_kernel.split_len(b, keys, head_blocks);
    let splits = keys.div_ceil(split);
    let start_at = recorded.map_or(0, |r| r.pos);
    let part = b.buffer(q_heads * splits * (d + 2) * 4)?;
    let pp = part.ptr();
    let (hq, hkv, di, si, wi, sl, sp) = (
        i32_of(q_heads, "heads")?,
        i32_of(kv_heads, "kv heads")?,
        d as i32,
        i32_of(start, "position")?,
        i32_of(window, "window")?,
        split as i32,
        i32_of(splits, "splits")?,
    );
    let mut l = Overlapped::new(b, split_kernel.f);
    l.arg(&pp)
        .arg(&o.q)
        .arg(&o.k)
        .arg(&o.v)
        .arg(&o.kc)
        .arg(&o.vc)
        .arg(&hq)
        .arg(&hkv)
        .arg(&di)
        .arg(&si)
        .arg(&start_at)
        .arg(&wi)
        .arg(&scale)
        .arg(&sl)
        .arg(&sp);
    let cfg = split_kernel.config(splits, head_blocks, 1);
    // SAFETY: attn_dec_split_h{H} / attn_dec_mma_d{d}(float* part, q, k, v, kc, vc, int q_heads,
    // int kv_heads, int d, int start, const int* start_at, int window, float scale, int split, int
    // splits) with H = split_kernel.heads: grid (splits, kv_heads * ceil(group / H)) of 128 threads
    // with the kernel's dynamic shared memory (allowed by SplitKernel::of), splits of `split` (a
    // multiple of 64) positions covering the `visible` ones, and every query head (q_heads %
    // kv_heads == 0, the attention op checked it); d % 8 == 0 and d <= 256 (fits); q [1, q_heads,
    // d], k/v [1, kv_heads, d]; the cache holds every earlier visible position and has a row
    // for `start`, which the kernel writes (Rows::of: the table covers it); part holds
    // q_heads * splits * (d + 2) floats; start_at is 0 or a recording's position. The kernel starts
    // with grid_dep_begin.
    unsafe { l.launch(cfg, "attn_dec_split")? };
    combine(b, o.out, pp, q_heads, d, splits)
}

/// One token of each of `kv.starts.len()` (at most `SEQ_MAX`) sequences: row `i` of the operands
/// is sequence `i`'s, over its cache `(kv.keys[i], kv.values[i])` at position `kv.starts[i]`.
/// `o.kc` and `o.vc` are not read.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_seqs(
    b: &CudaBackend,
    o: &Operands,
    kv: &SeqCaches,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    window: usize,
    scale: f32,
) -> Result<()> {
    let seqs = kv.len;
    let split_kernel = SplitKernel::of(b, d, true)?;
    let keys = kv.starts[..seqs].iter().map(|&s| visible(s as usize, window)).max().unwrap_or(1);
    let head_blocks = split_kernel.head_blocks(q_heads, kv_heads);
    let split = split_kernel.split_len(b, keys, seqs * head_blocks);
    let splits = keys.div_ceil(split);
    let part = b.buffer(seqs * q_heads * splits * (d + 2) * 4)?;
    let pp = part.ptr();
    let (hq, hkv, di, wi, sl, sp) = (
        i32_of(q_heads, "heads")?,
        i32_of(kv_heads, "kv heads")?,
        d as i32,
        i32_of(window, "window")?,
        split as i32,
        i32_of(splits, "splits")?,
    );
    let mut l = Overlapped::new(b, split_kernel.f);
    l.arg(&pp).arg(&o.q).arg(&o.k).arg(&o.v).arg(&kv.keys).arg(&kv.values).arg(&kv.starts);
    l.arg(&hq).arg(&hkv).arg(&di).arg(&wi).arg(&scale).arg(&sl).arg(&sp);
    let cfg = split_kernel.config(splits, head_blocks, seqs);
    // SAFETY: attn_dec_split_seqs_h{H} / attn_dec_mma_seqs_d{d}(float* part, q, k, v, SeqPtrs kc,
    // SeqPtrs vc, SeqInts start, int q_heads, int kv_heads, int d, int window, float scale, int
    // split, int splits) with H = split_kernel.heads: grid (splits, kv_heads * ceil(group / H),
    // seqs <= SEQ_MAX) of 128 threads with the kernel's dynamic shared memory (allowed by
    // SplitKernel::of), each cache's row for its start written by the kernel, the splits covering
    // every sequence's visible positions; q [seqs, q_heads, d], k/v [seqs, kv_heads, d]; cache i
    // (kv.keys[i], kv.values[i]) holds every earlier visible position of sequence i and room for
    // start i (Rows::of: the table covers it); part holds seqs * q_heads * splits * (d + 2) floats;
    // q_heads % kv_heads == 0, d % 8 == 0 and d <= 256 (the op and fits checked). The kernel starts
    // with grid_dep_begin.
    unsafe { l.launch(cfg, "attn_dec_split_seqs")? };
    // Each sequence's heads' partials follow the previous sequence's: seqs * q_heads heads to
    // merge.
    combine(b, o.out, pp, seqs * q_heads, d, splits)
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
    /// kernel, 4 heads a block up to d = 128 and 1 above (`seqs`: the batched variants).
    fn of(b: &'a CudaBackend, d: usize, seqs: bool) -> Result<Self> {
        let k = b.k();
        let mma = match (d, seqs) {
            (64, false) => Some(&k.attn_dec_mma_d64),
            (128, false) => Some(&k.attn_dec_mma_d128),
            (256, false) => Some(&k.attn_dec_mma_d256),
            (64, true) => Some(&k.attn_dec_mma_seqs_d64),
            (128, true) => Some(&k.attn_dec_mma_seqs_d128),
            (256, true) => Some(&k.attn_dec_mma_seqs_d256),
            _ => None,
        };
        if let Some(f) = mma {
            let shared = mma_shared(d);
            allow_shared(f, shared, "attn_dec_mma")?;
            return Ok(SplitKernel { f, heads: 16, shared });
        }
        let (f, heads) = match (d <= 128, seqs) {
            (true, false) => (&k.attn_dec_split_h4, 4),
            (false, false) => (&k.attn_dec_split_h1, 1),
            (true, true) => (&k.attn_dec_split_seqs_h4, 4),
            (false, true) => (&k.attn_dec_split_seqs_h1, 1),
        };
        Ok(SplitKernel { f, heads, shared: 0 })
    }

    /// Positions per split over `keys` positions, for `rows` blocks per split (KV heads' blocks
    /// times sequences): 64, doubled while the launch has more than 4 blocks per SM, so a long
    /// cache is neither a handful of long splits nor waves of short ones (docs/performance.md).
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

/// Per-sequence caches of a batched decode launch, as its kernels take them by value.
pub(crate) struct SeqCaches {
    pub keys: [u64; SEQ_MAX],
    pub values: [u64; SEQ_MAX],
    pub starts: [i32; SEQ_MAX],
    /// Sequences filled in.
    pub len: usize,
}

/// Positions a query at `start` sees: all up to its own, or the last `window` (0: none).
fn visible(start: usize, window: usize) -> usize {
    if window > 0 {
        (start + 1).min(window)
    } else {
        start + 1
    }
}

/// Merges `heads` heads' `splits` partials at `part` into `out`.
fn combine(b: &CudaBackend, out: u64, part: u64, heads: usize, d: usize, splits: usize) -> Result<()> {
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
