//! NVFP4 linear layers for prefill-sized inputs on the tensor cores (kernels/w4a16.cu): bf16
//! activations, codes decoded in registers from the weight's own tiled layout (nvfp4.rs), f32
//! accumulation. The grouped MoE prefill (ops/moe/grouped.rs) runs NVFP4 experts through the same
//! tiles, reading each expert's gate, up and down from the expert table.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{Linear, Result, Weight};

use crate::device::CudaBackend;
use crate::error::err;
use crate::kernels::allow_shared;
use crate::launch::{i32_of, launched};
use crate::limits::{NV4_K, NV4_ROWS, W4_BN, W4_MOE_MI, W4_STAGES};
use crate::weight::WeightDesc;

/// Bytes of a pipeline stage's weights (`W4_TILE_BYTES`): the codes and scales of W4_BN rows x
/// NV4_K inputs. `ROWS` is the dense GEMM's 128 activation rows per block.
const TILE_BYTES: usize = W4_BN * NV4_K / 2 + W4_BN * NV4_K / 16;
const ROWS: usize = 128;
const GEMM_SHARED: usize = W4_STAGES * (ROWS * NV4_K * 2 + TILE_BYTES);
/// Slots per tile of the grouped MoE kernels and their shared memory.
pub(crate) const MOE_TILE_ROWS: usize = 32 * W4_MOE_MI;
pub(crate) const MOE_SHARED: usize = W4_STAGES * (MOE_TILE_ROWS * NV4_K * 2 + TILE_BYTES);

/// Whether the tensor-core kernel takes `t` tokens of `w`: NVFP4 (rows of whole 16-code scale
/// groups, validated at load).
pub(crate) fn fits(t: usize, w: &Weight<CudaBackend>) -> bool {
    matches!(w, Weight::Nvfp4(_)) && t > 0 && t.div_ceil(ROWS) <= 65535
}

/// `y [t, n] = x [t, k] · Wᵀ` on the tensor cores, for a `w` that `fits` took: from
/// NV4_DEQUANT_FROM_T tokens (rows a multiple of 8) through a bf16 copy of the weight and
/// cuBLASLt (where the W4A16 kernel's decode of every tile for each 128 tokens costs more than
/// expanding the weight once), else the W4A16 kernel. `x` and `y` are device addresses of `t * k`
/// and `t * n` bf16 values, alive until the stream has run (the caller's tensors).
pub(crate) fn linear(b: &CudaBackend, x: u64, t: usize, w: &Linear<CudaBackend>, y: u64) -> Result<()> {
    if !fits(t, &w.weight) {
        return Err(err(format!("linear: the W4A16 kernel does not take {t} tokens of this weight")));
    }
    // cuBLASLt's bf16 kernels want 16-byte aligned rows.
    if t >= b.k().shapes.dequant_from_t && w.weight.dims().0.is_multiple_of(8) {
        return dequantized(b, x, t, w, y);
    }
    let n = w.weight.dims().0;
    let desc = WeightDesc::of(&w.weight, "linear")?;
    let f = &b.k().w4a16_gemm;
    allow_shared(f, GEMM_SHARED, "w4a16_gemm")?;
    let (ti, ni) = (i32_of(t, "tokens")?, i32_of(n, "rows")?);
    let mut l = b.stream().launch_builder(f);
    l.arg(&y).arg(&x).arg(&desc).arg(&ti).arg(&ni);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(W4_BN) as u32, t.div_ceil(ROWS) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: GEMM_SHARED as u32,
    };
    // SAFETY: w4a16_gemm(bf16* y, const bf16* x, WeightDesc w, int t, int n): one block per
    // (W4_BN rows, 128 tokens), 256 threads, GEMM_SHARED bytes of shared memory (allowed above).
    // `desc` is the live NVFP4 weight [n, k] in the tiled layout (nvfp4.rs: ceil(n / 16) row
    // blocks of ceil(k / 64) tiles), of which only row blocks < ceil(n / 16) are read; x rows < t
    // and inputs < k (k % 16 == 0, validated at load, so 16-byte rows) are read, y outputs < (t,
    // n) written.
    launched(unsafe { l.launch(cfg) }, "w4a16_gemm")
}

/// `linear` through a bf16 copy of the NVFP4 weight (scratch, freed in stream order) and
/// cuBLASLt, the per-tensor multiplier applied to the f32 sums as the W4A16 kernel does.
fn dequantized(b: &CudaBackend, x: u64, t: usize, w: &Linear<CudaBackend>, y: u64) -> Result<()> {
    let Weight::Nvfp4(q) = &w.weight else { return Err(err("linear: not an NVFP4 weight")) };
    let (n, k) = w.weight.dims();
    let desc = WeightDesc::of(&w.weight, "linear")?;
    let wide = b.buffer(n * k * 2)?;
    let (pw, ni) = (wide.ptr(), i32_of(n, "rows")?);
    let tiles = n.div_ceil(NV4_ROWS) * k.div_ceil(NV4_K);
    let mut l = b.stream().launch_builder(&b.k().nvfp4_dequant);
    l.arg(&pw).arg(&desc).arg(&ni);
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(tiles.div_ceil(4)).map_err(|_| err("linear: too many tiles"))?, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: nvfp4_dequant(bf16* out, WeightDesc w, int n): a warp per tile of the live NVFP4
    // weight [n, k] in the tiled layout (k % 16 == 0, validated at load), warps past the last tile
    // return; `wide` holds n * k bf16 values, of which each warp writes its tile's rows < n and
    // inputs < k.
    launched(unsafe { l.launch(cfg) }, "nvfp4_dequant")?;
    // SAFETY: x holds t * k, `wide` n * k and y t * n bf16 values, alive until the stream has run
    // the GEMM (the caller's tensors; `wide` is freed in stream order).
    unsafe {
        b.gemm().xwt(b.stream(), x, pw, y, t, n, k, cudarc::cublaslt::sys::cudaDataType_t::CUDA_R_16BF, q.global_scale)
    }
}

/// The kernels' stage is TILE_BYTES (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    vec![crate::kernels::c_equal("W4_TILE_BYTES", TILE_BYTES)]
}
