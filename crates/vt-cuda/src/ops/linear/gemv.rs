//! Linear layers for the few tokens of a decode step (kernels/gemv.cu): each weight row is
//! streamed once with 16-byte loads and dotted with every token, where cuBLASLt's GEMMs would pay a
//! heuristic query per call and tile shapes made for many tokens. Weights that read the same input
//! (a mixer's projections) share one launch, which overlaps the previous kernel's end (launch.rs).

use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};
use vt_core::{DType, Result, Weight};

use crate::device::CudaBackend;
use crate::error::{check, err};
use crate::kernels::allow_shared;
use crate::launch::{i32_of, Overlapped};
use crate::limits::{
    GEMV_MAX_PARTS, GEMV_MAX_T, GEMV_MMA_MAX_T, GEMV_MMA_WARPS, GEMV_NV4S_MAX_PER, GEMV_NV4S_WARPS, GEMV_ROWS, NV4_K,
    NV4_ROWS,
};
use crate::nvfp4::{frag_bytes, CODE_BYTES, SCALE_BYTES};
use crate::weight::WeightDesc;

// A CUDA-core block's 4 warps take 4 / ks row groups of GEMV_ROWS rows, ks warps per group.
/// Blocks (of one warp per row pair) below which the CUDA-core kernels split rows over 4 warps,
/// and over 2: about 8 and 32 warps per SM of the H200's 132, what keeps enough loads in flight.
const SPLIT_4_BELOW: usize = 1024;
const SPLIT_2_BELOW: usize = 4096;

/// `struct GemvParts` of kernels/gemv.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvParts {
    w: [WeightDesc; GEMV_MAX_PARTS],
    y: [u64; GEMV_MAX_PARTS],
    n: [i32; GEMV_MAX_PARTS],
    ld: [i32; GEMV_MAX_PARTS],
    first_block: [i32; GEMV_MAX_PARTS],
    parts: i32,
    ks: i32,
    f32_out: i32,
    pad: i32,
}

// SAFETY: #[repr(C)] plain data laid out as the CUDA struct (4 x 32-byte WeightDesc, 4 u64,
// 3 x 4 ints, 4 ints: 224 bytes, 8-byte aligned, no implicit padding).
unsafe impl DeviceRepr for GemvParts {}

/// Rows of a launch from which one or two tokens still take the t <= 8 kernels: the lighter ones'
/// extra resident blocks pay on layers of thousands of rows, but slow a lm_head of hundreds of
/// thousands (docs/performance.md).
const T1_MAX_ROWS: usize = 1 << 16;

/// Tokens from which bf16 rows take the tensor-core kernels: from 3 they beat the CUDA cores on
/// every measured shape, at 2 not (docs/performance.md).
const MMA_MIN_T: usize = 3;
/// Rows of a launch from which a tensor-core block takes two 16-row tiles (each input chunk it
/// loads then serves 32 rows), still leaving 256 blocks.
const MMA_TWO_TILES_ROWS: usize = 8192;

/// A GEMV kernel and how it tiles a launch: a block of `warps` warps owns `block_rows` rows;
/// `ks` is the kernel's GemvParts.ks (warps per row group, or gemv_nvfp4_t1s's row blocks a block).
struct Tiling<'a> {
    f: &'a CudaFunction,
    block_rows: usize,
    warps: usize,
    ks: usize,
    /// Dynamic shared memory a block takes (gemv_nvfp4_t1's staged x, gemv_nvfp4_t1s's weights),
    /// and whether the kernel must opt in to it (with its static part, past the default 48 KB).
    shared: usize,
    opt_in: bool,
}

/// Shared memory (static and dynamic together) a block may take without opting in.
const DEFAULT_SHARED: usize = 48 * 1024;

/// gemv_nvfp4_t1's static shared memory with blocks of up to `max_warps` warps: the warps' partial
/// sums of one column tile (kernels/gemv.cu, `part`).
fn nv4_t1_static(max_warps: usize) -> usize {
    4 * max_warps * 4 * 32
}

/// gemv_nvfp4_t1s's static shared memory: its warps' sums of up to GEMV_NV4S_MAX_PER row blocks.
const NV4S_STATIC: usize = 4 * GEMV_NV4S_MAX_PER * GEMV_NV4S_WARPS * NV4_ROWS;

/// gemv_nvfp4_t1s's dynamic shared memory for `per` row blocks of `k` inputs a block: their
/// tiles' codes and scales, and x's staged fragments.
fn t1s_shared(per: usize, k: usize) -> usize {
    per * k.div_ceil(NV4_K) * (CODE_BYTES + SCALE_BYTES) + frag_bytes(1, k)
}

/// One token of an NVFP4 layer of `rows` rows: gemv_nvfp4_t1s, each block with about a
/// multiprocessor's share of the row blocks in shared memory, where they fit.
fn nv4_t1s<'a>(b: &'a CudaBackend, rows: usize, k: usize) -> Option<Tiling<'a>> {
    let kf = b.k();
    let per = rows.div_ceil(NV4_ROWS).div_ceil(kf.sm_count);
    let shared = t1s_shared(per, k);
    (per <= GEMV_NV4S_MAX_PER && shared + NV4S_STATIC <= kf.max_shared).then_some(Tiling {
        f: &kf.gemv_nvfp4_t1s,
        block_rows: per * NV4_ROWS,
        warps: GEMV_NV4S_WARPS,
        ks: per,
        shared,
        opt_in: true,
    })
}

/// Which GEMV kernel takes `w` (bf16 rows of whole 16-byte chunks, or NVFP4) for `t` tokens in a
/// launch of `rows` rows, and its tiling; `None` where none does. For bf16, one and two tokens have
/// their own, lighter kernels (below T1_MAX_ROWS rows); from MMA_MIN_T tokens rows of whole
/// 32-input chunks take the tensor-core kernels, up to GEMV_MMA_MAX_T (the other kernels up to
/// GEMV_MAX_T). NVFP4 takes its tensor-core kernels at any count up to GEMV_MMA_MAX_T: a block
/// per 16-row block of its tiled layout, its warps splitting k so that each has about
/// `gemv_tiles` of the row's 64-input tiles, all in flight at once (kernels/gemv.cu), up to
/// `gemv_max_warps` (limits.rs's numbers the kernels were compiled with).
fn kernel_for<'a>(b: &'a CudaBackend, w: &Weight<CudaBackend>, t: usize, rows: usize) -> Option<Tiling<'a>> {
    let (k, light) = (w.dims().1, rows < T1_MAX_ROWS);
    let cores = |f| {
        let ks = match rows.div_ceil(GEMV_ROWS * 4) {
            b if b < SPLIT_4_BELOW => 4,
            b if b < SPLIT_2_BELOW => 2,
            _ => 1,
        };
        Some(Tiling { f, block_rows: 4 / ks * GEMV_ROWS, warps: 4, ks, shared: 0, opt_in: false })
    };
    let kf = b.k();
    match w {
        _ if t == 0 || t > GEMV_MMA_MAX_T => None,
        Weight::Nvfp4(_) => {
            if let Some(staged) = (t == 1).then(|| nv4_t1s(b, rows, k)).flatten() {
                return Some(staged);
            }
            let warps = k.div_ceil(NV4_K).div_ceil(kf.shapes.gemv_tiles).clamp(1, kf.shapes.gemv_max_warps);
            // One token stages x in shared memory (up to 20k inputs: no opt-in needed).
            let staged = frag_bytes(1, k);
            let (f, shared) = match t {
                1 if staged + nv4_t1_static(kf.shapes.gemv_max_warps) <= DEFAULT_SHARED => (&kf.gemv_nvfp4_t1, staged),
                _ if t > GEMV_MAX_T => (&kf.gemv_nvfp4_t16, 0),
                _ => (&kf.gemv_nvfp4, 0),
            };
            Some(Tiling { f, block_rows: NV4_ROWS, warps, ks: warps, shared, opt_in: false })
        }
        Weight::Dense(d) if d.dtype() == DType::BF16 && t >= MMA_MIN_T && k.is_multiple_of(32) => {
            let (f, tiles) = match (rows >= MMA_TWO_TILES_ROWS, t > GEMV_MAX_T) {
                (true, false) => (&kf.gemv_bf16_mma2, 2),
                (false, false) => (&kf.gemv_bf16_mma1, 1),
                (true, true) => (&kf.gemv_bf16_mma2_t16, 2),
                (false, true) => (&kf.gemv_bf16_mma1_t16, 1),
            };
            Some(Tiling {
                f,
                block_rows: 16 * tiles,
                warps: GEMV_MMA_WARPS,
                ks: GEMV_MMA_WARPS,
                shared: 0,
                opt_in: false,
            })
        }
        _ if t > GEMV_MAX_T => None,
        Weight::Dense(d) if d.dtype() == DType::BF16 && k.is_multiple_of(8) => cores(match t {
            1 if light => &kf.gemv_bf16_t1,
            2 if light => &kf.gemv_bf16_t2,
            _ => &kf.gemv_bf16,
        }),
        _ => None,
    }
}

/// How a GEMV launch stores its outputs.
#[derive(Clone, Copy)]
enum Out {
    /// bf16 `[t, n_p]` per part.
    Bf16,
    /// f32, rows `ld` elements apart.
    F32 { ld: usize },
}

/// The kernel and tiling that take `t` tokens of all of `ws` in one launch: one format, one input
/// width, at most GEMV_MAX_PARTS weights.
fn plan<'a>(b: &'a CudaBackend, t: usize, ws: &[&Weight<CudaBackend>]) -> Option<Tiling<'a>> {
    let (first, rest) = ws.split_first()?;
    let rows = ws.iter().map(|w| w.dims().0).sum();
    let tiling = kernel_for(b, first, t, rows)?;
    let k = first.dims().1;
    let same = |w: &Weight<CudaBackend>| {
        w.dims().1 == k && kernel_for(b, w, t, rows).is_some_and(|g| std::ptr::eq(g.f, tiling.f))
    };
    (ws.len() <= GEMV_MAX_PARTS && rest.iter().all(|w| same(w))).then_some(tiling)
}

/// Whether the GEMV kernels take `t` tokens of all of `ws` in one launch.
pub(crate) fn fits(b: &CudaBackend, t: usize, ws: &[&Weight<CudaBackend>]) -> bool {
    plan(b, t, ws).is_some()
}

/// `y_p [t, n_p] = x [t, k] · W_pᵀ` for every `(W_p, y_p)` of `parts`, whose weights `fits`
/// took, in one launch. `x` and each `y_p` are device addresses of `t * k` and `t * n_p` bf16
/// values, alive until the stream has run (the caller's tensors).
pub(crate) fn gemv(b: &CudaBackend, x: u64, t: usize, parts: &[(&Weight<CudaBackend>, u64)]) -> Result<()> {
    launch(b, x, t, parts, Out::Bf16)
}

/// A MoE block's routing logits for `t` tokens as f32 `[t, ld]` at `y`: the router's `n` rows in
/// columns `0..n`, the shared-expert gate's one row, if any, in column `n` (`fits` took both).
pub(crate) fn logits(
    b: &CudaBackend,
    x: u64,
    t: usize,
    router: &Weight<CudaBackend>,
    gate: Option<&Weight<CudaBackend>>,
    y: u64,
    ld: usize,
) -> Result<()> {
    let n = router.dims().0;
    check(ld >= n + gate.is_some() as usize, "moe_block", || format!("logits of {n} experts in rows of {ld}"))?;
    match gate {
        Some(g) => launch(b, x, t, &[(router, y), (g, y + 4 * n as u64)], Out::F32 { ld }),
        None => launch(b, x, t, &[(router, y)], Out::F32 { ld }),
    }
}

fn launch(b: &CudaBackend, x: u64, t: usize, parts: &[(&Weight<CudaBackend>, u64)], out: Out) -> Result<()> {
    let ws: Vec<_> = parts.iter().map(|(w, _)| *w).collect();
    let tiling =
        plan(b, t, &ws).ok_or_else(|| err(format!("linear: no GEMV kernel takes these weights at {t} tokens")))?;
    let first = ws[0];
    let Tiling { f, block_rows, warps, ks, shared, opt_in } = tiling;
    let mut p = GemvParts {
        w: [WeightDesc::of(first, "linear")?; GEMV_MAX_PARTS],
        y: [0; GEMV_MAX_PARTS],
        n: [0; GEMV_MAX_PARTS],
        ld: [0; GEMV_MAX_PARTS],
        first_block: [0; GEMV_MAX_PARTS],
        parts: parts.len() as i32,
        ks: ks as i32,
        f32_out: matches!(out, Out::F32 { .. }) as i32,
        pad: 0,
    };
    let mut blocks = 0;
    for (i, (w, y)) in parts.iter().enumerate() {
        let n = w.dims().0;
        p.w[i] = WeightDesc::of(w, "linear")?;
        p.y[i] = *y;
        p.n[i] = i32_of(n, "linear outputs")?;
        p.ld[i] = match out {
            Out::Bf16 => p.n[i],
            Out::F32 { ld } => i32_of(ld, "linear output stride")?,
        };
        p.first_block[i] = i32_of(blocks, "linear blocks")?;
        blocks += n.div_ceil(block_rows);
    }
    let ti = t as i32;
    if opt_in {
        allow_shared(f, shared, "gemv")?;
    }
    let mut l = Overlapped::new(b, f);
    l.arg(&p).arg(&x).arg(&ti);
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(blocks).map_err(|_| err("linear: too many rows"))?, 1, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    // SAFETY: gemv_bf16(_t1, _t2)(GemvParts p, const bf16* x, int t): 128 threads, 8 / ks rows per
    // block; gemv_bf16_mma{1,2}(_t16)(same): GEMV_MMA_WARPS (= ks) warps on 16 or 32 rows;
    // gemv_nvfp4(_t1, _t16)(same): up to GEMV_NV4_MAX_WARPS (= ks) warps on one 16-row block
    // (kernel_for, the kernels' own number); part i owns blocks first_block[i].. covering its n[i]
    // rows (for NVFP4, row blocks < ceil(n[i] / 16) of its tiled layout, nvfp4.rs); 1 <= t <=
    // GEMV_MAX_T (t = 1 for _t1, _t1s and _t2; t <= GEMV_MMA_MAX_T for _t16); gemv_nvfp4_t1 has
    // its staged x's frag_bytes(1, k) of dynamic shared memory (with its static part, at most the
    // default 48 KB); gemv_nvfp4_t1s, GEMV_NV4S_WARPS warps on ks = per <= GEMV_NV4S_MAX_PER row
    // blocks, has t1s_shared(per, k) (allowed above; with its static part, at most the opt-in
    // limit: nv4_t1s); every desc
    // describes a live [n_i, k] weight of this kernel's format whose bf16 rows are whole chunks of
    // its loads (kernel_for: 16 bytes, 32 inputs for the tensor-core kernels; NVFP4 reads whole
    // tiles, k % 16 == 0 validated at load); x holds t * k values, each y[i] t rows of ld[i] (>=
    // n[i]: bf16 outputs are [t, n[i]], the logits' parts are columns of one [t, ld] f32 buffer).
    // The kernel reads only weights before grid_dep_wait.
    unsafe { l.launch(cfg, "gemv") }
}

/// The C struct's layout is this one's (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    let mut checks = crate::kernels::c_layout!(GemvParts { w, y, n, ld, first_block, parts, ks, f32_out, pad });
    checks.push(crate::kernels::c_equal(
        "sizeof(float[GEMV_NV4_MAX_WARPS][1][4][32])",
        nv4_t1_static(crate::limits::GEMV_NV4_MAX_WARPS),
    ));
    checks.push(crate::kernels::c_equal("sizeof(float[GEMV_NV4S_MAX_PER][GEMV_NV4S_WARPS][NV4_ROWS])", NV4S_STATIC));
    checks
}
