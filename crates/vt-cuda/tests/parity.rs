//! End-to-end CUDA (bf16 activations) against the Hugging Face f32 reference on every committed
//! fixture (bf16, NVFP4 and FP8 alike): logits of one full forward, prefill-then-decode logits, and
//! greedy continuations; CUDA against the CPU reference is printed beside them.
//!
//! The bound. bf16 keeps 8 significant bits: every activation the GPU stores carries a relative
//! rounding error of up to u/2, u = 2^-8. A forward pass stores ~8 activations per layer that feed
//! the residual stream (norm, projections, mixer output, gates, FFN/MoE output, the residual sum);
//! over the fixtures' 4 layers those errors add up in quadrature to a few u of the hidden state's
//! scale, and the logits (themselves rounded to bf16) inherit that relative error. So
//! `|Δlogit| <= 8 u · max|logit|` (3.1% of the largest reference logit, ~0.27 for these fixtures)
//! bounds it with margin; it is still well below the fixtures' typical top-2 gaps. Greedy ids
//! must match token for token except where the reference's own top-2 gap is below that bound (a
//! near tie), after which the continuation cannot be compared.
//!
//! Ill-conditioned fixtures. Top-k routing is discontinuous (a token whose k-th and (k+1)-th
//! router scores lie within bf16 rounding picks another expert, moving that position's logits by
//! O(1)), and the tiny random fixtures amplify rounding differently: measured on the H200
//! (tools/gpu/hf_bf16_spread.py), transformers itself run in bf16 departs from its own f32 logits
//! by up to 2.2 on laguna_a (bound exceeded at 2 of 111 positions) and 6.6 on qwen35moe_nested
//! (69 of 115). So the per-position bound is asserted on the median position, the max |Δlogit|
//! and the positions over the bound are printed, and the greedy ids (near-tie rule) are exact.
#![cfg(feature = "cuda")]

use std::path::Path;

use vt_core::backend::prelude::*;
use vt_cpu::CpuBackend;
use vt_cuda::CudaBackend;
use vt_models::{Logits, Model};
use vt_test_support::{all_fixtures, argmax, max_abs_diff, top2_gap, Reference};

const U: f32 = 1.0 / 256.0;

fn bound(r: &Reference) -> f32 {
    8.0 * U * r.logits.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Rows (of `vocab` logits) whose max |Δ| exceeds `tol`, as (row, max |Δ|).
fn rows_over(ours: &[f32], reference: &[f32], vocab: usize, tol: f32) -> Vec<(usize, f32)> {
    let rows = ours.chunks(vocab).zip(reference.chunks(vocab)).map(|(a, b)| max_abs_diff(a, b));
    rows.enumerate().filter(|&(_, d)| d > tol).collect()
}

/// The bound holds at the median row (see the module docs).
fn within(over: &[(usize, f32)], rows: usize) -> bool {
    over.len() <= rows / 2
}

/// `over` (rows over the bound, as `rows_over` gives them) as the positions of those rows
/// (`positions[row]`), each once with its worst |Δ|: a position several rows compute (by
/// different paths) is one position of the median rule, over if any of its rows is.
fn positions_over(over: &[(usize, f32)], positions: &[usize]) -> Vec<(usize, f32)> {
    let mut worst = std::collections::BTreeMap::new();
    for &(row, d) in over {
        let w = worst.entry(positions[row]).or_insert(d);
        *w = w.max(d);
    }
    worst.into_iter().collect()
}

fn name(dir: &Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

fn full_logits<B: Backend>(b: &B, dir: &Path, seq: &[u32]) -> Vec<f32> {
    let m = Model::load(b, dir).unwrap();
    let mut st = m.new_state(4096).unwrap();
    b.to_f32(&m.forward(seq, &mut st, Logits::All).unwrap()).unwrap()
}

#[test]
fn full_forward_matches_reference() {
    let (cuda, cpu) = (CudaBackend::new().unwrap(), CpuBackend::new());
    let fixtures = all_fixtures();
    assert!(fixtures.len() >= 2, "fixtures missing");
    let mut failed = Vec::new();
    for dir in fixtures {
        let r = Reference::load(&dir);
        let seq = r.sequence();
        let ours = full_logits(&cuda, &dir, &seq);
        let (d, tol) = (max_abs_diff(&ours, &r.logits), bound(&r));
        let d_cpu = max_abs_diff(&ours, &full_logits(&cpu, &dir, &seq));
        let over = rows_over(&ours, &r.logits, r.vocab, tol);
        println!(
            "fixture {}: full forward over {} tokens, max |dlogit| cuda-hf = {d:.3e}, cuda-cpu = {d_cpu:.3e}; bound {tol:.3e} exceeded at {} positions {over:?}",
            name(&dir),
            seq.len(),
            over.len()
        );
        if !within(&over, seq.len()) {
            failed.push(format!("{}: {} positions over {tol}: {over:?}", name(&dir), over.len()));
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
}

#[test]
fn prefill_then_decode_matches_reference() {
    let b = CudaBackend::new().unwrap();
    let mut failed = Vec::new();
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let m = Model::load(&b, &dir).unwrap();
        let t = r.prompt_ids.len();
        let mut st = m.new_state(4096).unwrap();
        let mut ours = b.to_f32(&m.forward(&r.prompt_ids, &mut st, Logits::Last).unwrap()).unwrap();
        let mut want = r.row(t - 1).to_vec();
        // Teacher-forced decode over the reference continuation, one token at a time.
        for (i, &id) in r.greedy_ids[..r.greedy_ids.len() - 1].iter().enumerate() {
            ours.extend(b.to_f32(&m.forward(&[id], &mut st, Logits::Last).unwrap()).unwrap());
            want.extend_from_slice(r.row(t + i));
        }
        let (worst, tol) = (max_abs_diff(&ours, &want), bound(&r));
        let over = rows_over(&ours, &want, r.vocab, tol);
        println!(
            "fixture {}: prefill {t} + {} decode steps, max |dlogit| cuda-hf = {worst:.3e}; bound {tol:.3e} exceeded at {} rows {over:?}",
            name(&dir),
            r.greedy_ids.len() - 1,
            over.len()
        );
        if !within(&over, r.greedy_ids.len()) {
            failed.push(format!("{}: {} rows over {tol}: {over:?}", name(&dir), over.len()));
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
}

/// Several sequences, prefilled alone to different lengths, then decoded together in batched
/// steps (one token each: the batched GDN and attention decode kernels), one step also running a
/// new sequence's 6-token prompt, listed first (a mixed step: the model runs the single tokens
/// first, as one batch): each row of each step against the reference's logits at that sequence's
/// position. Sequences overlap in position (the prompt's last row and two decode rows are all
/// position 5), so the median rule counts positions: a position computed twice is not twice the
/// evidence, whichever side of the bound it falls (qwen35moe_nested, over the bound at about half
/// its positions in bf16, would otherwise pass or fail on which positions happen to repeat).
#[test]
fn batched_decode_of_sequences_at_different_positions_matches_reference() {
    let b = CudaBackend::new().unwrap();
    let mut failed = Vec::new();
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let m = Model::load(&b, &dir).unwrap();
        let seq = r.sequence();
        let steps = 4;
        let starts: Vec<usize> =
            [1, 2, 5, r.prompt_ids.len()].into_iter().filter(|&p| p + steps <= seq.len()).collect();
        // The sequences of one step share a pool (one more for the new prompt of the mixed step).
        let pool = m.new_pool(&m.pool_config(starts.len() + 1, seq.len(), seq.len())).unwrap();
        let mut states: Vec<_> = starts
            .iter()
            .map(|&p| {
                let mut st = pool.new_state().unwrap();
                m.forward(&seq[..p], &mut st, Logits::Last).unwrap();
                st
            })
            .collect();
        let (mut ours, mut want, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        let mut late = pool.new_state().unwrap();
        for s in 0..steps {
            let mut batch: Vec<(&[u32], &mut _)> =
                starts.iter().zip(states.iter_mut()).map(|(&p, st)| (&seq[p + s..p + s + 1], st)).collect();
            if s == 1 {
                batch.insert(0, (&seq[..6], &mut late));
                want.extend_from_slice(r.row(5));
                positions.push(5);
            }
            ours.extend(b.to_f32(&m.forward_batch(&mut batch).unwrap()).unwrap());
            for &p in &starts {
                want.extend_from_slice(r.row(p + s));
                positions.push(p + s);
            }
        }
        let (worst, tol) = (max_abs_diff(&ours, &want), bound(&r));
        let over = rows_over(&ours, &want, r.vocab, tol);
        let over_at = positions_over(&over, &positions);
        let covered = positions.iter().collect::<std::collections::BTreeSet<_>>().len();
        println!(
            "fixture {}: {} sequences from positions {starts:?}, {steps} batched decode steps, max |dlogit| cuda-hf = {worst:.3e}; bound {tol:.3e} exceeded at {} of {} rows {over:?}, {} of {covered} positions {over_at:?}",
            name(&dir),
            starts.len(),
            over.len(),
            positions.len(),
            over_at.len()
        );
        if starts.len() < 2 || !within(&over_at, covered) {
            failed.push(format!(
                "{}: {} sequences, {} of {covered} positions over {tol}: {over_at:?}",
                name(&dir),
                starts.len(),
                over_at.len()
            ));
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
}

/// Greedy ids against the reference's, tolerating a mismatch only at a near tie (reference top-2
/// gap below `tol`); returns the steps compared.
fn check_greedy(r: &Reference, ours: &[u32], tol: f32) -> Result<usize, String> {
    let t = r.prompt_ids.len();
    for (step, (&o, &want)) in ours.iter().zip(&r.greedy_ids).enumerate() {
        if o != want {
            let gap = top2_gap(r.row(t - 1 + step));
            return if gap < tol {
                Ok(step)
            } else {
                Err(format!("step {step}: generated {o}, reference {want} (reference top-2 gap {gap:.3e})"))
            };
        }
    }
    Ok(ours.len())
}

#[test]
fn greedy_generation_matches_reference() {
    let b = CudaBackend::new().unwrap();
    let mut failed = Vec::new();
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let m = Model::load(&b, &dir).unwrap();
        let mut st = m.new_state(4096).unwrap();
        let (mut ids, mut input) = (Vec::new(), r.prompt_ids.clone());
        for _ in 0..r.greedy_ids.len() {
            let id = argmax(&b.to_f32(&m.forward(&input, &mut st, Logits::Last).unwrap()).unwrap());
            ids.push(id);
            input = vec![id];
        }
        match check_greedy(&r, &ids, bound(&r)) {
            Ok(compared) => println!("fixture {}: {compared}/{} greedy ids equal", name(&dir), ids.len()),
            Err(e) => failed.push(format!("{}: {e}", name(&dir))),
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
}
