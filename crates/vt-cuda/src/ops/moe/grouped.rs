//! The routed-experts block for many tokens (prefill) as grouped tensor-core GEMMs
//! (kernels/moe_prefill.cu for bf16 experts, kernels/w4a16.cu for NVFP4, both over the experts'
//! own weights through the expert table): router logits through
//! cuBLASLt in f32, routing and expert-sorted slots on the device, the gate/up and down GEMMs over
//! the expert table (table.rs) kept in the `MoeExperts`' resident slot, and the combine. Nothing
//! waits for the host: the number of tiles is only known on the device, so the grids cover the
//! most tiles any routing can need and the spare blocks return at once.
//!
//! The SwiGLU activations are rounded to bf16 for the down GEMM's tensor cores (vt-cpu keeps
//! them in f32), one extra rounding of relative size u/2.

use cudarc::cublaslt::sys::cudaDataType_t;
use cudarc::driver::{result, LaunchConfig, PushKernelArg};
use vt_core::{DType, MoeExperts, Result, Router, Weight};

use super::routing::RouteArgs;
use super::table::expert_table;

use crate::device::{CudaBackend, CudaTensor};
use crate::error::driver_err;
use crate::kernels::allow_shared;
use crate::launch::{act, grid1, i32_of, launched};
use crate::limits::{MP_BK, MP_BM, MP_BN, MP_STAGES, MP_THREADS, ROUTE_MAX_EXP, ROUTE_MAX_K};
use crate::w4a16;

/// Dynamic shared memory of the bf16 GEMMs: MP_STAGES stages of an A and a B tile.
const GEMM_SHARED: usize = MP_STAGES * (MP_BM + MP_BN) * MP_BK * 2;

/// Tiles of `rows` slots that any routing of `slots` over `n_exp` experts can need:
/// sum(ceil(count_e / rows)) <= slots / rows + n_exp. The GEMM grids' second dimension.
fn tile_bound(slots: usize, n_exp: usize, rows: usize) -> usize {
    slots / rows + n_exp
}

fn is_bf16(w: &Weight<CudaBackend>) -> bool {
    matches!(w, Weight::Dense(t) if t.dtype() == DType::BF16)
}

/// NVFP4 (rows of whole 16-code scale groups, validated at load, in the tiled layout).
fn is_nvfp4(w: &Weight<CudaBackend>) -> bool {
    matches!(w, Weight::Nvfp4(_))
}

/// Whether this layer and batch take the grouped path: several tokens, a bf16 router, experts all
/// bf16 or all NVFP4, and shapes the kernels and cuBLASLt take (16-byte rows, at most 512 experts).
pub(crate) fn fits(x: &CudaTensor, router: &Router<CudaBackend>, experts: &MoeExperts<CudaBackend>) -> bool {
    let (h, inter, n_exp) = (experts.hidden, experts.intermediate, experts.experts.len());
    x.rows() > 1
        && tile_bound(x.rows() * router.kind.top_k(), n_exp, MP_BM.min(w4a16::MOE_TILE_ROWS)) <= 65535
        && x.last_dim() == h
        && h % 8 == 0
        && inter % 8 == 0
        && n_exp % 8 == 0
        && n_exp <= ROUTE_MAX_EXP
        && (1..=ROUTE_MAX_K.min(n_exp)).contains(&router.kind.top_k())
        && is_bf16(&router.weight.weight)
        && router.weight.weight.dims() == (n_exp, h)
        && [is_bf16, is_nvfp4].iter().any(|f| experts.experts.iter().all(|e| f(&e.gate) && f(&e.up) && f(&e.down)))
}

pub(crate) fn moe(
    b: &CudaBackend,
    x: &CudaTensor,
    router: &Router<CudaBackend>,
    experts: &MoeExperts<CudaBackend>,
) -> Result<CudaTensor> {
    let op = "moe";
    let (h, inter, n_exp, top_k) = (experts.hidden, experts.intermediate, experts.experts.len(), router.kind.top_k());
    let (t, px) = (x.rows(), act(x, op)?);
    let slots = t * top_k;
    let ra = RouteArgs::new(router, n_exp, op)?;
    let table = expert_table(b, experts)?;
    // NVFP4 experts run the W4A16 kernels, with the same arguments. Both kinds of gate/up kernel
    // take 64 units a block (MP_BN = W4_BN = 128 weight rows: gate and up rows of 64 units).
    let table = table.descs();
    let (gate_up, down, threads, shared, tile_rows) = if is_nvfp4(&experts.experts[0].gate) {
        let (gu, dn) = (&b.k().moe_w4_gate_up, &b.k().moe_w4_down);
        allow_shared(gu, w4a16::MOE_SHARED, "moe_w4_gate_up")?;
        allow_shared(dn, w4a16::MOE_SHARED, "moe_w4_down")?;
        (gu, dn, 256, w4a16::MOE_SHARED, w4a16::MOE_TILE_ROWS)
    } else {
        let (gu, dn) = (&b.k().moe_gemm_gate_up, &b.k().moe_gemm_down);
        allow_shared(gu, GEMM_SHARED, "moe_gemm_gate_up")?;
        allow_shared(dn, GEMM_SHARED, "moe_gemm_down")?;
        (gu, dn, MP_THREADS, GEMM_SHARED, MP_BM)
    };
    let Weight::Dense(rw) = &router.weight.weight else { unreachable!("fits() checked a dense router") };

    let logits = b.buffer(t * n_exp * 4)?;
    // SAFETY: x holds t * h bf16, the router n_exp * h bf16 (checked by fits), logits t * n_exp
    // f32; all live until the stream has run the GEMM.
    unsafe {
        b.gemm().xwt(b.stream(), px, rw.buffer().ptr(), logits.ptr(), t, n_exp, h, cudaDataType_t::CUDA_R_32F, 1.0)?
    };

    let max_tiles = tile_bound(slots, n_exp, tile_rows);
    let (ids, weights) = (b.buffer(slots * 4)?, b.buffer(slots * 4)?);
    // Counts, then the scatter's fill cursors.
    let counts = b.buffer(2 * n_exp * 4)?;
    // SAFETY: the block holds 2 * n_exp ints; stream-ordered before the kernels that count.
    unsafe { result::memset_d8_async(counts.ptr(), 0, counts.len(), b.stream().cu_stream()) }
        .map_err(|e| driver_err("memset", e))?;
    let (offsets, tiles, n_tiles) = (b.buffer(n_exp * 4)?, b.buffer(max_tiles * 8)?, b.buffer(4)?);
    let (sorted_tok, slot_pos) = (b.buffer(slots * 4)?, b.buffer(slots * 4)?);
    let act_buf = b.buffer(slots * inter * 2)?;
    let y = b.buffer(slots * h * 2)?;
    let out = b.empty(DType::BF16, x.shape())?;
    let (pids, pw, pcnt, pfill) = (ids.ptr(), weights.ptr(), counts.ptr(), counts.ptr() + (n_exp * 4) as u64);
    let (plog, poff, ptiles, pnt, psort, ppos, pact, py, pout) = (
        logits.ptr(),
        offsets.ptr(),
        tiles.ptr(),
        n_tiles.ptr(),
        sorted_tok.ptr(),
        slot_pos.ptr(),
        act_buf.ptr(),
        y.ptr(),
        out.buffer().ptr(),
    );
    let (ti, ne, tk, ii, hi, si) = (
        i32_of(t, "tokens")?,
        n_exp as i32,
        top_k as i32,
        i32_of(inter, "intermediate")?,
        i32_of(h, "hidden")?,
        i32_of(slots, "slots")?,
    );

    let mut l = b.stream().launch_builder(&b.k().moe_prefill_route);
    l.arg(&pids).arg(&pw).arg(&pcnt).arg(&plog).arg(&ti).arg(&ra);
    let cfg = LaunchConfig { grid_dim: (t.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: moe_prefill_route(int* ids, float* weights, int* counts, const float* logits, int t,
    // RouteArgs ra): one warp per token; logits [t, n_exp] with n_exp <= 512, ids/weights
    // t * top_k with top_k <= 32 (fits), counts n_exp zeroed ints, ra's bias null or n_exp values
    // (check::moe).
    launched(unsafe { l.launch(cfg) }, "moe_prefill_route")?;

    let mut l = b.stream().launch_builder(&b.k().moe_prefill_plan);
    let tile_rows_i = tile_rows as i32;
    l.arg(&poff).arg(&ptiles).arg(&pnt).arg(&pcnt).arg(&ne).arg(&tile_rows_i);
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: moe_prefill_plan(int* offsets, int* tiles, int* n_tiles, const int* counts, int
    // n_exp, int tile_rows): one block of the 256 threads it is written for, n_exp <= ROUTE_MAX_EXP
    // = 512 (fits), tile_rows the row count of the GEMM kernels launched below (64 or 128);
    // offsets n_exp ints; tiles holds 2 * max_tiles ints, and the tiles of any routing number
    // sum(ceil(count_e / tile_rows)) <= slots / tile_rows + n_exp = max_tiles.
    launched(unsafe { l.launch(cfg) }, "moe_prefill_plan")?;

    let mut l = b.stream().launch_builder(&b.k().moe_prefill_scatter);
    l.arg(&psort).arg(&ppos).arg(&pfill).arg(&pids).arg(&poff).arg(&si).arg(&tk);
    // SAFETY: moe_prefill_scatter(int* sorted_tok, int* slot_pos, int* fill, const int* ids,
    // const int* offsets, int slots, int top_k): one thread per slot; every id < n_exp, and the
    // rows of expert e (offsets[e] + fill) stay below offsets[e] + counts[e] <= slots.
    launched(unsafe { l.launch(grid1(slots)) }, "moe_prefill_scatter")?;

    let gemm_cfg = |n_out: usize| LaunchConfig {
        grid_dim: (n_out.div_ceil(MP_BN) as u32, max_tiles as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let mut l = b.stream().launch_builder(gate_up);
    l.arg(&pact).arg(&px).arg(&psort).arg(&table).arg(&ptiles).arg(&pnt).arg(&pcnt).arg(&poff).arg(&ii).arg(&hi);
    // SAFETY: moe_gemm_gate_up / moe_w4_gate_up(bf16* act, const bf16* x, const int* sorted_tok,
    // const WeightDesc* table, const int* tiles, const int* n_tiles, const int* counts, const int*
    // offsets, int inter, int hidden), block size and shared memory as each kernel wants (allowed
    // above): each expert's gate and up are [inter, h] matrices (table.rs), all bf16 or all NVFP4
    // in the tiled layout (nvfp4.rs), as `fits` checked and the kernels were picked; h and inter
    // are multiples of 8 (16-byte rows); every tile's rows lie in its expert's range of the slots
    // rows of act [slots, inter]; sorted_tok < t rows of x.
    launched(unsafe { l.launch(gemm_cfg(2 * inter)) }, "moe gate/up GEMM")?;
    let mut l = b.stream().launch_builder(down);
    l.arg(&py).arg(&pact).arg(&table).arg(&ptiles).arg(&pnt).arg(&pcnt).arg(&poff).arg(&ii).arg(&hi);
    // SAFETY: moe_gemm_down / moe_w4_down(bf16* y, const bf16* act, const WeightDesc* table, the
    // same four tile arrays, int inter, int hidden): each expert's down is [h, inter] in the
    // format of the table as above; y is [slots, h] bf16, rows as above.
    launched(unsafe { l.launch(gemm_cfg(h)) }, "moe down GEMM")?;

    let mut l = b.stream().launch_builder(&b.k().moe_prefill_combine);
    l.arg(&pout).arg(&py).arg(&ppos).arg(&pids).arg(&pw).arg(&tk).arg(&hi);
    let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: moe_prefill_combine(bf16* out, const bf16* y, const int* slot_pos, const int*
    // ids, const float* weights, int top_k, int hidden): one block of 256 threads per token,
    // top_k <= 32 (ROUTE_MAX_K), hidden % 4 == 0 (its 8-byte loads of y and stores into out, fresh
    // allocations, stay aligned); every slot_pos < slots rows of y.
    launched(unsafe { l.launch(cfg) }, "moe_prefill_combine")?;
    Ok(out)
}
