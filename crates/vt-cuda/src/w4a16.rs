//! NVFP4 linear layers for prefill-sized inputs on the tensor cores (kernels/w4a16.cu): bf16
//! activations, codes decoded in registers, f32 accumulation. The weight is repacked once, on the
//! device at first use, into the kernel's fragment-ordered tiles; the copy is derived from the
//! weight and so lives in its `Linear`'s resident slot. The stored codes stay as they are for the
//! GEMV and MoE kernels. The grouped MoE prefill (ops/moe/grouped.rs) runs NVFP4 experts through
//! the same tiles, kept with the MoE expert table (ops/moe/table.rs).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{Linear, Nvfp4, Result, Weight};

use crate::alloc::CudaBuffer;
use crate::device::CudaBackend;
use crate::error::{check, err};
use crate::kernels::allow_shared;
use crate::launch::{i32_of, launched};
use crate::limits::{W4_BK, W4_BN, W4_MOE_MI, W4_STAGES};
use crate::weight::{WeightDesc, DT_NVFP4};

/// Bytes of a repacked tile (`W4_TILE_BYTES`): W4_BN x W4_BK codes and their scales. `ROWS` is
/// the dense GEMM's 128 activation rows per block.
const TILE_BYTES: usize = W4_BN * W4_BK / 2 + W4_BN * W4_BK / 16;
const ROWS: usize = 128;
const GEMM_SHARED: usize = W4_STAGES * (ROWS * W4_BK * 2 + TILE_BYTES);
/// Slots per tile of the grouped MoE kernels and their shared memory.
pub(crate) const MOE_TILE_ROWS: usize = 32 * W4_MOE_MI;
pub(crate) const MOE_SHARED: usize = W4_STAGES * (MOE_TILE_ROWS * W4_BK * 2 + TILE_BYTES);

/// An NVFP4 weight `[n, k]` in the tensor-core layout: `ceil(n / 128)` row tiles of
/// `ceil(k / 64)` tiles of 4608 bytes, zero-padded.
pub(crate) struct PackedNvfp4 {
    buf: CudaBuffer,
}

impl PackedNvfp4 {
    /// Repacks `q` (validated at load: `k % 16 == 0`, scales `[n, k / 16]`).
    pub(crate) fn new(b: &CudaBackend, q: &Nvfp4<CudaBackend>) -> Result<Self> {
        let (n, k) = (q.codes.shape()[0], q.codes.shape()[1]);
        Ok(PackedNvfp4 { buf: repack(b, (q.codes.buffer().ptr(), q.scales.buffer().ptr()), None, n, k)? })
    }
}

/// The tiles of the NVFP4 matrix `[n, k]` whose (codes, scales) are at device addresses `rows`
/// (`n * k / 2` and `n * k / 16` bytes), or, with `pair` (then `n` is even), of `rows`' and
/// `pair`'s `n / 2` rows each, interleaved (gate row u and up row u as rows 2u, 2u + 1). All alive
/// until the stream has run; `k % 16 == 0`.
fn repack(b: &CudaBackend, rows: (u64, u64), pair: Option<(u64, u64)>, n: usize, k: usize) -> Result<CudaBuffer> {
    let (n_tiles, k_tiles) = (n.div_ceil(W4_BN), k.div_ceil(W4_BK));
    check(k.is_multiple_of(16) && k_tiles <= i32::MAX as usize && n_tiles <= 65535, "nvfp4 repack", || {
        format!("NVFP4 matrix [{n}, {k}]")
    })?;
    let buf = b.buffer(n_tiles * k_tiles * TILE_BYTES)?;
    let (pp, ni, ki) = (buf.ptr(), i32_of(n, "rows")?, i32_of(k, "inputs")?);
    let ((codes, scales), (codes2, scales2)) = (rows, pair.unwrap_or((0, 0)));
    let mut l = b.stream().launch_builder(&b.k().w4a16_repack);
    l.arg(&pp).arg(&codes).arg(&scales).arg(&codes2).arg(&scales2).arg(&ni).arg(&ki);
    let cfg =
        LaunchConfig { grid_dim: (k_tiles as u32, n_tiles as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: w4a16_repack(unsigned char* packed, const unsigned char* codes, const unsigned
    // char* scales, const unsigned char* codes2, const unsigned char* scales2, int n, int k): one
    // block per (k tile, row tile) writing its 4608 bytes of `buf` (sized for the whole grid); it
    // reads codes and scales only at rows < n and inputs < k (rows < n / 2 of each matrix when
    // codes2 is set), inside the sizes the caller vouches for.
    launched(unsafe { l.launch(cfg) }, "w4a16_repack")?;
    Ok(buf)
}

/// The grouped MoE kernels' expert table (kernels/w4a16.cu `moe_w4_*`): per expert, its gate and
/// up repacked as one `[2 inter, hidden]` matrix (rows interleaved), then its down projection.
pub(crate) struct PackedExperts {
    _tiles: Vec<CudaBuffer>,
    table: CudaBuffer,
}

impl PackedExperts {
    /// From the expert table's host copy (gate, up `[inter, hidden]` and down
    /// `[hidden, inter]` per expert, all NVFP4 and alive as long as the table).
    pub(crate) fn new(b: &CudaBackend, descs: &[[WeightDesc; 3]], inter: usize, hidden: usize) -> Result<Self> {
        let mut tiles = Vec::with_capacity(descs.len() * 2);
        let mut packed = Vec::with_capacity(tiles.capacity());
        for (e, d) in descs.iter().enumerate() {
            check(d.iter().all(|d| d.kind == DT_NVFP4), "moe", || format!("expert {e} is not NVFP4"))?;
            let [gate, up, down] = *d;
            let gate_up = repack(b, (gate.data, gate.scales), Some((up.data, up.scales)), 2 * inter, hidden)?;
            let down_tiles = repack(b, (down.data, down.scales), None, hidden, inter)?;
            packed.extend([
                WeightDesc { data: gate_up.ptr(), scales: 0, global: [gate.global[0], up.global[0]], ..gate },
                WeightDesc { data: down_tiles.ptr(), scales: 0, ..down },
            ]);
            tiles.extend([gate_up, down_tiles]);
        }
        Ok(PackedExperts { _tiles: tiles, table: b.upload_slice(&packed)? })
    }

    /// Device address of the `[experts, 2]` table.
    pub(crate) fn descs(&self) -> u64 {
        self.table.ptr()
    }
}

/// Whether the tensor-core kernel takes `t` tokens of `w`: NVFP4 rows of whole 16-code scale groups
/// (as checkpoints' are, validated at load; a weight made otherwise takes the simple kernel).
pub(crate) fn fits(t: usize, w: &Weight<CudaBackend>) -> bool {
    matches!(w, Weight::Nvfp4(_)) && t > 0 && t.div_ceil(ROWS) <= 65535 && w.dims().1.is_multiple_of(16)
}

/// `y [t, n] = x [t, k] · Wᵀ` on the tensor cores, for a `w` that `fits` took. `x` and `y` are
/// device addresses of `t * k` and `t * n` bf16 values, alive until the stream has run (the
/// caller's tensors).
pub(crate) fn linear(b: &CudaBackend, x: u64, t: usize, w: &Linear<CudaBackend>, y: u64) -> Result<()> {
    let (Weight::Nvfp4(q), true) = (&w.weight, fits(t, &w.weight)) else {
        return Err(err(format!("linear: the W4A16 kernel does not take {t} tokens of this weight")));
    };
    let (n, k) = w.weight.dims();
    let packed = w.resident.get_or_try_init(b, || PackedNvfp4::new(b, q))?;
    let f = &b.k().w4a16_gemm;
    allow_shared(f, GEMM_SHARED, "w4a16_gemm")?;
    let (pp, ti, ni, ki) = (packed.buf.ptr(), i32_of(t, "tokens")?, i32_of(n, "rows")?, i32_of(k, "inputs")?);
    let mut l = b.stream().launch_builder(f);
    l.arg(&y).arg(&x).arg(&pp).arg(&ti).arg(&ni).arg(&ki).arg(&q.global_scale);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(W4_BN) as u32, t.div_ceil(ROWS) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: GEMM_SHARED as u32,
    };
    // SAFETY: w4a16_gemm(bf16* y, const bf16* x, const unsigned char* packed, int t, int n, int k,
    // float global): one block per (row tile, 128 tokens), 256 threads, GEMM_SHARED bytes of
    // shared memory (allowed above). `packed` is this weight's [n, k] repacked copy (its resident
    // slot, alive with `w`), read whole tiles at a time; x rows < t and inputs < k (k % 16 == 0,
    // validated at load, so 16-byte rows) are read, y outputs < (t, n) written.
    launched(unsafe { l.launch(cfg) }, "w4a16_gemm")
}

/// The kernels' tile is TILE_BYTES (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    vec![crate::kernels::c_equal("W4_TILE_BYTES", TILE_BYTES)]
}
