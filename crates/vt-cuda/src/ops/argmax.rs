//! Greedy picks on the device (kernels/argmax.cu): many blocks per bf16 row, then one warp per
//! row over their candidates; only the indices are read back.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{DType, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{i32_of, launched};
use crate::limits::ARGMAX_LOADS;

/// Threads of an `argmax_part` block.
const ARGMAX_THREADS: usize = 256;

/// `Backend::argmax_rows`: other dtypes and empty rows take vt-core's composed argmax.
pub(crate) fn argmax_rows(b: &CudaBackend, x: &CudaTensor) -> Result<Vec<u32>> {
    let (rows, n) = (x.rows(), x.last_dim());
    if x.dtype() != DType::BF16 || n == 0 || rows == 0 {
        return vt_core::backend::composed::argmax_rows(b, x);
    }
    // Before the launch: a recorder would keep the kernels in its recording.
    check(b.recording().is_none(), "argmax_rows", || "a recorder runs nothing to read back".into())?;
    // Slices of ARGMAX_THREADS x ARGMAX_LOADS values: a vocabulary-wide row spreads over
    // about one wave of blocks, each thread with a single round of loads.
    let parts = n.div_ceil(ARGMAX_THREADS * ARGMAX_LOADS).clamp(1, 256);
    let (candidates, ids) = (b.buffer(rows * parts * 8)?, b.buffer(rows * 4)?);
    let (pv, px, ni) = (candidates.ptr(), x.buffer().ptr(), i32_of(n, "row width")?);
    let (pi, pout, parts_i) = (pv + (rows * parts * 4) as u64, ids.ptr(), parts as i32);
    let mut l = b.stream().launch_builder(&b.k().argmax_part);
    l.arg(&pv).arg(&pi).arg(&px).arg(&ni);
    let cfg = LaunchConfig {
        grid_dim: (parts as u32, i32_of(rows, "rows")? as u32, 1),
        block_dim: (ARGMAX_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argmax_part(float* cv, int* ci, const bf16* x, int n): grid (parts, rows) of
    // ARGMAX_THREADS threads (whole warps); x holds rows * n bf16 values, cv and ci rows * parts
    // each (the two halves of `candidates`).
    launched(unsafe { l.launch(cfg) }, "argmax_part")?;
    let mut l = b.stream().launch_builder(&b.k().argmax_rows);
    l.arg(&pout).arg(&pv).arg(&pi).arg(&px).arg(&ni).arg(&parts_i);
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: argmax_rows(unsigned* out, const float* cv, const int* ci, const bf16* x, int n,
    // int parts): a warp per row; cv / ci written by argmax_part above on this stream; out
    // holds rows indices.
    launched(unsafe { l.launch(cfg) }, "argmax_rows")?;
    let mut out = vec![0u32; rows];
    b.copy_out(&mut out, &ids, "argmax_rows")?;
    Ok(out)
}
