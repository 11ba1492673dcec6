//! One decode token of a Gated DeltaNet mixer for each of a batch of sequences
//! (kernels/gdn_decode.cu): the convolution step over all q/k/v channels, then the gated delta rule
//! with the f32 state read and written once. Each sequence's states are its own tensors, passed to
//! the kernels as an array of addresses. Heads of key and value dim 128 (every Qwen3.5 size);
//! other shapes take the composed ops.

use cudarc::driver::LaunchConfig;
use vt_core::{DType, GdnState, GdnStep, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{act, i32_of, Overlapped};
use crate::limits::{CONV_MAX_K, GDN_COLS, GDN_D, SEQ_MAX};
use crate::weight::float_code;

/// Whether the kernels take this step: heads of key and value dim GDN_D, at most CONV_MAX_K conv
/// taps, every sequence's states of the step's shapes.
pub(crate) fn fits(s: &GdnStep<'_, CudaBackend>, states: &[GdnState<'_, CudaBackend>]) -> bool {
    let (kh, vh, n) = (s.key_heads, s.value_heads, states.len());
    let channels = (2 * kh + vh) * GDN_D;
    let taps = s.conv.shape().get(1).copied().unwrap_or(0);
    s.key_dim == GDN_D
        && s.value_dim == GDN_D
        && kh > 0
        && vh % kh == 0
        && n > 0
        && s.qkv.shape() == [n, channels]
        && s.conv.shape() == [channels, taps]
        && (1..=CONV_MAX_K).contains(&taps)
        && states.iter().all(|st| {
            st.conv.shape() == [channels, taps - 1]
                && st.conv.dtype() == DType::BF16
                && st.recurrent.shape() == [vh, GDN_D, GDN_D]
                && st.recurrent.dtype() == DType::F32
        })
        && s.a.shape() == [n, vh]
        && s.b.shape() == [n, vh]
        && s.a_log.numel() == vh
        && s.dt_bias.numel() == vh
}

/// The fused step, for a step and states that `fits` took.
pub(crate) fn step(
    b: &CudaBackend,
    s: &GdnStep<'_, CudaBackend>,
    states: &mut [GdnState<'_, CudaBackend>],
) -> Result<CudaTensor> {
    check(fits(s, states), "gated_delta_step", || "the decode kernels do not take these shapes".into())?;
    let (kh, vh, n) = (s.key_heads, s.value_heads, states.len());
    let channels = (2 * kh + vh) * GDN_D;
    let taps = s.conv.shape()[1];
    let op = "gated_delta_step";
    let (px, pa, pb) = (act(s.qkv, op)?, act(s.a, op)?, act(s.b, op)?);
    let (pw, wdt) = (s.conv.buffer().ptr(), float_code(s.conv, op)?);
    let (pal, al_dt, pdt, dt_dt) =
        (s.a_log.buffer().ptr(), float_code(s.a_log, op)?, s.dt_bias.buffer().ptr(), float_code(s.dt_bias, op)?);
    let conv_out = b.buffer(n * channels * 4)?;
    let out = b.empty(DType::BF16, &[n, vh, GDN_D])?;
    let (ci, ki, khi, vhi) = (i32_of(channels, "channels")?, taps as i32, kh as i32, i32_of(vh, "value heads")?);
    // A recorded step reads the states' addresses from a buffer its replays fill, `[conv: n,
    // recurrent: n]`; otherwise they travel with each launch (`SeqPtrs`).
    let states_at = b.recording().map(|r| r.states_at(op, n)).transpose()?;
    for (c, chunk) in states.chunks(SEQ_MAX).enumerate() {
        let (first, seqs) = ((c * SEQ_MAX) as u64, chunk.len() as u32);
        let (mut conv_states, mut rec_states) = ([0u64; SEQ_MAX], [0u64; SEQ_MAX]);
        for (i, st) in chunk.iter().enumerate() {
            conv_states[i] = st.conv.buffer().ptr();
            rec_states[i] = st.recurrent.buffer().ptr();
        }
        // This chunk's rows: qkv and a/b bf16, the conv output f32, out bf16.
        let px = px + first * channels as u64 * 2;
        let (pa, pb) = (pa + first * vh as u64 * 2, pb + first * vh as u64 * 2);
        let pc = conv_out.ptr() + first * channels as u64 * 4;
        let po = out.buffer().ptr() + first * (vh * GDN_D) as u64 * 2;
        let (conv_at, rec_at) = states_at.map_or((0, 0), |at| (at + 8 * first, at + 8 * (n as u64 + first)));

        let mut l = Overlapped::new(b, &b.k().gdn_dec_conv);
        l.arg(&pc).arg(&px).arg(&pw).arg(&wdt).arg(&conv_states).arg(&conv_at).arg(&ci).arg(&ki);
        let cfg = LaunchConfig {
            grid_dim: (channels.div_ceil(256) as u32, seqs, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: gdn_dec_conv(float* out, const bf16* x, const void* w, int wdt, SeqPtrs states,
        // const u64* states_at, int c, int k): a thread per channel, blockIdx.y the sequence (seqs
        // <= SEQ_MAX, the array's length); x holds the chunk's [seqs, c] bf16 rows, out as many
        // f32, w [c, k] (dtype wdt), each states.p[i] a bf16 [c, k - 1] tensor (checked above), or
        // states_at (not null) the chunk's seqs addresses of such tensors, which each replay
        // writes; the kernel starts with grid_dep_begin.
        unsafe { l.launch(cfg, "gdn_dec_conv")? };

        let mut l = Overlapped::new(b, &b.k().gdn_dec_state);
        l.arg(&po).arg(&pc).arg(&pa).arg(&pb).arg(&pal).arg(&al_dt).arg(&pdt).arg(&dt_dt);
        l.arg(&rec_states).arg(&rec_at).arg(&khi).arg(&vhi);
        let cfg = LaunchConfig {
            grid_dim: (vh as u32, (GDN_D / GDN_COLS) as u32, seqs),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: gdn_dec_state(bf16* out, const float* qkv, const bf16* a, const bf16* b, const
        // void* a_log, int, const void* dt_bias, int, SeqPtrs states, const u64* states_at, int
        // key_heads, int value_heads): grid (vh, GDN_D / GDN_COLS, seqs) of 256 threads; qkv holds
        // the chunk's seqs rows of (2 kh + vh) * GDN_D floats (written above on this stream), a/b
        // seqs rows of vh values, a_log/dt_bias vh values, each states.p[i] an f32 [vh, GDN_D,
        // GDN_D] tensor, or states_at (not null) the chunk's seqs addresses of such tensors, which
        // each replay writes; out seqs rows of vh * GDN_D values; vh % kh == 0 (checked above).
        // The kernel starts with grid_dep_begin.
        unsafe { l.launch(cfg, "gdn_dec_state")? };
    }
    Ok(out)
}
