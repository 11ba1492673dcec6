//! Linear layers for the few tokens of a decode step (kernels/gemv.cu): each weight row is
//! streamed once with 16-byte loads and dotted with every token, where cuBLASLt's GEMMs would pay a
//! heuristic query per call and tile shapes made for many tokens.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use vt_core::{DType, Result, Weight};

use crate::backend::{i32_of, launched};
use crate::weight::WeightDesc;
use crate::CudaBackend;

/// Most tokens of one GEMV call (`GEMV_MAX_T`).
pub(crate) const MAX_T: usize = 8;
/// Rows per block: 4 warps of `GEMV_ROWS` = 2 rows.
const ROWS_PER_BLOCK: usize = 8;

/// Whether the GEMV kernels take `w` (bf16 rows of whole 16-byte chunks, or NVFP4 rows of whole
/// 32-code chunks) for `t` tokens; if so, which kernel.
fn kernel_for<'a>(b: &'a CudaBackend, w: &Weight<CudaBackend>, t: usize) -> Option<&'a CudaFunction> {
    let k = w.dims().1;
    match w {
        _ if t == 0 || t > MAX_T => None,
        Weight::Dense(d) if d.dtype() == DType::BF16 && k % 8 == 0 => Some(&b.k().gemv_bf16),
        Weight::Nvfp4(_) if k % 32 == 0 => Some(&b.k().gemv_nvfp4),
        _ => None,
    }
}

/// `y [t, n] = x [t, k] · Wᵀ` when the GEMV kernels take this weight and batch; `false` leaves
/// `y` untouched for another path. `x` and `y` are device addresses of `t * k` and `t * n` bf16
/// values, alive until the stream has run (the caller's tensors).
pub(crate) fn gemv(b: &CudaBackend, x: u64, t: usize, w: &Weight<CudaBackend>, y: u64) -> Result<bool> {
    let Some(f) = kernel_for(b, w, t) else { return Ok(false) };
    let n = w.dims().0;
    let desc = WeightDesc::of(w, "linear")?;
    let (ni, ti) = (i32_of(n, "linear outputs")?, t as i32);
    let mut l = b.stream().launch_builder(f);
    l.arg(&y).arg(&x).arg(&desc).arg(&ni).arg(&ti);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: gemv_bf16/gemv_nvfp4(bf16* y, const bf16* x, WeightDesc w, int n, int t): 128
    // threads, 8 rows per block covering n; t <= GEMV_MAX_T; desc describes the live [n, k]
    // weight whose rows are whole 16-byte chunks (kernel_for); x holds t * k, y t * n values.
    launched(unsafe { l.launch(cfg) }, "gemv")?;
    Ok(true)
}
