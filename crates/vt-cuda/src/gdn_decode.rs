//! One decode token of a Gated DeltaNet mixer (kernels/gdn_decode.cu): the convolution step over
//! all q/k/v channels, then the gated delta rule with the f32 state read and written once. Heads of
//! key and value dim 128 (every Qwen3.5 size); other shapes take the composed ops.

use cudarc::driver::LaunchConfig;
use vt_core::{DType, GdnStep, Result, Tensor};

use crate::backend::{act, grid1, i32_of};
use crate::launch::Overlapped;
use crate::weight::float_code;
use crate::CudaBackend;

/// `GDN_D` and `GDN_COLS` of kernels/gdn_decode.cu.
const D: usize = 128;
const COLS: usize = 32;

/// The fused step when the kernels take these shapes; `None` sends the caller to the composed ops.
pub(crate) fn step(
    b: &CudaBackend,
    s: &GdnStep<'_, CudaBackend>,
    conv_state: &mut Tensor<CudaBackend>,
    state: &mut Tensor<CudaBackend>,
) -> Result<Option<Tensor<CudaBackend>>> {
    let (kh, vh) = (s.key_heads, s.value_heads);
    let channels = (2 * kh + vh) * D;
    let taps = s.conv.shape().get(1).copied().unwrap_or(0);
    let fits = s.key_dim == D
        && s.value_dim == D
        && kh > 0
        && vh % kh == 0
        && s.qkv.shape() == [1, channels]
        && s.conv.shape() == [channels, taps]
        && (1..=16).contains(&taps)
        && conv_state.shape() == [channels, taps - 1]
        && conv_state.dtype() == DType::BF16
        && state.shape() == [vh, D, D]
        && state.dtype() == DType::F32
        && s.a.numel() == vh
        && s.b.numel() == vh
        && s.a_log.numel() == vh
        && s.dt_bias.numel() == vh;
    if !fits {
        return Ok(None);
    }
    let op = "gated_delta_step";
    let (px, pa, pb) = (act(s.qkv, op)?, act(s.a, op)?, act(s.b, op)?);
    let (pw, wdt) = (s.conv.buffer().ptr(), float_code(s.conv, op)?);
    let (pal, al_dt, pdt, dt_dt) =
        (s.a_log.buffer().ptr(), float_code(s.a_log, op)?, s.dt_bias.buffer().ptr(), float_code(s.dt_bias, op)?);
    let conv_out = b.buffer(channels * 4)?;
    let (pc, pcs, ps) = (conv_out.ptr(), conv_state.buffer().ptr(), state.buffer().ptr());
    let out = b.empty(DType::BF16, &[1, vh, D])?;
    let po = out.buffer().ptr();
    let (ci, ki, khi, vhi) = (i32_of(channels, "channels")?, taps as i32, kh as i32, i32_of(vh, "value heads")?);

    let mut l = Overlapped::new(b, &b.k().gdn_dec_conv);
    l.arg(&pc).arg(&px).arg(&pw).arg(&wdt).arg(&pcs).arg(&ci).arg(&ki);
    // SAFETY: gdn_dec_conv(float* out, const bf16* x, const void* w, int wdt, bf16* state, int c,
    // int k): one thread per channel; x [1, c] and w [c, k] (dtype wdt), state bf16 [c, k - 1],
    // out c floats (checked above); the kernel starts with grid_dep_begin.
    unsafe { l.launch(grid1(channels), "gdn_dec_conv")? };

    let mut l = Overlapped::new(b, &b.k().gdn_dec_state);
    l.arg(&po).arg(&pc).arg(&pa).arg(&pb).arg(&pal).arg(&al_dt).arg(&pdt).arg(&dt_dt).arg(&ps).arg(&khi).arg(&vhi);
    let cfg = LaunchConfig { grid_dim: (vh as u32, (D / COLS) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: gdn_dec_state(bf16* out, const float* qkv, const bf16* a, const bf16* b, const void*
    // a_log, int, const void* dt_bias, int, float* state, int key_heads, int value_heads): grid
    // (vh, D / COLS) of 256 threads; qkv holds (2 kh + vh) * D floats, a/b/a_log/dt_bias vh
    // values, state [vh, D, D] f32, out vh * D values; vh % kh == 0 (checked above).
    // The kernel starts with grid_dep_begin.
    unsafe { l.launch(cfg, "gdn_dec_state")? };
    Ok(Some(out))
}
