//! Logprobs of generated tokens on the device (kernels/logprobs.cu): one block per bf16 row
//! reduces the row to its log-sum-exp, the chosen token's log-probability and the top k; only
//! those are read back, never the vocabulary-wide row.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::backend::TokenLogprobs;
use vt_core::{DType, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{i32_of, launched};

/// Threads of a `top_logprobs` block: a vocabulary-wide row is k + 2 passes of ~150 values each.
const THREADS: usize = 1024;

/// `Device::top_logprobs_rows`: other dtypes and empty rows take vt-core's composed default.
pub(crate) fn top_logprobs_rows(
    b: &CudaBackend,
    x: &CudaTensor,
    chosen: &[u32],
    k: usize,
) -> Result<Vec<TokenLogprobs>> {
    let (rows, n) = (x.rows(), x.last_dim());
    if x.dtype() != DType::BF16 || n == 0 || rows == 0 || chosen.len() != rows {
        return vt_core::backend::composed::top_logprobs_rows(b, x, chosen, k);
    }
    // Before the launch: a recorder would keep the kernel in its recording.
    check(b.recording().is_none(), "top_logprobs_rows", || "a recorder runs nothing to read back".into())?;
    let k = k.min(n);
    let chosen_in = b.upload_slice(chosen)?;
    // One buffer, one read back: the rows' k + 1 logprobs, then their k ids.
    let out = b.buffer(rows * (2 * k + 1) * 4)?;
    launch(b, x, chosen_in.ptr(), None, rows, k, out.ptr())?;
    let mut words = vec![0u32; rows * (2 * k + 1)];
    b.copy_out(&mut words, &out, "top_logprobs_rows")?;
    Ok(unpack(&words, rows, k))
}

/// Launches `top_logprobs` for `blocks` chosen ids (device address `chosen`) of rows of `x` (block
/// r reads row `rows[r]`, a device address; row r without), writing `blocks * (2 k + 1)` words
/// at `out` as `unpack` reads them. `x` is BF16, `k` at most its width.
pub(crate) fn launch(
    b: &CudaBackend,
    x: &CudaTensor,
    chosen: u64,
    rows: Option<u64>,
    blocks: usize,
    k: usize,
    out: u64,
) -> Result<()> {
    let (plp, px, pr) = (out, x.buffer().ptr(), rows.unwrap_or(0));
    let pid = plp + (blocks * (k + 1) * 4) as u64;
    let (ni, ki) = (i32_of(x.last_dim(), "row width")?, i32_of(k, "top_logprobs")?);
    let mut l = b.stream().launch_builder(&b.k().top_logprobs);
    l.arg(&plp).arg(&pid).arg(&px).arg(&chosen).arg(&pr).arg(&ni).arg(&ki);
    let cfg = LaunchConfig {
        grid_dim: (i32_of(blocks, "rows")? as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: top_logprobs(float* lp_out, int* id_out, const bf16* x, const unsigned* chosen,
    // const int* rows, int n, int k): one block of THREADS threads (whole warps, at most 1024)
    // per chosen id; x holds x.rows() * n bf16 values and rows (null or) `blocks` indices below
    // x.rows() (the callers' checks), chosen `blocks` ids, lp_out blocks * (k + 1) floats and
    // id_out blocks * k ints.
    launched(unsafe { l.launch(cfg) }, "top_logprobs")
}

/// The logprobs of `blocks` picks from `launch`'s words.
pub(crate) fn unpack(words: &[u32], blocks: usize, k: usize) -> Vec<TokenLogprobs> {
    let (lps, ids) = words.split_at(blocks * (k + 1));
    (0..blocks)
        .map(|r| {
            let row = &lps[r * (k + 1)..(r + 1) * (k + 1)];
            // A row with fewer than k values that are not NaN ends its ids with -1.
            let top = (0..k).map(|j| (ids[r * k + j], f32::from_bits(row[1 + j]))).filter(|t| t.0 != u32::MAX);
            TokenLogprobs { logprob: f32::from_bits(row[0]), top: top.collect() }
        })
        .collect()
}
