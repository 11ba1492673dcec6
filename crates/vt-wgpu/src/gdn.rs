//! The gated delta rule (Gated DeltaNet's linear attention): the gates (gdn_gates.wgsl), then
//! the form the caller asks for, as vt-cpu computes each: token by token (gdn.wgsl) for decode,
//! or in chunks of 64 tokens for prefill: a first pass over every chunk at once, which reads no
//! state (gdn_chunk.wgsl), then a pass through the chunks in order carrying the state
//! (gdn_state.wgsl). The first pass's scratch is bounded: a long prompt goes through in groups of
//! chunks.

use vt_core::{GdnInputs, GdnMode, Result, Tensor};

use crate::gpu::err;
use crate::shaders::Kernel;
use crate::{act, u32_of, WgpuBackend, WG};

/// Tokens per chunk (gdn_layout.wgsl's CHUNK; vt-cpu's GDN_CHUNK).
const CHUNK: usize = 64;
/// The most scratch one group of chunks takes.
const SCRATCH_BYTES: usize = 64 << 20;
/// The largest key head dimension gdn.wgsl keeps in workgroup memory.
const MAX_KEY_DIM: usize = 256;

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
            let params = [t, kh, vh, dk, dv, ((d.key_dim as f64).sqrt() as f32).to_bits()];
            let bindings = [
                (1, q.range()),
                (2, k.range()),
                (3, v.range()),
                (4, gb.buffer().range()),
                (5, s.range()),
                (6, out.buffer().range()),
            ];
            b.gpu.dispatch(Kernel::Gdn, &params, &bindings, [b.gpu.axis(d.value_heads, op)?, 1, 1])?;
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
                let bindings = [(1, scratch.buffer().range()), (2, s.range()), (3, out.buffer().range())];
                let groups = [b.gpu.axis(d.value_dim.div_ceil(WG), op)?, b.gpu.axis(d.value_heads, op)?, 1];
                b.gpu.dispatch(Kernel::GdnState, &params, &bindings, groups)?;
                first += n;
            }
        }
    }
    Ok(out)
}
