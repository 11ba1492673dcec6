//! RMSNorm of rows (kernels/norm.cu): alone, after the residual update, or gated.

use cudarc::driver::LaunchConfig;
use vt_core::backend::check;
use vt_core::{DType, NormKind, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::launch::{act, i32_of, Overlapped};
use crate::weight::float_code;

pub(crate) fn rms_norm(
    b: &CudaBackend,
    x: &CudaTensor,
    w: &CudaTensor,
    eps: f32,
    kind: NormKind,
) -> Result<CudaTensor> {
    let d = check::rms_norm(b, x, w)?;
    let (px, pw, wdt) = (act(x, "rms_norm")?, w.buffer().ptr(), float_code(w, "rms_norm")?);
    let offset = kind.weight_offset();
    let out = b.empty(DType::BF16, x.shape())?;
    let (po, di) = (out.buffer().ptr(), i32_of(d, "norm width")?);
    let mut l = Overlapped::new(b, &b.k().rms_norm);
    l.arg(&po).arg(&px).arg(&pw).arg(&wdt).arg(&di).arg(&eps).arg(&offset);
    let cfg = LaunchConfig { grid_dim: (x.rows() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: rms_norm(bf16* out, const bf16* x, const void* w, int wdt, int d, float eps,
    // float offset): one block per row of d values; w holds d values of dtype wdt.
    // The kernel starts with grid_dep_begin.
    unsafe { l.launch(cfg, "rms_norm")? };
    Ok(out)
}

pub(crate) fn rms_norm_gated(
    b: &CudaBackend,
    x: &CudaTensor,
    z: &CudaTensor,
    w: &CudaTensor,
    eps: f32,
) -> Result<CudaTensor> {
    let d = check::rms_norm_gated(b, x, z, w)?;
    let (px, pz, pw, wdt) =
        (act(x, "rms_norm_gated")?, act(z, "rms_norm_gated")?, w.buffer().ptr(), float_code(w, "rms_norm_gated")?);
    let out = b.empty(DType::BF16, x.shape())?;
    let (po, di) = (out.buffer().ptr(), i32_of(d, "norm width")?);
    let mut l = Overlapped::new(b, &b.k().rms_norm_gated);
    l.arg(&po).arg(&px).arg(&pz).arg(&pw).arg(&wdt).arg(&di).arg(&eps);
    let cfg = LaunchConfig { grid_dim: (x.rows() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: rms_norm_gated(bf16* out, const bf16* x, const bf16* z, const void* w, int wdt,
    // int d, float eps): one block per row; x, z, out hold rows * d values, w holds d.
    // The kernel starts with grid_dep_begin.
    unsafe { l.launch(cfg, "rms_norm_gated")? };
    Ok(out)
}

pub(crate) fn add_rms_norm(
    b: &CudaBackend,
    x: &CudaTensor,
    y: &CudaTensor,
    w: &CudaTensor,
    eps: f32,
    kind: NormKind,
) -> Result<(CudaTensor, CudaTensor)> {
    let d = check::add_rms_norm(b, x, y, w)?;
    let (px, py, pw, wdt) =
        (act(x, "add_rms_norm")?, act(y, "add_rms_norm")?, w.buffer().ptr(), float_code(w, "add_rms_norm")?);
    let offset = kind.weight_offset();
    let (sum, out) = (b.empty(DType::BF16, x.shape())?, b.empty(DType::BF16, x.shape())?);
    let (ps, po, di) = (sum.buffer().ptr(), out.buffer().ptr(), i32_of(d, "norm width")?);
    let mut l = Overlapped::new(b, &b.k().add_rms_norm);
    l.arg(&ps).arg(&po).arg(&px).arg(&py).arg(&pw).arg(&wdt).arg(&di).arg(&eps).arg(&offset);
    let cfg = LaunchConfig { grid_dim: (x.rows() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: add_rms_norm(bf16* sum, bf16* out, const bf16* x, const bf16* y, const void* w,
    // int wdt, int d, float eps, float offset): one block per row of d values; x, y, sum, out
    // hold rows * d values (one shape, checked), w holds d values of dtype wdt.
    // The kernel starts with grid_dep_begin.
    unsafe { l.launch(cfg, "add_rms_norm")? };
    Ok((sum, out))
}
