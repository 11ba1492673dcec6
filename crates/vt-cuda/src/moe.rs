//! The routed-experts block on the device, and the expert table it reads.
//!
//! The table is resident state derived from the experts, built on first use and kept in the
//! `MoeExperts`' own `ResidentSlot`, as vt-cpu does: a device array of `WeightDesc` (gate, up,
//! down) per expert, pointing at the experts' own weights, that the kernels index by expert id.
//! The kernels read gate row u and up row u together as one SwiGLU unit, so no fused copy is
//! needed. NVFP4 experts also get, at their first grouped prefill, a second array over
//! tensor-core repacked copies of the same matrices (w4a16.rs), kept in the same table.

use std::sync::OnceLock;

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use vt_core::{DType, Error, MoeExperts, Result, Router, RouterKind, Tensor};

use crate::alloc::CudaBuffer;
use crate::error::check;
use crate::launch::{act, i32_of, launched, MAX_SHARED};
use crate::limits::{ROUTE_MAX_EXP, ROUTE_MAX_K};
use crate::w4a16::PackedExperts;
use crate::weight::{float_code, WeightDesc};
use crate::CudaBackend;

pub struct CudaExpertTable {
    /// `[experts, 3]` `WeightDesc`s: gate, up, down.
    table: CudaBuffer,
    /// The same, on the host (what the tensor-core layout is derived from).
    host: Vec<[WeightDesc; 3]>,
    /// NVFP4 experts in the tensor-core layout, built at the first grouped prefill.
    packed: OnceLock<PackedExperts>,
}

impl CudaExpertTable {
    /// Device address of the `[experts, 3]` `WeightDesc` array (grouped.rs reads it too).
    pub(crate) fn descs(&self) -> u64 {
        self.table.ptr()
    }

    /// The NVFP4 experts' repacked table (w4a16.rs), built on first use and kept with this one.
    /// Concurrent first uses may both build; one is kept (the other's buffers free in stream
    /// order, after its repack ran).
    pub(crate) fn packed(&self, b: &CudaBackend, inter: usize, hidden: usize) -> Result<&PackedExperts> {
        if let Some(p) = self.packed.get() {
            return Ok(p);
        }
        let built = PackedExperts::new(b, &self.host, inter, hidden)?;
        Ok(self.packed.get_or_init(|| built))
    }
}

pub(crate) fn build_table(b: &CudaBackend, experts: &MoeExperts<CudaBackend>) -> Result<CudaExpertTable> {
    let mut descs = Vec::with_capacity(experts.experts.len());
    for (e, ex) in experts.experts.iter().enumerate() {
        let [gate, up, down] = [&ex.gate, &ex.up, &ex.down].map(|w| WeightDesc::of(w, "moe"));
        let (gate, up) = (gate?, up?);
        if gate.kind != up.kind {
            return Err(Error::tensor(format!("expert {e}"), "gate and up projections must share one storage format"));
        }
        descs.push([gate, up, down?]);
    }
    Ok(CudaExpertTable { table: b.upload_slice(&descs)?, host: descs, packed: OnceLock::new() })
}

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
    /// `router`'s routing over `n_exp` experts; `op` names the errors (a non-positive softcap, a
    /// correction bias of the wrong size).
    pub(crate) fn new(router: &Router<CudaBackend>, n_exp: usize, op: &str) -> Result<Self> {
        let (kind, renorm, softcap, scaling) = match router.kind {
            RouterKind::Softmax { renormalize, .. } => (0, renormalize, 0.0, 1.0),
            RouterKind::Sigmoid { softcap, renormalize, routed_scaling, .. } => {
                let cap = softcap.unwrap_or(0.0);
                check(!softcap.is_some_and(|c| c.is_nan() || c <= 0.0), op, || {
                    format!("router softcap {cap} must be positive")
                })?;
                (1, renormalize, cap, routed_scaling)
            }
        };
        let (bias, bias_dt) = match &router.correction_bias {
            Some(c) => {
                check(c.numel() == n_exp, op, || format!("correction bias {:?} for {n_exp} experts", c.shape()))?;
                (c.buffer().ptr(), float_code(c, op)?)
            }
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

pub(crate) fn moe(
    b: &CudaBackend,
    x: &Tensor<CudaBackend>,
    router: &Router<CudaBackend>,
    experts: &MoeExperts<CudaBackend>,
) -> Result<Tensor<CudaBackend>> {
    let op = "moe";
    let (h, inter, n_exp) = (experts.hidden, experts.intermediate, experts.experts.len());
    let top_k = router.kind.top_k();
    check(x.last_dim() == h && router.weight.out_features() == n_exp && router.weight.in_features() == h, op, || {
        format!(
            "input {:?}, router [{}, {}], {n_exp} experts of hidden {h}",
            x.shape(),
            router.weight.out_features(),
            router.weight.in_features()
        )
    })?;
    check((1..=n_exp.min(ROUTE_MAX_K)).contains(&top_k) && n_exp <= ROUTE_MAX_EXP, op, || {
        format!("top-k {top_k} of {n_exp} experts (the routing takes at most {ROUTE_MAX_EXP} experts)")
    })?;
    let route_shared = (h + n_exp) * 4;
    check(
        route_shared <= MAX_SHARED && inter * 4 <= MAX_SHARED && inter.div_ceil(8) <= 65535 && h.div_ceil(8) <= 65535,
        op,
        || format!("hidden {h}, intermediate {inter}, {n_exp} experts exceed the simple kernels' limits"),
    )?;
    let ra = RouteArgs::new(router, n_exp, op)?;
    let table = experts.resident.get_or_try_init(b, || build_table(b, experts))?;
    let px = act(x, op)?;
    let t = x.rows();
    let slots = t * top_k;
    let (ids, weights) = (b.buffer(slots * 4)?, b.buffer(slots * 4)?);
    let (actv, y) = (b.buffer(slots * inter * 4)?, b.buffer(slots * h * 4)?);
    let out = b.empty(DType::BF16, x.shape())?;
    let (pids, pw, pact, py, pout, ptab) =
        (ids.ptr(), weights.ptr(), actv.ptr(), y.ptr(), out.buffer().ptr(), table.table.ptr());
    let (tk, ii, hi) = (top_k as i32, i32_of(inter, "intermediate")?, i32_of(h, "hidden")?);
    let rdesc = WeightDesc::of(&router.weight.weight, op)?;

    let mut l = b.stream().launch_builder(&b.k().moe_route);
    l.arg(&pids).arg(&pw).arg(&px).arg(&rdesc).arg(&ra);
    let cfg =
        LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: route_shared as u32 };
    // SAFETY: moe_route(int* ids, float* weights, const bf16* x, WeightDesc router, RouteArgs
    // ra): one block of 256 threads per token, shared memory as computed; ids/weights hold
    // t * top_k, the router is [n_exp, h] with n_exp <= 512 and top_k <= 32 (checked), ra's bias
    // is null or n_exp values (RouteArgs::new).
    launched(unsafe { l.launch(cfg) }, "moe_route")?;

    let mut l = b.stream().launch_builder(&b.k().moe_gate_up);
    l.arg(&pact).arg(&px).arg(&pids).arg(&ptab).arg(&tk).arg(&ii);
    let cfg = LaunchConfig {
        grid_dim: (slots as u32, inter.div_ceil(8) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (h * 4) as u32,
    };
    // SAFETY: moe_gate_up(float* act, const bf16* x, const int* ids, const WeightDesc* table,
    // int top_k, int inter): ids < n_exp (written by moe_route), the table has 3 * n_exp entries
    // (gate and up [inter, h], down [h, inter]); act holds slots * inter floats.
    launched(unsafe { l.launch(cfg) }, "moe_gate_up")?;

    let mut l = b.stream().launch_builder(&b.k().moe_down);
    l.arg(&py).arg(&pact).arg(&pids).arg(&ptab).arg(&hi);
    let cfg = LaunchConfig {
        grid_dim: (slots as u32, h.div_ceil(8) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (inter * 4) as u32,
    };
    // SAFETY: moe_down(float* y, const float* act, const int* ids, const WeightDesc* table,
    // int hidden): each down projection is [h, inter]; y holds slots * h floats.
    launched(unsafe { l.launch(cfg) }, "moe_down")?;

    let mut l = b.stream().launch_builder(&b.k().moe_combine);
    l.arg(&pout).arg(&py).arg(&pids).arg(&pw).arg(&tk).arg(&hi);
    let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: moe_combine(bf16* out, const float* y, const int* ids, const float* weights,
    // int top_k, int hidden): one block per token; out is [t, h].
    launched(unsafe { l.launch(cfg) }, "moe_combine")?;
    Ok(out)
}

/// The C struct's layout is this one's (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    crate::kernels::c_layout!(RouteArgs { bias, bias_dt, kind, renorm, top_k, n_exp, softcap, scaling, pad })
}
