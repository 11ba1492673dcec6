//! The whole MoE block for the few tokens of a decode step (kernels/moe_decode.cu), in four
//! launches and no host synchronisation: router and shared-expert-gate logits (ops/linear/gemv.rs,
//! as f32); routing on the device; the fused SwiGLU of each chosen expert and the shared expert;
//! down projections with the weighted combine, each launch overlapping the previous kernel's end
//! (launch.rs: before they wait, the logits kernel reads router weights and the shared expert's
//! gate/up blocks theirs; the down kernel, which the gate/up blocks let start only once they have
//! waited, reads the routing and, for NVFP4, its first weights; the routing kernel reads
//! nothing). Experts are read through the `MoeExperts`' resident expert table (table.rs), the
//! shared expert through its own weights.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use vt_core::{DType, MoeExperts, Ops, Result, Router, SharedExpert, Weight};

use super::routing::RouteArgs;
use super::table::expert_table;

use crate::device::{CudaBackend, CudaTensor};
use crate::error::err;
use crate::kernels::allow_shared;
use crate::launch::{act, i32_of, Overlapped};
use crate::limits::{MOE_DEC_MAX_T, NV4_K, NV4_ROWS, ROUTE_MAX_EXP, ROUTE_MAX_K};
use crate::nvfp4::frag_bytes;
use crate::ops::linear::gemv;
use crate::weight::WeightDesc;

/// The down kernel's static shared memory: a `WeightDesc` and a multiplier per slot of
/// `MOE_DEC_SLOTS` (MOE_DEC_MAX_T x (ROUTE_MAX_K + 1), kernels/moe_decode.cu).
const DOWN_STATIC_SHARED: usize = MOE_DEC_MAX_T * (ROUTE_MAX_K + 1) * (std::mem::size_of::<WeightDesc>() + 4);

/// Whether the down kernels can stage a token's `slots` activation rows of `inter` floats in the
/// dynamic shared memory a block may use on this device (`max_shared`). NVFP4 stages them as bf16
/// fragments in whole 64-input tiles (`nvfp4::frag_bytes`), never more bytes than this bound.
fn staged_fits(slots: usize, inter: usize, max_shared: usize) -> bool {
    4 * slots * inter.max(NV4_K) + DOWN_STATIC_SHARED <= max_shared
}

/// `struct SharedDesc` of kernels/moe_decode.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct SharedDesc {
    gate: WeightDesc,
    up: WeightDesc,
    down: WeightDesc,
    present: i32,
    gated: i32,
}

// SAFETY: #[repr(C)] plain data laid out as the CUDA struct (3 x 32-byte WeightDesc, 2 ints: 104
// bytes, 8-byte aligned, no implicit padding).
unsafe impl DeviceRepr for SharedDesc {}

/// The storage format all the block's expert matrices share: `Some(false)` bf16 with rows of
/// whole 16-byte chunks, `Some(true)` NVFP4 (any, in its tiled layout), `None` otherwise.
fn format(ws: &mut dyn Iterator<Item = &Weight<CudaBackend>>) -> Option<bool> {
    let mut fp4 = None;
    for w in ws {
        let this = match w {
            Weight::Dense(t) if t.dtype() == DType::BF16 && w.dims().1 % 8 == 0 => false,
            Weight::Nvfp4(_) => true,
            _ => return None,
        };
        if *fp4.get_or_insert(this) != this {
            return None;
        }
    }
    fp4
}

/// Whether the fused kernels take a call of `t` tokens of `width` activations, and then the
/// routed experts' format (`true`: NVFP4): t <= MOE_DEC_MAX_T tokens whose logits the GEMV kernels
/// take, a bf16 router, one expert format, a shared expert of the routed experts' width and
/// format (or bf16 beside NVFP4 experts, as ModelOpt exports them: the NVFP4 kernels run its
/// slot as bf16), a token's activations within the device's shared memory per block.
fn nvfp4_if_fits(
    b: &CudaBackend,
    (t, width): (usize, usize),
    router: &Router<CudaBackend>,
    experts: &MoeExperts<CudaBackend>,
    shared: Option<&SharedExpert<'_, CudaBackend>>,
) -> Option<bool> {
    let (h, inter, n_exp) = (experts.hidden, experts.intermediate, experts.experts.len());
    let top_k = router.kind.top_k();
    let bf16_vec = |w: &Weight<CudaBackend>, n: usize| {
        matches!(w, Weight::Dense(d) if d.dtype() == DType::BF16) && w.dims() == (n, h) && h % 8 == 0
    };
    let shared_fits = shared.is_none_or(|s| {
        s.gate.weight.dims() == (inter, h)
            && s.up.weight.dims() == (inter, h)
            && s.down.weight.dims() == (h, inter)
            && s.gate_proj.is_none_or(|g| bf16_vec(&g.weight, 1))
    });
    let logits: Vec<_> =
        std::iter::once(&router.weight.weight).chain(shared.and_then(|s| s.gate_proj).map(|g| &g.weight)).collect();
    let mut routed = experts.experts.iter().flat_map(|e| [&e.gate, &e.up, &e.down]);
    let mut shared_ws = shared.into_iter().flat_map(|s| [&s.gate.weight, &s.up.weight, &s.down.weight]);
    let fits = (1..=MOE_DEC_MAX_T).contains(&t)
        && width == h
        && n_exp <= ROUTE_MAX_EXP
        && (1..=ROUTE_MAX_K.min(n_exp)).contains(&top_k)
        && bf16_vec(&router.weight.weight, n_exp)
        && shared_fits
        && gemv::fits(b, t, &logits)
        && staged_fits(top_k + shared.is_some() as usize, inter, b.k().max_shared);
    let routed = format(&mut routed)?;
    // NVFP4 experts take a shared expert of either format; bf16 ones a bf16 one.
    let shared_format = shared.is_none() || matches!(format(&mut shared_ws), Some(fp4) if fp4 == routed || routed);
    (fits && shared_format).then_some(routed)
}

/// The fused block, in one call or NVFP4's chunks of one (`nvfp4_in_chunks`); `None` for calls
/// the fused kernels do not take.
pub(crate) fn fused(
    b: &CudaBackend,
    x: &CudaTensor,
    router: &Router<CudaBackend>,
    experts: &MoeExperts<CudaBackend>,
    shared: Option<&SharedExpert<'_, CudaBackend>>,
) -> Result<Option<CudaTensor>> {
    if nvfp4_if_fits(b, (x.rows(), x.last_dim()), router, experts, shared).is_some() {
        return moe_block(b, x, router, experts, shared).map(Some);
    }
    nvfp4_in_chunks(b, x, router, experts, shared)
}

/// Most tokens for which NVFP4 experts still take the fused kernels, MOE_DEC_MAX_T tokens a call,
/// each reading its tokens' experts once per token: the grouped prefill GEMMs, whose 64-slot
/// tiles an expert fills with one or two tokens at batch 32, made NVFP4 decode slower there than
/// bf16 (docs/performance.md).
const NV4_CHUNKED_MAX_T: usize = 32;

/// The fused block over chunks of MOE_DEC_MAX_T tokens, for NVFP4 experts of a call of more
/// tokens than one fused call takes and at most NV4_CHUNKED_MAX_T; `None` for other calls.
fn nvfp4_in_chunks(
    b: &CudaBackend,
    x: &CudaTensor,
    router: &Router<CudaBackend>,
    experts: &MoeExperts<CudaBackend>,
    shared: Option<&SharedExpert<'_, CudaBackend>>,
) -> Result<Option<CudaTensor>> {
    let t = x.rows();
    let chunk = (MOE_DEC_MAX_T, x.last_dim());
    if t <= MOE_DEC_MAX_T || t > NV4_CHUNKED_MAX_T || nvfp4_if_fits(b, chunk, router, experts, shared) != Some(true) {
        return Ok(None);
    }
    let parts = (0..t)
        .step_by(MOE_DEC_MAX_T)
        .map(|r| moe_block(b, &b.slice_rows(x, r, MOE_DEC_MAX_T.min(t - r))?, router, experts, shared))
        .collect::<Result<Vec<_>>>()?;
    vt_core::backend::stack_rows(b, parts).map(Some)
}

/// The fused block, for a call that `nvfp4_if_fits` takes.
fn moe_block(
    b: &CudaBackend,
    x: &CudaTensor,
    router: &Router<CudaBackend>,
    experts: &MoeExperts<CudaBackend>,
    shared: Option<&SharedExpert<'_, CudaBackend>>,
) -> Result<CudaTensor> {
    let fp4 = nvfp4_if_fits(b, (x.rows(), x.last_dim()), router, experts, shared)
        .ok_or_else(|| err("moe_block: the fused decode kernels do not take this call"))?;
    let (t, h, inter, n_exp) = (x.rows(), experts.hidden, experts.intermediate, experts.experts.len());
    let top_k = router.kind.top_k();
    let px = act(x, "moe_block")?;
    let table = expert_table(b, experts)?.descs();

    let ra = RouteArgs::new(router, n_exp, "moe_block")?;
    let router_desc = WeightDesc::of(&router.weight.weight, "moe_block")?;
    let sh = match shared {
        Some(s) => SharedDesc {
            gate: WeightDesc::of(&s.gate.weight, "moe_block")?,
            up: WeightDesc::of(&s.up.weight, "moe_block")?,
            down: WeightDesc::of(&s.down.weight, "moe_block")?,
            present: 1,
            gated: s.gate_proj.is_some() as i32,
        },
        None => SharedDesc { gate: router_desc, up: router_desc, down: router_desc, present: 0, gated: 0 },
    };
    let slots = top_k + sh.present as usize;

    // One scratch block: act [t * slots, inter] f32 first (16-byte aligned rows: inter % 8 == 0,
    // and the kernels read them as float4), then logits [t, n_exp + 1] f32, slot ids i32 and slot
    // weights f32 [t * slots].
    let (n_act, n_logits, n_slots) = (t * slots * inter, t * (n_exp + 1), t * slots);
    let scratch = b.buffer(4 * (n_act + n_logits + 2 * n_slots))?;
    let p_act = scratch.ptr();
    let p_logits = p_act + 4 * n_act as u64;
    let p_ids = p_logits + 4 * n_logits as u64;
    let p_w = p_ids + 4 * n_slots as u64;
    let out = b.empty(DType::BF16, x.shape())?;
    let p_out = out.buffer().ptr();
    let (ti, gated, si, ii) = (t as i32, sh.gated, slots as i32, i32_of(inter, "intermediate")?);
    let hi = i32_of(h, "hidden")?;

    let gate_w = shared.and_then(|s| s.gate_proj).map(|g| &g.weight);
    gemv::logits(b, px, t, &router.weight.weight, gate_w, p_logits, n_exp + 1)?;

    let mut l = Overlapped::new(b, &b.k().moe_dec_route);
    l.arg(&p_ids).arg(&p_w).arg(&p_logits).arg(&ra).arg(&gated).arg(&si);
    // A thread per expert (route_block ranks with one), whole warps.
    let threads = (n_exp.div_ceil(32) * 32).clamp(128, ROUTE_MAX_EXP) as u32;
    let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: moe_dec_route(int* slot_ids, float* slot_w, const float* logits, RouteArgs ra,
    // int gated, int slots): a block per token of 128..=512 threads (whole warps, at least n_exp:
    // route_block's thread per expert); logits [t, n_exp + 1] written by the previous
    // kernel on this stream; slot ids and weights hold t * slots each; n_exp <= 512, top_k <= 32.
    unsafe { l.launch(cfg, "moe_dec_route")? };

    // bf16: a warp per unit, MOE_DEC_GU_WARPS a block; NVFP4: a block per 16 units (a row block of
    // the tiled layout), its MOE_NV4_WARPS warps splitting the inputs.
    let (gate_up, units, warps) = if fp4 {
        (&b.k().moe_dec_gate_up_nvfp4, NV4_ROWS, b.k().shapes.moe_warps)
    } else {
        let warps = b.k().shapes.moe_bf16_gate_up_warps;
        (&b.k().moe_dec_gate_up_bf16, warps, warps)
    };
    let mut l = Overlapped::new(b, gate_up);
    l.arg(&p_act).arg(&p_ids).arg(&px).arg(&table).arg(&sh).arg(&si).arg(&ii);
    // NVFP4 stages the token's x as B fragments (kernels/nvfp4.cuh: nv4_stage_round).
    let x_frags = if fp4 { frag_bytes(1, h) } else { 0 };
    if fp4 {
        allow_shared(gate_up, x_frags, "moe_dec_gate_up")?;
    }
    let cfg = LaunchConfig {
        grid_dim: ((t * slots) as u32, inter.div_ceil(units) as u32, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: x_frags as u32,
    };
    // SAFETY: moe_dec_gate_up_*(float* act, const int* slot_ids, const bf16* x, const WeightDesc*
    // table, SharedDesc sh, int slots, int inter): grid (t * slots, ceil(inter / units)) of 32
    // MOE_DEC_GU_WARPS threads (NVFP4: 32 MOE_NV4_WARPS; the kernels' own numbers; row blocks <
    // ceil(inter / 16) of the tiled layout); slot ids (written by the previous kernel on this
    // stream) are experts < n_exp or -1; the table has 3 * n_exp descs (gate and up [inter, h],
    // down [h, inter]) of the one format `fp4` names, as are the shared expert's, or they are
    // bf16 beside NVFP4 experts, with rows of whole 16-byte chunks (checked); act holds t * slots
    // * inter floats; NVFP4: dynamic shared memory for ceil(h / 64) * 128 bytes (allowed above).
    unsafe { l.launch(cfg, "moe_dec_gate_up")? };

    // Both stage a token's activations in dynamic shared memory: bf16 as f32, NVFP4 as B
    // fragments. bf16: one resident wave (MOE_DEC_THREADS, MOE_DEC_WAVE_BF16 of
    // kernels/moe_decode.cu; one token's kernel MOE_DEC_T1_*), no more blocks than output rows.
    // NVFP4: a block of MOE_NV4_DOWN_WARPS warps (MOE_NV4_DOWN1_WARPS for one token) per (16-row
    // block of the output, token).
    let staged = if fp4 { frag_bytes(slots, inter) } else { 4 * slots * inter };
    let (down, grid, threads) = if fp4 {
        let grid = (h.div_ceil(NV4_ROWS) as u32, t as u32, 1);
        match t {
            1 => (&b.k().moe_dec_down_nvfp4_t1, grid, 32 * b.k().shapes.moe_down1_warps),
            _ => (&b.k().moe_dec_down_nvfp4, grid, 32 * b.k().shapes.moe_down_warps),
        }
    } else {
        let shape = &b.k().shapes;
        let (kernel, wave, threads) = match t {
            1 => (&b.k().moe_dec_down_bf16_t1, shape.moe_bf16_down1_wave, shape.moe_bf16_down1_threads),
            _ => (&b.k().moe_dec_down_bf16, shape.moe_bf16_down_wave, shape.moe_bf16_down_threads),
        };
        let grid = ((t * h).min(wave * b.k().sm_count).max(1) as u32, 1, 1);
        (kernel, grid, threads)
    };
    allow_shared(down, staged, "moe_dec_down")?;
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (threads as u32, 1, 1), shared_mem_bytes: staged as u32 };
    let mut l = Overlapped::new(b, down);
    l.arg(&p_out).arg(&p_act).arg(&p_ids).arg(&p_w).arg(&table).arg(&sh).arg(&ti).arg(&si).arg(&hi).arg(&ii);
    // SAFETY: moe_dec_down_*(bf16* out, const float* act, const int* slot_ids, const float*
    // slot_w, const WeightDesc* table, SharedDesc sh, int t, int slots, int hidden, int inter):
    // dynamic shared memory for slots * inter floats (bf16) or slots * ceil(inter / 64) * 128
    // bytes (NVFP4), allowed above; bf16: MOE_DEC_THREADS (_t1: MOE_DEC_T1_THREADS) threads a
    // block; NVFP4: 32 MOE_NV4_DOWN_WARPS (_t1: MOE_NV4_DOWN1_WARPS) threads (the kernels' own
    // numbers), grid (ceil(h / 16), t), row blocks < ceil(h / 16) of each down matrix's tiled
    // layout; the slot ids and weights (t * slots each, from the routing kernel, which has ended
    // once the gate/up kernel lets this one start) pick down matrices [h, inter] of the table and
    // the shared expert, as for the gate/up kernel; act holds t * slots * inter floats (rows of
    // whole 8-byte pairs: inter % 8 == 0); out t * h values.
    unsafe { l.launch(cfg, "moe_dec_down")? };
    Ok(out)
}

/// The C struct's layout is this one's, and the down kernel's static shared memory is
/// DOWN_STATIC_SHARED (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    let mut checks = crate::kernels::c_layout!(SharedDesc { gate, up, down, present, gated });
    checks.push(crate::kernels::c_equal("(sizeof(WeightDesc) + sizeof(float)) * MOE_DEC_SLOTS", DOWN_STATIC_SHARED));
    checks
}

#[cfg(test)]
mod tests {
    use super::{frag_bytes, staged_fits, DOWN_STATIC_SHARED};

    /// Qwen3.5-35B-A3B's 8 + 1 slots of 512 fit everywhere; 33 slots of 1536 (a wide top-32 expert)
    /// fit an H200's block but not an A100's, which then takes the composed ops.
    #[test]
    fn the_down_kernel_stages_within_the_devices_shared_memory() {
        let (h200, a100, sm89) = (232_448, 166_912, 101_376);
        assert!(staged_fits(9, 512, sm89));
        assert!(staged_fits(33, 1536, h200));
        assert!(!staged_fits(33, 1536, a100));
        assert!(!staged_fits(9, 8192, h200));
    }

    /// Where the bound lets a call through, the NVFP4 down kernel's bf16 fragments (whole 64-input
    /// tiles, so more bytes than f32 for an expert narrower than 64) fit as well as bf16's f32 rows.
    #[test]
    fn the_bound_covers_the_nvfp4_fragments() {
        for slots in 1..=33 {
            for inter in (16..=4096).step_by(16) {
                let (f32_rows, frags) = (4 * slots * inter, frag_bytes(slots, inter));
                // Devices whose shared memory ends exactly at either need, and an sm_89 block.
                for max_shared in [f32_rows, frags].map(|b| b + DOWN_STATIC_SHARED).into_iter().chain([101_376]) {
                    if staged_fits(slots, inter, max_shared) {
                        assert!(f32_rows + DOWN_STATIC_SHARED <= max_shared, "{slots} x {inter}: f32");
                        assert!(frags + DOWN_STATIC_SHARED <= max_shared, "{slots} x {inter}: fragments");
                    }
                }
            }
        }
    }
}
