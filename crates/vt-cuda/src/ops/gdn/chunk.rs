//! The gated delta rule's chunked form for prefill (kernels/gdn_chunk.cu): a parallel pass over
//! every (64-token chunk, value head) that solves the chunk's triangular system and precomputes
//! everything not involving the state, then one sequential pass per (value head, 32 value
//! columns) that carries the f32 state across the chunks. Key dim 128, value dim 64 or 128 (the
//! Qwen3.5 shapes); other shapes take the recurrent kernel.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::Result;

use crate::device::CudaBackend;
use crate::kernels::allow_shared;
use crate::launch::{i32_of, launched};
use crate::limits::{GC, GDK, GS_BV};

/// Dynamic shared memory (bytes) of gdn_chunk_prep (`GP_SHARED` floats, 2 blocks per SM) and
/// gdn_chunk_scan (checked against the kernels' by the tests).
const PREP_SHARED: usize = ((128 + 128) * 68 + 2 * 64 * 68 + 4 * 64) * 4;
const SCAN_SHARED: usize = (2 * 128 * 132 + 2 * 128 * 68 + 32 * 132 + 32 * 68) * 4;
/// Threads of either kernel's block.
const THREADS: u32 = 256;

/// Whether the chunked kernels take this call on a device whose blocks may use `max_shared`
/// bytes of shared memory (the scan needs 225 KiB: sm_90; elsewhere the recurrent kernel runs).
pub(crate) fn fits(t: usize, key_dim: usize, value_dim: usize, max_shared: usize) -> bool {
    t > 1 && key_dim == GDK && matches!(value_dim, 64 | 128) && PREP_SHARED.max(SCAN_SHARED) <= max_shared
}

/// Device addresses of one call, as the gated delta rule op checked them: q, k `[t, key_heads,
/// 128]`, v and out `[t, value_heads, dv]`, a, b `[t, value_heads]` (bf16); a_log, dt_bias
/// `[value_heads]` of the given dtype codes; state f32 `[value_heads, 128, dv]`.
pub(crate) struct Operands {
    pub out: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub a: u64,
    pub b: u64,
    pub a_log: u64,
    pub a_log_dt: i32,
    pub dt_bias: u64,
    pub dt_bias_dt: i32,
    pub state: u64,
}

pub(crate) fn run(
    b: &CudaBackend,
    p: &Operands,
    t: usize,
    key_heads: usize,
    value_heads: usize,
    value_dim: usize,
) -> Result<()> {
    let chunks = t.div_ceil(GC);
    let per = chunks * value_heads;
    // f32 scratch: [W; Q'] [128, 128], K~^T [128, 64], [U; O0] [128, dv] and exp(c_L) per
    // (chunk, head); freed in stream order after the scan.
    let wq = b.buffer(per * 2 * GC * GDK * 4)?;
    let kt = b.buffer(per * GDK * GC * 4)?;
    let uo = b.buffer(per * 2 * GC * value_dim * 4)?;
    let decay = b.buffer(per * 4)?;
    let (pwq, pkt, puo, pdec) = (wq.ptr(), kt.ptr(), uo.ptr(), decay.ptr());
    let (prep, scan, names) = if value_dim == 64 {
        (&b.k().gdn_chunk_prep_v64, &b.k().gdn_chunk_scan_v64, ["gdn_chunk_prep_v64", "gdn_chunk_scan_v64"])
    } else {
        (&b.k().gdn_chunk_prep_v128, &b.k().gdn_chunk_scan_v128, ["gdn_chunk_prep_v128", "gdn_chunk_scan_v128"])
    };
    let (ti, kh, vh) = (i32_of(t, "tokens")?, i32_of(key_heads, "key heads")?, i32_of(value_heads, "value heads")?);
    let qmul = (GDK as f64).powf(-0.5) as f32;

    allow_shared(prep, PREP_SHARED, names[0])?;
    let mut l = b.stream().launch_builder(prep);
    l.arg(&pwq)
        .arg(&pkt)
        .arg(&puo)
        .arg(&pdec)
        .arg(&p.q)
        .arg(&p.k)
        .arg(&p.v)
        .arg(&p.a)
        .arg(&p.b)
        .arg(&p.a_log)
        .arg(&p.a_log_dt)
        .arg(&p.dt_bias)
        .arg(&p.dt_bias_dt)
        .arg(&ti)
        .arg(&kh)
        .arg(&vh)
        .arg(&qmul);
    let cfg = LaunchConfig {
        grid_dim: (chunks as u32, value_heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: PREP_SHARED as u32,
    };
    // SAFETY: gdn_chunk_prep_v{dv}(float* wq, float* kt, float* uo, float* decay, const bf16* q,
    // k, v, a, b, const void* a_log, int, const void* dt_bias, int, int t, int key_heads, int
    // value_heads, float qmul): one block of 256 threads per (chunk, value head), PREP_SHARED
    // bytes (allowed above); the scratch holds chunks * value_heads blocks of each output; it reads
    // q, k, v rows of tokens < t only, 16-byte aligned (128-element key rows, dv a multiple of 8);
    // inputs as `Operands`.
    launched(unsafe { l.launch(cfg) }, names[0])?;

    allow_shared(scan, SCAN_SHARED, names[1])?;
    let mut l = b.stream().launch_builder(scan);
    l.arg(&p.out).arg(&p.state).arg(&pwq).arg(&pkt).arg(&puo).arg(&pdec).arg(&ti).arg(&vh);
    let cfg = LaunchConfig {
        grid_dim: (value_heads as u32, (value_dim / GS_BV) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: SCAN_SHARED as u32,
    };
    // SAFETY: gdn_chunk_scan_v{dv}(bf16* out, float* state, const float* wq, kt, uo, decay, int
    // t, int value_heads): one block of 256 threads per (value head, 32 columns), SCAN_SHARED bytes
    // (allowed above, within the 227 KiB a block may have); reads the scratch written above
    // (stream-ordered), out [t, value_heads, dv], state [value_heads, 128, dv], all whole
    // allocations, so their 16-byte (cp.async) and 8-byte (float2) accesses are aligned.
    launched(unsafe { l.launch(cfg) }, names[1])
}

/// The kernels' shared memory is what PREP_SHARED and SCAN_SHARED say (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    use crate::kernels::c_equal;
    vec![
        c_equal("GP_SHARED * 4", PREP_SHARED),
        c_equal("(2 * 2 * GC * GS_LD + 2 * GDK * GS_LK + GS_BV * GS_LD + GS_BV * GS_LK) * 4", SCAN_SHARED),
    ]
}

#[cfg(test)]
mod tests {
    use super::fits;

    #[test]
    fn the_chunked_kernels_need_sm90_shared_memory() {
        let (h200, a100) = (232_448, 166_912);
        assert!(fits(8192, 128, 128, h200));
        assert!(!fits(8192, 128, 128, a100));
        assert!(!fits(1, 128, 128, h200));
        assert!(!fits(64, 64, 128, h200));
    }
}
