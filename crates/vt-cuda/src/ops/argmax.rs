//! Greedy picks on the device (kernels/argmax.cu): many blocks per bf16 row, then one warp per
//! row over their candidates; only the indices and the rows' not-finite flags are read back, or
//! none of it where the embedding of the picks is what is wanted (`embed_argmax`). A
//! grammar's masks go up as bitsets (31 KB a row at a 248k vocabulary), never the rows down.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::backend::composed::{check_allowed, mask_words};
use vt_core::backend::Pick;
use vt_core::{DType, Result};

use crate::alloc::CudaBuffer;
use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{i32_of, launched};
use crate::limits::ARGMAX_LOADS;
use crate::ops::elementwise::embed_rows;

/// Threads of an `argmax_part` block.
const ARGMAX_THREADS: usize = 256;

/// `Backend::argmax_rows`: other dtypes take vt-core's composed argmax.
pub(crate) fn argmax_rows(b: &CudaBackend, x: &CudaTensor, allowed: Option<&[u32]>) -> Result<Vec<Pick>> {
    let rows = x.rows();
    check_allowed(x, allowed)?;
    if x.dtype() != DType::BF16 || rows == 0 {
        return vt_core::backend::composed::argmax_rows(b, x, allowed);
    }
    // Before the launch: a recorder would keep the kernels in its recording.
    check(b.recording().is_none(), "argmax_rows", || "a recorder runs nothing to read back".into())?;
    let out = picks(b, x, allowed)?;
    let mut words = vec![0u32; 2 * rows];
    b.copy_out(&mut words, &out, "argmax_rows")?;
    let (ids, bad) = words.split_at(rows);
    Ok(ids.iter().zip(bad).map(|(&id, &bad)| Pick { id, finite: bad == 0 }).collect())
}

/// `FusedOps::embed_argmax`: the picks stay on the device, where the embedding kernel reads them.
pub(crate) fn embed_argmax(b: &CudaBackend, table: &CudaTensor, logits: &CudaTensor) -> Result<CudaTensor> {
    vt_core::backend::check::embed_argmax(b, table, logits)?;
    if logits.dtype() != DType::BF16 || logits.rows() == 0 {
        return vt_core::backend::composed::embed_argmax(b, table, logits);
    }
    let out = picks(b, logits, None)?;
    // The ids are the first `rows` words; each is below the logits' width, within the table.
    let rows = embed_rows(b, table, out.ptr(), logits.rows());
    drop(out); // freed in stream order, after the embedding kernel
    rows
}

/// Queues the picks of bf16 `x` (not empty) -> `2 * rows` words: each row's pick, then whether
/// the row holds a value that is not finite (1) or not (0).
fn picks(b: &CudaBackend, x: &CudaTensor, allowed: Option<&[u32]>) -> Result<CudaBuffer> {
    let (rows, n) = (x.rows(), x.last_dim());
    // Slices of ARGMAX_THREADS x ARGMAX_LOADS values: a vocabulary-wide row spreads over
    // about one wave of blocks, each thread with a single round of loads.
    let parts = n.div_ceil(ARGMAX_THREADS * ARGMAX_LOADS).clamp(1, 256);
    let masks = allowed.map(|a| b.upload_slice(a)).transpose()?;
    let pa = masks.as_ref().map_or(0, |m| m.ptr());
    let (candidates, out) = (b.buffer(rows * parts * 12)?, b.buffer(rows * 8)?);
    let (pv, px, ni, wi) =
        (candidates.ptr(), x.buffer().ptr(), i32_of(n, "row width")?, i32_of(mask_words(n), "mask words")?);
    let (pi, pbad) = (pv + (rows * parts * 4) as u64, pv + (rows * parts * 8) as u64);
    let (pout, parts_i) = (out.ptr(), parts as i32);
    let mut l = b.stream().launch_builder(&b.k().argmax_part);
    l.arg(&pv).arg(&pi).arg(&pbad).arg(&px).arg(&pa).arg(&ni).arg(&wi);
    let cfg = LaunchConfig {
        grid_dim: (parts as u32, i32_of(rows, "rows")? as u32, 1),
        block_dim: (ARGMAX_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argmax_part(float* cv, int* ci, int* cbad, const bf16* x, const unsigned* allowed,
    // int n, int words): grid (parts, rows) of ARGMAX_THREADS threads (whole warps); x holds
    // rows * n bf16 values, allowed (null or) rows * words (checked by the caller), cv, ci and cbad
    // rows * parts each (the three thirds of `candidates`).
    launched(unsafe { l.launch(cfg) }, "argmax_part")?;
    let mut l = b.stream().launch_builder(&b.k().argmax_rows);
    l.arg(&pout).arg(&pv).arg(&pi).arg(&pbad).arg(&px).arg(&pa).arg(&ni).arg(&wi).arg(&parts_i);
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: argmax_rows(unsigned* out, const float* cv, const int* ci, const int* cbad,
    // const bf16* x, const unsigned* allowed, int n, int words, int parts): a warp per row;
    // cv / ci / cbad written by argmax_part above on this stream; out holds 2 * rows words.
    launched(unsafe { l.launch(cfg) }, "argmax_rows")?;
    Ok(out)
}
