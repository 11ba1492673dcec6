//! The CPU MoE block: routing, then SwiGLU experts read through the layer's expert table.
//!
//! The expert table is resident state derived from the experts, built on first use and kept in
//! the `MoeExperts`' own `ResidentSlot`: gate and up rows repacked pairwise into one matrix (so one
//! pass over the input yields both halves of each SwiGLU unit) and raw row pointers into each
//! expert's down projection. It depends on the experts' values and addresses exactly as a GPU
//! expert-pointer table or a repacked quantized layout does, which is what lets the lifetime tests
//! reproduce the original bug class on the CPU.

use std::sync::Arc;

use rayon::prelude::*;
use vt_core::{MoeExperts, Result, Router, RouterKind};

use super::matmul::matmul;
use super::norm::{sigmoid, silu};
use super::rows::RowSource;
use crate::alloc::{Allocator, CpuBuffer};
use crate::CpuBackend;

/// Gate and up of one expert as one `[2 * intermediate, hidden]` matrix, rows interleaved.
struct FusedGateUp {
    /// What `rows` points into.
    _buffers: Vec<CpuBuffer>,
    rows: RowSource,
}

pub struct CpuExpertTable {
    gate_up: Vec<FusedGateUp>,
    /// Raw rows of each expert's down projection, valid while the owning `MoeExperts` lives: the
    /// table sits in that owner's slot, so it cannot outlive the storage it points into.
    down: Vec<RowSource>,
}

pub fn build_table(alloc: &Arc<Allocator>, experts: &MoeExperts<CpuBackend>) -> Result<CpuExpertTable> {
    let gate_up = experts
        .experts
        .iter()
        .enumerate()
        .map(|(e, ex)| {
            let (buffers, rows) = RowSource::pair(alloc, &ex.gate, &ex.up, &format!("expert {e}"))?;
            Ok(FusedGateUp { _buffers: buffers, rows })
        })
        .collect::<Result<Vec<_>>>()?;
    let down = experts.experts.iter().map(|ex| RowSource::of(&ex.down)).collect();
    Ok(CpuExpertTable { gate_up, down })
}

/// Chosen experts and their weights for one token, in rank order: a higher choice value first, an
/// equal one at the lower expert index; a NaN value ranks after every number (as vt-cuda's kernels).
pub fn route(logits: &[f32], kind: &RouterKind, bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let top = |choice: &[f32], k: usize| {
        let key = |e: usize| if choice[e].is_nan() { f32::NEG_INFINITY } else { choice[e] };
        let mut idx: Vec<usize> = (0..choice.len()).collect();
        // Stable sort: among equal keys the lower expert index wins.
        idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
        idx.truncate(k);
        idx
    };
    match *kind {
        RouterKind::Softmax { top_k, renormalize } => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let probs: Vec<f32> = exps.iter().map(|e| e / sum).collect();
            let chosen = top(&probs, top_k);
            let norm = if renormalize { chosen.iter().map(|&e| probs[e]).sum::<f32>() } else { 1.0 };
            chosen.into_iter().map(|e| (e, probs[e] / norm)).collect()
        }
        RouterKind::Sigmoid { top_k, softcap, renormalize, routed_scaling } => {
            let scores: Vec<f32> = logits
                .iter()
                .map(|&l| {
                    sigmoid(match softcap {
                        Some(c) => c * (l / c).tanh(),
                        None => l,
                    })
                })
                .collect();
            let choice: Vec<f32> = match bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            let chosen = top(&choice, top_k);
            let norm = if renormalize { chosen.iter().map(|&e| scores[e]).sum::<f32>() } else { 1.0 };
            chosen.into_iter().map(|e| (e, scores[e] / norm * routed_scaling)).collect()
        }
    }
}

/// Routed experts for `x` `[t, hidden]` given router logits `[t, experts.routed]`: of each token's
/// choices, those among `experts` (all, or a rank's part).
pub fn moe(
    x: &[f32],
    t: usize,
    router_logits: &[f32],
    router: &Router<CpuBackend>,
    bias: Option<&[f32]>,
    experts: &MoeExperts<CpuBackend>,
    table: &CpuExpertTable,
) -> Vec<f32> {
    let (h, inter, n_exp) = (experts.hidden, experts.intermediate, experts.routed);
    let routes: Vec<Vec<(usize, f32)>> =
        (0..t).map(|i| route(&router_logits[i * n_exp..(i + 1) * n_exp], &router.kind, bias)).collect();
    // Tokens of each of these experts, in token order.
    let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.experts.len()];
    for (i, r) in routes.iter().enumerate() {
        for &(e, w) in r {
            if let Some(mine) = e.checked_sub(experts.first).and_then(|e| assigned.get_mut(e)) {
                mine.push((i, w));
            }
        }
    }
    let outputs: Vec<Vec<f32>> = assigned
        .par_iter()
        .enumerate()
        .map(|(e, toks)| {
            if toks.is_empty() {
                return Vec::new();
            }
            let m = toks.len();
            let xs: Vec<f32> = toks.iter().flat_map(|&(i, _)| x[i * h..(i + 1) * h].iter().copied()).collect();
            // SAFETY: the fused buffer is owned by `table`, alive for this call, `2 * inter` rows.
            let gu = unsafe { matmul(&xs, m, h, table.gate_up[e].rows, 2 * inter) };
            let act: Vec<f32> = gu.chunks_exact(2).map(|p| silu(p[0]) * p[1]).collect();
            // SAFETY: `down[e]` points into expert e's down projection, which the `MoeExperts`
            // that owns this table keeps alive; it has `h` rows of `inter` inputs.
            unsafe { matmul(&act, m, inter, table.down[e], h) }
        })
        .collect();
    // Combine in ascending expert order, as transformers' index_add loop does.
    let mut out = vec![0.0f32; t * h];
    for (e, toks) in assigned.iter().enumerate() {
        for (j, &(i, w)) in toks.iter().enumerate() {
            for (o, &y) in out[i * h..(i + 1) * h].iter_mut().zip(&outputs[e][j * h..(j + 1) * h]) {
                *o += w * y;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_ranks_ties_by_index_and_nan_after_every_number() {
        let sigmoid = RouterKind::Sigmoid { top_k: 4, softcap: None, renormalize: false, routed_scaling: 1.0 };
        // Expert 1's NaN logit ranks after expert 3's -inf; 0 and 2 tie, the lower index first.
        let chosen: Vec<usize> =
            route(&[1.0, f32::NAN, 1.0, f32::NEG_INFINITY, 3.0], &sigmoid, None).into_iter().map(|(e, _)| e).collect();
        assert_eq!(chosen, [4, 0, 2, 3]);
        // A NaN from the bias too, with a negative sign bit (total order would put it last anyway).
        let bias = [0.0, 0.0, -f32::NAN, 0.0, 0.0];
        let chosen: Vec<usize> =
            route(&[0.0, 0.0, 5.0, 0.0, 0.0], &sigmoid, Some(&bias)).into_iter().map(|(e, _)| e).collect();
        assert_eq!(chosen, [0, 1, 3, 4]);
    }
}
