//! Rotary position embedding (NeoX) on the device: the inverse frequencies travel by value
//! (`RopeFreqs`, at most ROPE_MAX_FREQS of them).

use vt_core::{DType, Result, Rope};

use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{act, grid1, i32_of, Overlapped};
use crate::limits::ROPE_MAX_FREQS;

/// `rope`'s inverse frequencies as the rope kernels take them (`RopeFreqs`), and how many.
pub(crate) fn rope_freqs(rope: &Rope, dim: usize, op: &str) -> Result<([f32; ROPE_MAX_FREQS], i32)> {
    let half = rope.inv_freq.len();
    check(2 * half <= dim && half <= ROPE_MAX_FREQS, op, || format!("rotary dim {} with head dim {dim}", 2 * half))?;
    let mut freqs = [0.0f32; ROPE_MAX_FREQS];
    freqs[..half].copy_from_slice(&rope.inv_freq);
    Ok((freqs, half as i32))
}

/// Rotates `x`, one token `[heads, dim]` of each of `seqs` sequences, token `i` at the position
/// `positions[i]` (device memory, `seqs` i32), into `out` (as many bf16 values).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_seqs(
    b: &CudaBackend,
    out: u64,
    x: u64,
    seqs: usize,
    heads: usize,
    dim: usize,
    positions: u64,
    rope: &Rope,
) -> Result<()> {
    let (freqs, half) = rope_freqs(rope, dim, "rope")?;
    let (ti, hi, di) = (i32_of(seqs, "sequences")?, i32_of(heads, "heads")?, i32_of(dim, "head dim")?);
    let mut l = Overlapped::new(b, &b.k().rope_seqs);
    l.arg(&out).arg(&x).arg(&ti).arg(&hi).arg(&di).arg(&positions).arg(&half).arg(&freqs).arg(&rope.attention_scaling);
    // SAFETY: rope_seqs(bf16* out, const bf16* x, int t, int heads, int d, const int* pos, int
    // half, RopeFreqs inv, float scaling): t = seqs tokens of heads * d values in x and out and t
    // positions at pos (the caller's contract), 2 * half <= d (rope_freqs checked); the kernel
    // starts with grid_dep_begin.
    unsafe { l.launch(grid1(seqs * heads * dim), "rope_seqs") }
}

pub(crate) fn rope(b: &CudaBackend, x: &CudaTensor, start: usize, rope: &Rope) -> Result<CudaTensor> {
    let (t, heads, dim) = vt_core::backend::check::rope(b, x, rope)?;
    let (freqs, half) = rope_freqs(rope, dim, "rope")?;
    let px = act(x, "rope")?;
    let out = b.empty(DType::BF16, x.shape())?;
    let po = out.buffer().ptr();
    let (ti, hi, di, si) = (i32_of(t, "tokens")?, heads as i32, dim as i32, i32_of(start, "position")?);
    let start_at = b.recording().map(|r| r.pos_at("rope", start)).transpose()?.unwrap_or(0);
    let mut l = Overlapped::new(b, &b.k().rope);
    l.arg(&po).arg(&px).arg(&ti).arg(&hi).arg(&di).arg(&si).arg(&start_at).arg(&half);
    l.arg(&freqs).arg(&rope.attention_scaling);
    // SAFETY: rope(bf16* out, const bf16* x, int t, int heads, int d, int start, const int*
    // start_at, int half, RopeFreqs inv (float[128] by value), float scaling): x and out hold t *
    // heads * d values; start_at is 0 or a recording's position; the kernel starts with
    // grid_dep_begin.
    unsafe { l.launch(grid1(x.numel()), "rope")? };
    Ok(out)
}
