//! Single-token steps of a Gated DeltaNet mixer for each of a batch of sequences, one position or
//! several (a verification's waves) each (kernels/gdn_decode.cu): the convolution step over all
//! q/k/v channels, then the gated delta rule with the f32 state read and written once a call (and,
//! where asked, written after the sequence's first position too: a verification's rollback
//! point); one launch for both where `one_launch` takes the shapes, two otherwise. Each
//! sequence's states are its own tensors, passed to the kernels as arrays of addresses. Heads of
//! key and value dim 128 (every Qwen3.5 size) and at most GDN_WAVES_MAX positions; other shapes
//! take the composed ops.

use cudarc::driver::LaunchConfig;
use vt_core::{DType, GdnState, GdnStep, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{act, i32_of, Overlapped};
use crate::limits::{CONV_MAX_K, GDN_COLS, GDN_D, GDN_FUSED_TAPS, GDN_WAVES_MAX, SEQ_MAX};
use crate::weight::float_code;

/// Whether the kernels take this step of `waves` (`FusedOps::gated_delta_waves`; checked by the
/// caller): heads of key and value dim GDN_D, at most CONV_MAX_K conv taps and GDN_WAVES_MAX
/// waves, every sequence's states of the step's shapes.
pub(crate) fn fits(s: &GdnStep<'_, CudaBackend>, waves: &[usize], states: &[GdnState<'_, CudaBackend>]) -> bool {
    let (kh, vh, n) = (s.key_heads, s.value_heads, waves.iter().sum::<usize>());
    let channels = (2 * kh + vh) * GDN_D;
    let taps = s.conv.shape().get(1).copied().unwrap_or(0);
    s.key_dim == GDN_D
        && s.value_dim == GDN_D
        && kh > 0
        && vh % kh == 0
        && n > 0
        && waves.len() <= GDN_WAVES_MAX
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

/// Blocks of a key head in the one-launch step (`gdn_dec_step`): a thread block cluster, at most
/// the 8 every device that has clusters can schedule.
const MAX_CLUSTER: usize = 8;

/// Whether a call takes the one launch: one sequence (a batch-1 step or verification: its blocks
/// each step their key head's q/k conv channels again, which only pays where the launch it saves
/// is most of the time: docs/performance.md), GDN_FUSED_TAPS taps (every Qwen3.5 size), and a key
/// head's blocks (value heads per key head x GDN_D / GDN_COLS) a portable cluster. Otherwise
/// `gdn_dec_conv` then `gdn_dec_state`.
fn one_launch(seqs: usize, key_heads: usize, value_heads: usize, taps: usize) -> bool {
    seqs == 1 && taps == GDN_FUSED_TAPS && value_heads / key_heads * (GDN_D / GDN_COLS) <= MAX_CLUSTER
}

/// The fused steps, for waves that `fits` took (rows wave after wave, as `gated_delta_waves`).
pub(crate) fn waves(
    b: &CudaBackend,
    s: &GdnStep<'_, CudaBackend>,
    waves: &[usize],
    states: &mut [GdnState<'_, CudaBackend>],
    firsts: &mut [Option<GdnState<'_, CudaBackend>>],
) -> Result<CudaTensor> {
    let op = "gated_delta_step";
    check(fits(s, waves, states) && waves.first() == Some(&states.len()), op, || {
        "the decode kernels do not take these shapes".into()
    })?;
    let (kh, vh, n, rows) = (s.key_heads, s.value_heads, states.len(), waves.iter().sum::<usize>());
    let channels = (2 * kh + vh) * GDN_D;
    let taps = s.conv.shape()[1];
    let (px, pa, pb) = (act(s.qkv, op)?, act(s.a, op)?, act(s.b, op)?);
    let (pw, wdt) = (s.conv.buffer().ptr(), float_code(s.conv, op)?);
    let (pal, al_dt, pdt, dt_dt) =
        (s.a_log.buffer().ptr(), float_code(s.a_log, op)?, s.dt_bias.buffer().ptr(), float_code(s.dt_bias, op)?);
    let fused = one_launch(n, kh, vh, taps);
    // gdn_dec_conv's f32 output, which gdn_dec_state reads (the one launch keeps it in its blocks).
    let conv_out = if fused { None } else { Some(b.buffer(rows * channels * 4)?) };
    let out = b.empty(DType::BF16, &[rows, vh, GDN_D])?;
    let (pc, po) = (conv_out.as_ref().map_or(0, |c| c.ptr()), out.buffer().ptr());
    let (ci, ki, khi, vhi) = (i32_of(channels, "channels")?, taps as i32, kh as i32, i32_of(vh, "value heads")?);
    // The kernels' `GdnWaves`: each wave's sequences (their rows follow one another).
    let mut sizes = [0i32; GDN_WAVES_MAX];
    for (size, &w) in sizes.iter_mut().zip(waves) {
        *size = i32_of(w, "sequences")?;
    }
    let nwaves = waves.len() as i32;
    // A recorded step reads the addresses from a buffer its replays fill (`addresses`' four
    // kinds, n of each); otherwise they travel with each launch (`SeqPtrs`; 0: no first-position
    // copy).
    let states_at = b.recording().map(|r| r.states_at(op, n)).transpose()?;
    let all = addresses(states, firsts);
    for (c, chunk) in all.chunks(SEQ_MAX).enumerate() {
        let (first, seqs) = (c * SEQ_MAX, chunk.len() as u32);
        let mut ptrs = [[0u64; SEQ_MAX]; 4];
        for (i, a) in chunk.iter().enumerate() {
            (0..4).for_each(|k| ptrs[k][i] = a[k]);
        }
        let [conv_states, rec_states, conv_firsts, rec_firsts] = ptrs;
        let at = |k: usize| states_at.map_or(0, |at| at + 8 * (k * n + first) as u64);
        let (conv_at, rec_at, conv_firsts_at, rec_firsts_at) = (at(0), at(1), at(2), at(3));
        let first = first as i32;

        let state_grid = (vh as u32, (GDN_D / GDN_COLS) as u32, seqs);
        if fused {
            let mut l = Overlapped::new(b, &b.k().gdn_dec_step);
            l.arg(&po).arg(&px).arg(&pw).arg(&wdt).arg(&pa).arg(&pb).arg(&pal).arg(&al_dt).arg(&pdt).arg(&dt_dt);
            l.arg(&conv_states).arg(&conv_at).arg(&rec_states).arg(&rec_at);
            l.arg(&conv_firsts).arg(&conv_firsts_at).arg(&rec_firsts).arg(&rec_firsts_at);
            l.arg(&sizes).arg(&nwaves).arg(&first).arg(&khi).arg(&vhi);
            l.cluster(((vh / kh) as u32, (GDN_D / GDN_COLS) as u32, 1));
            let cfg = LaunchConfig { grid_dim: state_grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: gdn_dec_step(bf16* out, const bf16* x, const void* w, int wdt, const bf16* a,
            // const bf16* b, const void* a_log, int, const void* dt_bias, int, SeqPtrs
            // conv_states, const u64* conv_at, SeqPtrs rec_states, const u64* rec_at, SeqPtrs
            // conv_firsts, const u64* conv_firsts_at, SeqPtrs rec_firsts, const u64* rec_firsts_at,
            // GdnWaves waves, int nwaves, int first, int key_heads, int value_heads): as
            // gdn_dec_conv's and gdn_dec_state's below, taken together (the conv output never
            // leaves the block), with w [c, GDN_FUSED_TAPS] and each conv state [c,
            // GDN_FUSED_TAPS - 1] (one_launch); clusters of (vh / kh, GDN_D / GDN_COLS, 1) blocks,
            // at most MAX_CLUSTER, are one key head's blocks (vh % kh == 0, checked above).
            unsafe { l.launch(cfg, "gdn_dec_step")? };
            continue;
        }

        let mut l = Overlapped::new(b, &b.k().gdn_dec_conv);
        l.arg(&pc).arg(&px).arg(&pw).arg(&wdt).arg(&conv_states).arg(&conv_at).arg(&conv_firsts).arg(&conv_firsts_at);
        l.arg(&sizes).arg(&nwaves).arg(&first).arg(&ci).arg(&ki);
        let cfg = LaunchConfig {
            grid_dim: (channels.div_ceil(256) as u32, seqs, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: gdn_dec_conv(float* out, const bf16* x, const void* w, int wdt, SeqPtrs states,
        // const u64* states_at, SeqPtrs firsts, const u64* firsts_at, GdnWaves waves, int nwaves,
        // int first, int c, int k): a thread per channel, blockIdx.y sequence `first + y` (seqs
        // <= SEQ_MAX, the array's length), which steps at the positions j < nwaves <=
        // GDN_WAVES_MAX (the array's length) where waves.seqs[j] exceeds it, at rows within the
        // rows = sum(waves) of x ([rows, c] bf16) and out (as many f32); w [c, k] (dtype wdt),
        // each states.p[i] a bf16 [c, k - 1] tensor (checked above), and each firsts.p[i] 0 or one
        // of that shape (checked by vt-core's gdn_waves), or states_at / firsts_at (not null) the
        // chunk's seqs addresses of such tensors, which each replay writes; the kernel starts
        // with grid_dep_begin.
        unsafe { l.launch(cfg, "gdn_dec_conv")? };

        let mut l = Overlapped::new(b, &b.k().gdn_dec_state);
        l.arg(&po).arg(&pc).arg(&pa).arg(&pb).arg(&pal).arg(&al_dt).arg(&pdt).arg(&dt_dt);
        l.arg(&rec_states).arg(&rec_at).arg(&rec_firsts).arg(&rec_firsts_at);
        l.arg(&sizes).arg(&nwaves).arg(&first).arg(&khi).arg(&vhi);
        let cfg = LaunchConfig { grid_dim: state_grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: gdn_dec_state(bf16* out, const float* qkv, const bf16* a, const bf16* b, const
        // void* a_log, int, const void* dt_bias, int, SeqPtrs states, const u64* states_at,
        // SeqPtrs firsts, const u64* firsts_at, GdnWaves waves, int nwaves, int first, int
        // key_heads, int value_heads): grid (vh, GDN_D / GDN_COLS, seqs) of 256 threads,
        // blockIdx.z sequence `first + z`, stepping at rows as gdn_dec_conv's; qkv holds rows of
        // (2 kh + vh) * GDN_D floats (written above on this stream), a/b rows of vh values,
        // a_log/dt_bias vh values, each states.p[i] an f32 [vh, GDN_D, GDN_D] tensor and each
        // firsts.p[i] 0 or one of that shape, or states_at / firsts_at (not null) the chunk's seqs
        // addresses of such tensors, which each replay writes; out rows of vh * GDN_D values; vh %
        // kh == 0 (checked above). The kernel starts with grid_dep_begin.
        unsafe { l.launch(cfg, "gdn_dec_state")? };
    }
    Ok(out)
}

/// Each sequence's `[conv, recurrent, first conv, first recurrent]` addresses (the last two 0
/// where it has no `firsts` entry): what a delta-net call reads and writes, in a recording's
/// order (`RecordedStates`).
pub(crate) fn addresses(
    states: &[GdnState<'_, CudaBackend>],
    firsts: &[Option<GdnState<'_, CudaBackend>>],
) -> Vec<[u64; 4]> {
    let at = |s: &GdnState<'_, CudaBackend>| [s.conv.buffer().ptr(), s.recurrent.buffer().ptr()];
    (states.iter().enumerate())
        .map(|(i, s)| {
            let [fc, fr] = firsts.get(i).and_then(Option::as_ref).map_or([0, 0], at);
            let [c, r] = at(s);
            [c, r, fc, fr]
        })
        .collect()
}

/// The kernels' `GdnWaves` is the `[i32; GDN_WAVES_MAX]` the launches pass.
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    vec![crate::kernels::c_equal("sizeof(GdnWaves)", std::mem::size_of::<[i32; GDN_WAVES_MAX]>())]
}

#[cfg(test)]
mod tests {
    use super::one_launch;

    /// One sequence of Qwen3.5-35B-A3B's heads (16 key, 32 value: clusters of 8) takes the one
    /// launch; two sequences, 397B's 64 value heads (clusters of 16) or other taps take two.
    #[test]
    fn one_sequence_of_portable_clusters_takes_one_launch() {
        assert!(one_launch(1, 16, 32, 4));
        assert!(one_launch(1, 2, 2, 4));
        assert!(!one_launch(2, 16, 32, 4));
        assert!(!one_launch(1, 16, 64, 4));
        assert!(!one_launch(1, 1, 3, 4));
        assert!(!one_launch(1, 16, 32, 3));
    }
}
