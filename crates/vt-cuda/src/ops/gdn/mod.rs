//! Gated DeltaNet mixers: the causal conv1d and the gated delta rule token by token
//! (kernels/gdn.cu), its chunked form for prefill (chunk.rs) and the fused decode step (decode.rs).

pub(crate) mod chunk;
pub(crate) mod decode;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{DType, GdnDims, GdnInputs, GdnMode, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{act, grid1, i32_of, launched, MAX_SHARED};
use crate::limits::CONV_MAX_K;
use crate::weight::float_code;

pub(crate) fn causal_conv1d(
    b: &CudaBackend,
    x: &CudaTensor,
    w: &CudaTensor,
    state: &mut CudaTensor,
) -> Result<CudaTensor> {
    let (channels, kernel) = vt_core::backend::check::causal_conv1d(b, x, w, state)?;
    check(kernel <= CONV_MAX_K, "causal_conv1d", || format!("{kernel} taps exceed the kernel's {CONV_MAX_K}"))?;
    let (px, pw, wdt, ps) =
        (act(x, "causal_conv1d")?, w.buffer().ptr(), float_code(w, "causal_conv1d")?, state.buffer().ptr());
    let out = b.empty(DType::BF16, x.shape())?;
    let (po, t, c, kk) =
        (out.buffer().ptr(), i32_of(x.rows(), "tokens")?, i32_of(channels, "channels")?, kernel as i32);
    let mut l = b.stream().launch_builder(&b.k().causal_conv1d);
    l.arg(&po).arg(&px).arg(&pw).arg(&wdt).arg(&ps).arg(&t).arg(&c).arg(&kk);
    // SAFETY: causal_conv1d(bf16* out, const bf16* x, const void* w, int wdt, bf16* state,
    // int t, int c, int k): one thread per channel; x/out [t, c], w [c, k], state [c, k-1]
    // bf16 (checked), k <= CONV_MAX_K.
    launched(unsafe { l.launch(grid1(channels)) }, "causal_conv1d")?;
    Ok(out)
}

/// The chunked mode takes chunk.rs's kernels where they fit (key dim 128); everything
/// else runs the token-by-token kernel (the same arithmetic up to f32 rounding).
pub(crate) fn gated_delta_rule(
    b: &CudaBackend,
    inp: &GdnInputs<'_, CudaBackend>,
    state: &mut CudaTensor,
    mode: GdnMode,
) -> Result<CudaTensor> {
    let op = "gated_delta_rule";
    let GdnDims { t, key_heads, value_heads, key_dim, value_dim } = inp.dims(b, state)?;
    check(value_dim <= 1024 && key_dim * 8 <= MAX_SHARED, op, || {
        format!("value dim {value_dim} / key dim {key_dim} exceed this kernel's limits")
    })?;
    let (pq, pk, pv, pa, pb) = (act(inp.q, op)?, act(inp.k, op)?, act(inp.v, op)?, act(inp.a, op)?, act(inp.b, op)?);
    let (pal, al_dt, pdt, dt_dt) = (
        inp.a_log.buffer().ptr(),
        float_code(inp.a_log, op)?,
        inp.dt_bias.buffer().ptr(),
        float_code(inp.dt_bias, op)?,
    );
    let ps = state.buffer().ptr();
    let out = b.empty(DType::BF16, &[t, value_heads, value_dim])?;
    let po = out.buffer().ptr();
    let (ti, kh, vh, dk, dv) =
        (i32_of(t, "tokens")?, key_heads as i32, value_heads as i32, key_dim as i32, value_dim as i32);
    if mode == GdnMode::Chunked && chunk::fits(t, key_dim, value_dim, b.k().max_shared) {
        let ops = chunk::Operands {
            out: po,
            q: pq,
            k: pk,
            v: pv,
            a: pa,
            b: pb,
            a_log: pal,
            a_log_dt: al_dt,
            dt_bias: pdt,
            dt_bias_dt: dt_dt,
            state: ps,
        };
        chunk::run(b, &ops, t, key_heads, value_heads, value_dim)?;
        return Ok(out);
    }
    let mut l = b.stream().launch_builder(&b.k().gdn_recurrent);
    l.arg(&po)
        .arg(&pq)
        .arg(&pk)
        .arg(&pv)
        .arg(&pa)
        .arg(&pb)
        .arg(&pal)
        .arg(&al_dt)
        .arg(&pdt)
        .arg(&dt_dt)
        .arg(&ps)
        .arg(&ti)
        .arg(&kh)
        .arg(&vh)
        .arg(&dk)
        .arg(&dv);
    let threads = value_dim.max(1).next_multiple_of(32) as u32;
    let cfg = LaunchConfig {
        grid_dim: (value_heads as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: (key_dim * 8) as u32,
    };
    // SAFETY: gdn_recurrent(bf16* out, q, k, v, a, b, const void* a_log, int, const void*
    // dt_bias, int, float* state, int t, int key_heads, int value_heads, int dk, int dv): one
    // block per value head with >= dv threads and 2 * dk floats of shared memory; every
    // tensor's shape was checked against t, the head counts and dims above.
    launched(unsafe { l.launch(cfg) }, "gdn_recurrent")?;
    Ok(out)
}
