//! How a router's logits become choices on the device: `RouteArgs`, the `#[repr(C)]` twin of
//! kernels/route.cuh's struct, which every MoE path's routing kernel takes.

use cudarc::driver::DeviceRepr;
use vt_core::{Result, Router, RouterKind};

use crate::device::CudaBackend;
use crate::launch::i32_of;
use crate::weight::float_code;

/// `struct RouteArgs` of kernels/route.cuh: how a router's logits become choices (every MoE
/// path's routing kernel takes it).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RouteArgs {
    bias: u64,
    bias_dt: i32,
    kind: i32,
    renorm: i32,
    top_k: i32,
    n_exp: i32,
    softcap: f32,
    scaling: f32,
    pad: i32,
}

// SAFETY: #[repr(C)] plain data laid out as the CUDA struct (u64, 6 x 4-byte fields, pad: 40
// bytes, 8-byte aligned, no implicit padding).
unsafe impl DeviceRepr for RouteArgs {}

impl RouteArgs {
    /// `router`'s routing over `n_exp` experts, for a router `check::moe` took (a positive
    /// softcap, a correction bias of `n_exp` values); `op` names the errors.
    pub(crate) fn new(router: &Router<CudaBackend>, n_exp: usize, op: &str) -> Result<Self> {
        let (kind, renorm, softcap, scaling) = match router.kind {
            RouterKind::Softmax { renormalize, .. } => (0, renormalize, 0.0, 1.0),
            RouterKind::Sigmoid { softcap, renormalize, routed_scaling, .. } => {
                (1, renormalize, softcap.unwrap_or(0.0), routed_scaling)
            }
        };
        let (bias, bias_dt) = match &router.correction_bias {
            Some(c) => (c.buffer().ptr(), float_code(c, op)?),
            None => (0, 0),
        };
        Ok(RouteArgs {
            bias,
            bias_dt,
            kind,
            renorm: renorm as i32,
            top_k: i32_of(router.kind.top_k(), "top-k")?,
            n_exp: i32_of(n_exp, "experts")?,
            softcap,
            scaling,
            pad: 0,
        })
    }
}

/// The C struct's layout is this one's (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    crate::kernels::c_layout!(RouteArgs { bias, bias_dt, kind, renorm, top_k, n_exp, softcap, scaling, pad })
}
