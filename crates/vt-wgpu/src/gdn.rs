//! The gated delta rule (Gated DeltaNet's linear attention): the gates (gdn_gates.wgsl), then
//! the form the caller asks for, as vt-cpu computes each: token by token (gdn.wgsl) for decode,
//! or in chunks of 64 tokens for prefill: a first pass over every chunk at once, which reads no
//! state (gdn_chunk.wgsl), then a pass through the chunks in order carrying the state
//! (gdn_state.wgsl). The first pass's scratch is bounded: a long prompt goes through in groups of
//! chunks. The token-by-token and state passes run each invocation through every token or chunk
//! they are given, so they take as many per dispatch as keeps an invocation's loops within
//! `LOOP_BUDGET` (lavapipe ends them silently beyond it).

use vt_core::{GdnInputs, GdnMode, Result, Tensor};

use crate::gpu::{err, LOOP_BUDGET};
use crate::shaders::Kernel;
use crate::{act, u32_of, WgpuBackend, WG};

/// Tokens per chunk (gdn_layout.wgsl's CHUNK; vt-cpu's GDN_CHUNK).
const CHUNK: usize = 64;
/// The most scratch one group of chunks takes.
const SCRATCH_BYTES: usize = 64 << 20;
/// The largest key head dimension gdn.wgsl keeps in workgroup memory.
const MAX_KEY_DIM: usize = 256;

/// Iterations of a loop over `n` items, as `LOOP_BUDGET` counts them.
fn iterations(n: usize) -> usize {
    n + 1
}

/// gdn.wgsl's loop iterations per token of its busiest invocation (the one that also takes the
/// norms): the token loop, q and k's load, the norms, then its value columns' two passes over
/// the key dimension.
fn recurrent_loops_per_token(dk: usize, dv: usize) -> usize {
    let columns = dv.div_ceil(WG);
    1 + iterations(dk.div_ceil(WG)) + iterations(dk) + iterations(columns) + columns * 2 * iterations(dk)
}

/// gdn_state.wgsl's loop iterations per chunk of (at most) CHUNK tokens: the chunk loop, the
/// corrections (a pass over the key dimension each), the outputs (a pass over the key dimension
/// and the chunk so far each), the state update (a pass over the chunk a key row).
fn state_loops_per_chunk(dk: usize) -> usize {
    let corrections = iterations(CHUNK) + CHUNK * iterations(dk);
    let outputs = iterations(CHUNK) + CHUNK * iterations(dk) + (1..=CHUNK).map(iterations).sum::<usize>();
    let update = iterations(dk) + dk * iterations(CHUNK);
    1 + corrections + outputs + update
}

/// How many of `total` items, each taking `per` loop iterations, one dispatch takes.
fn per_dispatch(per: usize, total: usize) -> usize {
    (LOOP_BUDGET / per).clamp(1, total.max(1))
}

pub fn gated_delta_rule(
    b: &WgpuBackend,
    inp: &GdnInputs<'_, WgpuBackend>,
    state: &mut Tensor<WgpuBackend>,
    mode: GdnMode,
) -> Result<Tensor<WgpuBackend>> {
    let op = "gated_delta_rule";
    let d = inp.dims(b, state)?;
    if d.key_dim > MAX_KEY_DIM {
        return Err(err(format!("{op}: key head dimension {} exceeds the shader's {MAX_KEY_DIM}", d.key_dim)));
    }
    let (q, k, v, a, bb, s) =
        (act(inp.q, op)?, act(inp.k, op)?, act(inp.v, op)?, act(inp.a, op)?, act(inp.b, op)?, act(state, op)?);
    let out = b.output(&[d.t, d.value_heads, d.value_dim])?;
    if d.t == 0 || d.key_dim == 0 || d.value_dim == 0 {
        return Ok(out);
    }
    let (a_log, dt_bias) = (b.small_f32(inp.a_log, op)?, b.small_f32(inp.dt_bias, op)?);
    let count = d.t * d.value_heads;
    let gb = b.output(&[2, count])?;
    let bindings = [
        (1, a.range()),
        (2, bb.range()),
        (3, a_log.buffer().range()),
        (4, dt_bias.buffer().range()),
        (5, gb.buffer().range()),
    ];
    let params = [u32_of(count, op)?, u32_of(d.value_heads, op)?];
    b.gpu.dispatch(Kernel::GdnGates, &params, &bindings, b.gpu.grid(count, WG)?)?;
    let u = |n| u32_of(n, op);
    let (t, kh, vh, dk, dv) = (u(d.t)?, u(d.key_heads)?, u(d.value_heads)?, u(d.key_dim)?, u(d.value_dim)?);
    match mode {
        GdnMode::Recurrent => {
            // q is divided by sqrt(key_dim), as vt-cpu's recurrent form does.
            let scale = ((d.key_dim as f64).sqrt() as f32).to_bits();
            let bindings = [
                (1, q.range()),
                (2, k.range()),
                (3, v.range()),
                (4, gb.buffer().range()),
                (5, s.range()),
                (6, out.buffer().range()),
            ];
            let step = per_dispatch(recurrent_loops_per_token(d.key_dim, d.value_dim), d.t);
            for first in (0..d.t).step_by(step) {
                let params = [t, kh, vh, dk, dv, scale, u(first)?, u(step.min(d.t - first))?];
                b.gpu.dispatch(Kernel::Gdn, &params, &bindings, [b.gpu.axis(d.value_heads, op)?, 1, 1])?;
            }
        }
        GdnMode::Chunked => {
            // q is multiplied by key_dim^-0.5, as vt-cpu's chunked form does.
            let scale = ((d.key_dim as f64).powf(-0.5) as f32).to_bits();
            let block = CHUNK * (3 * d.key_dim + d.value_dim + 2 * CHUNK) + CHUNK;
            let chunks = d.t.div_ceil(CHUNK);
            let per_group = (SCRATCH_BYTES / (block * 4 * d.value_heads)).clamp(1, chunks);
            let scratch = b.output(&[per_group * d.value_heads * block])?;
            let mut first = 0;
            while first < chunks {
                let n = per_group.min(chunks - first);
                let params = [t, kh, vh, dk, dv, scale, u32_of(first, op)?, u32_of(n, op)?];
                let bindings = [
                    (1, q.range()),
                    (2, k.range()),
                    (3, v.range()),
                    (4, gb.buffer().range()),
                    (5, scratch.buffer().range()),
                ];
                let groups = [b.gpu.axis(d.value_heads, op)?, b.gpu.axis(n, op)?, 1];
                b.gpu.dispatch(Kernel::GdnChunk, &params, &bindings, groups)?;
                // The state pass in turns of chunks, each binding its chunks' blocks (a chunk's
                // blocks of every head are consecutive, 256-byte multiples, as bindings are placed).
                let groups = [b.gpu.axis(d.value_dim.div_ceil(WG), op)?, b.gpu.axis(d.value_heads, op)?, 1];
                let turn = per_dispatch(state_loops_per_chunk(d.key_dim), n);
                let chunk_bytes = d.value_heads * block * 4;
                for c in (0..n).step_by(turn) {
                    let m = turn.min(n - c);
                    let params = [t, kh, vh, dk, dv, scale, u(first + c)?, u(m)?];
                    let blocks = scratch.buffer().sub(c * chunk_bytes, m * chunk_bytes);
                    let bindings = [(1, blocks), (2, s.range()), (3, out.buffer().range())];
                    b.gpu.dispatch(Kernel::GdnState, &params, &bindings, groups)?;
                }
                first += n;
            }
        }
    }
    Ok(out)
}
