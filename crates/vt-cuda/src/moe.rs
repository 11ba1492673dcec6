//! The routed-experts block on the device, and the expert table it reads.
//!
//! The table is resident state derived from the experts, built on first use and kept in the
//! `MoeExperts`' own `ResidentSlot`, as vt-cpu does: each expert's gate and up rows repacked
//! pairwise into one matrix (one pass over the input yields both halves of each SwiGLU unit) and a
//! device array of `WeightDesc` (fused gate/up, down) per expert that the kernels index by expert
//! id. The array points into the fused copies and into each expert's own down projection. NVFP4
//! experts also get, at their first grouped prefill, a second array over tensor-core repacked
//! copies of the same matrices (w4a16.rs), kept in the same table.

use std::sync::OnceLock;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{DType, Error, MoeExperts, Result, Router, RouterKind, Tensor, Weight, NVFP4_GROUP};

use crate::alloc::CudaBuffer;
use crate::backend::{act, check, grid1, i32_of, launched, MAX_SHARED, MAX_TOP_K};
use crate::w4a16::PackedExperts;
use crate::weight::{float_code, WeightDesc, DT_NVFP4};
use crate::CudaBackend;

pub struct CudaExpertTable {
    /// Interleaved gate/up codes (and scales for NVFP4) of every expert.
    _fused: Vec<CudaBuffer>,
    /// `[experts, 2]` `WeightDesc`s: fused gate/up, down.
    table: CudaBuffer,
    /// The same, on the host (what the tensor-core layout is derived from).
    host: Vec<WeightDesc>,
    /// NVFP4 experts in the tensor-core layout, built at the first grouped prefill.
    packed: OnceLock<PackedExperts>,
}

impl CudaExpertTable {
    /// Device address of the `[experts, 2]` `WeightDesc` array (grouped.rs reads it too).
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

/// Rows of `a` and `b` (each `rows` rows of `row_bytes`) interleaved into a new buffer.
fn interleave(
    b: &CudaBackend,
    a: &Tensor<CudaBackend>,
    u: &Tensor<CudaBackend>,
    rows: usize,
    row_bytes: usize,
) -> Result<CudaBuffer> {
    let dst = b.buffer(2 * rows * row_bytes)?;
    let (pd, pa, pu, r, rb) = (dst.ptr(), a.buffer().ptr(), u.buffer().ptr(), rows as i64, row_bytes as i64);
    let mut l = b.stream().launch_builder(&b.k().interleave_rows);
    l.arg(&pd).arg(&pa).arg(&pu).arg(&r).arg(&rb);
    // SAFETY: interleave_rows(unsigned char* dst, const unsigned char* a, const unsigned char* b,
    // long long rows, long long row_bytes): a and b hold rows * row_bytes bytes each (validated
    // weights of one shape and format), dst twice that.
    launched(unsafe { l.launch(grid1(2 * rows * row_bytes)) }, "interleave_rows")?;
    Ok(dst)
}

pub(crate) fn build_table(b: &CudaBackend, experts: &MoeExperts<CudaBackend>) -> Result<CudaExpertTable> {
    let (inter, hidden) = (experts.intermediate, experts.hidden);
    let mut fused = Vec::new();
    let mut descs = Vec::with_capacity(2 * experts.experts.len());
    for (e, ex) in experts.experts.iter().enumerate() {
        let gu = match (&ex.gate, &ex.up) {
            (Weight::Dense(g), Weight::Dense(u)) if g.dtype() == u.dtype() => {
                let row = g.dtype().bytes_for(hidden).expect("validated");
                let codes = interleave(b, g, u, inter, row)?;
                let desc = WeightDesc {
                    data: codes.ptr(),
                    scales: 0,
                    global: [1.0; 2],
                    kind: float_code(g, "moe")?,
                    k: hidden as i32,
                };
                fused.push(codes);
                desc
            }
            (Weight::Nvfp4(g), Weight::Nvfp4(u)) => {
                let codes = interleave(b, &g.codes, &u.codes, inter, hidden / 2)?;
                let scales = interleave(b, &g.scales, &u.scales, inter, hidden / NVFP4_GROUP)?;
                let desc = WeightDesc {
                    data: codes.ptr(),
                    scales: scales.ptr(),
                    global: [g.global_scale, u.global_scale],
                    kind: DT_NVFP4,
                    k: hidden as i32,
                };
                fused.extend([codes, scales]);
                desc
            }
            _ => {
                return Err(Error::tensor(
                    format!("expert {e}"),
                    "gate and up projections must share one storage format",
                ))
            }
        };
        descs.extend([gu, WeightDesc::of(&ex.down, "moe")?]);
    }
    Ok(CudaExpertTable { _fused: fused, table: b.upload_slice(&descs)?, host: descs, packed: OnceLock::new() })
}

/// The routing kernel's `kind`, renormalisation, softcap and scaling for a router.
pub(crate) fn router_args(kind: &RouterKind) -> Result<(i32, i32, f32, f32)> {
    Ok(match *kind {
        RouterKind::Softmax { renormalize, .. } => (0, renormalize as i32, 0.0, 1.0),
        RouterKind::Sigmoid { softcap, renormalize, routed_scaling, .. } => {
            let cap = softcap.unwrap_or(0.0);
            if softcap.is_some_and(|c| c.is_nan() || c <= 0.0) {
                return Err(Error::backend("cuda", format!("moe: router softcap {cap} must be positive")));
            }
            (1, renormalize as i32, cap, routed_scaling)
        }
    })
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
    check((1..=n_exp.min(MAX_TOP_K)).contains(&top_k), op, || format!("top-k {top_k} with {n_exp} experts"))?;
    let route_shared = (h + 2 * n_exp) * 4 + n_exp;
    check(
        route_shared <= MAX_SHARED && inter * 4 <= MAX_SHARED && inter.div_ceil(8) <= 65535 && h.div_ceil(8) <= 65535,
        op,
        || format!("hidden {h}, intermediate {inter}, {n_exp} experts exceed the simple kernels' limits"),
    )?;
    let (kind, renorm, softcap, scaling) = router_args(&router.kind)?;
    let (bias, bias_dt) = match &router.correction_bias {
        Some(t) => {
            check(t.numel() == n_exp, op, || format!("correction bias {:?} for {n_exp} experts", t.shape()))?;
            (t.buffer().ptr(), float_code(t, op)?)
        }
        None => (0u64, 0i32),
    };
    let table = experts.resident.get_or_try_init(b, || build_table(b, experts))?;
    let px = act(x, op)?;
    let t = x.rows();
    let slots = t * top_k;
    let (ids, weights) = (b.buffer(slots * 4)?, b.buffer(slots * 4)?);
    let (actv, y) = (b.buffer(slots * inter * 4)?, b.buffer(slots * h * 4)?);
    let out = b.empty(DType::BF16, x.shape())?;
    let (pids, pw, pact, py, pout, ptab) =
        (ids.ptr(), weights.ptr(), actv.ptr(), y.ptr(), out.buffer().ptr(), table.table.ptr());
    let (ne, tk, ii, hi) =
        (i32_of(n_exp, "experts")?, top_k as i32, i32_of(inter, "intermediate")?, i32_of(h, "hidden")?);
    let rdesc = WeightDesc::of(&router.weight.weight, op)?;

    let mut l = b.stream().launch_builder(&b.k().moe_route);
    l.arg(&pids)
        .arg(&pw)
        .arg(&px)
        .arg(&rdesc)
        .arg(&ne)
        .arg(&tk)
        .arg(&kind)
        .arg(&renorm)
        .arg(&softcap)
        .arg(&bias)
        .arg(&bias_dt)
        .arg(&scaling);
    let cfg =
        LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: route_shared as u32 };
    // SAFETY: moe_route(int* ids, float* weights, const bf16* x, WeightDesc router, int n_exp,
    // int top_k, int kind, int renorm, float softcap, const void* bias, int bias_dt, float
    // scaling): one block per token, shared memory as computed; ids/weights hold t * top_k, the
    // router is [n_exp, h] (checked), bias is null or n_exp values.
    launched(unsafe { l.launch(cfg) }, "moe_route")?;

    let mut l = b.stream().launch_builder(&b.k().moe_gate_up);
    l.arg(&pact).arg(&px).arg(&pids).arg(&ptab).arg(&tk).arg(&ii);
    let cfg = LaunchConfig {
        grid_dim: (slots as u32, inter.div_ceil(8) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (h * 4) as u32,
    };
    // SAFETY: moe_gate_up(float* act, const bf16* x, const int* ids, const WeightDesc* table,
    // int top_k, int inter): ids < n_exp (written by moe_route), the table has 2 * n_exp entries
    // whose fused gate/up is [2 * inter, h]; act holds slots * inter floats.
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
