//! The routed-experts block for any batch the faster paths do not take (kernels/moe.cu): a block
//! per token computes its router logits and routes them, then a block per (slot, 8 rows) computes
//! each chosen expert's SwiGLU and down projection in f32, and the combine adds the slots in
//! ascending expert order as vt-cpu does. The caller checked the arguments (`check::moe`).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{DType, MoeExperts, Result, Router};

use super::routing::RouteArgs;
use super::table::expert_table;
use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{act, i32_of, launched, MAX_SHARED};
use crate::limits::{ROUTE_MAX_EXP, ROUTE_MAX_K};
use crate::weight::WeightDesc;

pub(crate) fn moe(
    b: &CudaBackend,
    x: &CudaTensor,
    router: &Router<CudaBackend>,
    experts: &MoeExperts<CudaBackend>,
) -> Result<CudaTensor> {
    let op = "moe";
    let (h, inter, n_exp) = (experts.hidden, experts.intermediate, experts.experts.len());
    let top_k = router.kind.top_k();
    check(top_k <= ROUTE_MAX_K && n_exp <= ROUTE_MAX_EXP, op, || {
        format!("top-k {top_k} of {n_exp} experts (the routing takes at most {ROUTE_MAX_EXP} experts)")
    })?;
    let route_shared = (h + n_exp) * 4;
    check(
        route_shared <= MAX_SHARED && inter * 4 <= MAX_SHARED && inter.div_ceil(8) <= 65535 && h.div_ceil(8) <= 65535,
        op,
        || format!("hidden {h}, intermediate {inter}, {n_exp} experts exceed the simple kernels' limits"),
    )?;
    let ra = RouteArgs::new(router, n_exp, op)?;
    let table = expert_table(b, experts)?;
    let px = act(x, op)?;
    let t = x.rows();
    let slots = t * top_k;
    let (ids, weights) = (b.buffer(slots * 4)?, b.buffer(slots * 4)?);
    let (actv, y) = (b.buffer(slots * inter * 4)?, b.buffer(slots * h * 4)?);
    let out = b.empty(DType::BF16, x.shape())?;
    let (pids, pw, pact, py, pout, ptab) =
        (ids.ptr(), weights.ptr(), actv.ptr(), y.ptr(), out.buffer().ptr(), table.descs());
    let (tk, ii, hi) = (top_k as i32, i32_of(inter, "intermediate")?, i32_of(h, "hidden")?);
    let rdesc = WeightDesc::of(&router.weight.weight, op)?;

    let mut l = b.stream().launch_builder(&b.k().moe_route);
    l.arg(&pids).arg(&pw).arg(&px).arg(&rdesc).arg(&ra);
    let cfg =
        LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: route_shared as u32 };
    // SAFETY: moe_route(int* ids, float* weights, const bf16* x, WeightDesc router, RouteArgs
    // ra): one block of 256 threads per token, shared memory as computed; ids/weights hold
    // t * top_k, the router is [n_exp, h] with n_exp <= 512 and top_k <= 32 (checked), ra's bias
    // is null or n_exp values (check::moe).
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
