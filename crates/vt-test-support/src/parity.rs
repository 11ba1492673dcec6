//! The end-to-end parity bodies, generic over the backend: every committed fixture against its
//! transformers f32 reference under the f32 rule (`LOGIT_TOL` on logits, greedy ids with the
//! near-tie exception). Each f32 backend's tests/parity.rs runs them (vt-models' on the CPU,
//! vt-wgpu's on its adapter).

use vt_core::backend::Backend;
use vt_models::{Logits, Model};

use crate::{all_fixtures, check_greedy, max_abs_diff, Reference, LOGIT_TOL};

fn name(dir: &std::path::Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

pub fn full_forward_matches_reference<B: Backend>(b: &B) {
    let fixtures = all_fixtures();
    assert!(fixtures.len() >= 2, "fixtures missing");
    for dir in fixtures {
        let r = Reference::load(&dir);
        let m = Model::load(b, &dir).unwrap();
        let seq = r.sequence();
        let mut st = m.new_state(4096).unwrap();
        let ours = b.to_f32(&m.forward(&seq, &mut st, Logits::All).unwrap()).unwrap();
        let d = max_abs_diff(&ours, &r.logits);
        println!("{}: full forward over {} tokens, max |dlogit| = {d:.3e}", name(&dir), seq.len());
        assert!(d <= LOGIT_TOL, "{}: max |dlogit| {d} > {LOGIT_TOL}", name(&dir));
    }
}

pub fn prefill_then_decode_matches_reference<B: Backend>(b: &B) {
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let m = Model::load(b, &dir).unwrap();
        let t = r.prompt_ids.len();
        let mut st = m.new_state(4096).unwrap();
        let mut worst =
            max_abs_diff(&b.to_f32(&m.forward(&r.prompt_ids, &mut st, Logits::Last).unwrap()).unwrap(), r.row(t - 1));
        // Teacher-forced decode over the reference continuation, one token at a time.
        for (i, &id) in r.greedy_ids[..r.greedy_ids.len() - 1].iter().enumerate() {
            let row = b.to_f32(&m.forward(&[id], &mut st, Logits::Last).unwrap()).unwrap();
            worst = worst.max(max_abs_diff(&row, r.row(t + i)));
        }
        println!("{}: prefill {t} + {} decode steps, max |dlogit| = {worst:.3e}", name(&dir), r.greedy_ids.len() - 1);
        assert!(worst <= LOGIT_TOL, "{}: max |dlogit| {worst} > {LOGIT_TOL}", name(&dir));
    }
}

pub fn greedy_generation_matches_reference<B: Backend>(b: &B) {
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let m = Model::load(b, &dir).unwrap();
        let mut st = m.new_state(4096).unwrap();
        let mut ids = Vec::new();
        let mut input = r.prompt_ids.clone();
        for _ in 0..r.greedy_ids.len() {
            let row = b.to_f32(&m.forward(&input, &mut st, Logits::Last).unwrap()).unwrap();
            let id = crate::argmax(&row);
            ids.push(id);
            input = vec![id];
        }
        let compared = check_greedy(&r, &ids).unwrap_or_else(|e| panic!("{}: {e}", name(&dir)));
        println!("{}: {compared}/{} greedy ids equal", name(&dir), ids.len());
    }
}

/// Prefill split at a chunk boundary and mid-chunk must equal one prefill (state carried across
/// calls through the chunked GDN form, conv state, KV cache and ring buffers).
pub fn split_prefill_matches_single_prefill<B: Backend>(b: &B) {
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let m = Model::load(b, &dir).unwrap();
        let seq = r.sequence();
        for split in [3, 64, seq.len() - 5] {
            let mut st = m.new_state(4096).unwrap();
            m.forward(&seq[..split], &mut st, Logits::Last).unwrap();
            let rest = b.to_f32(&m.forward(&seq[split..], &mut st, Logits::All).unwrap()).unwrap();
            let d = max_abs_diff(&rest, &r.logits[split * r.vocab..]);
            assert!(d <= LOGIT_TOL, "{} split at {split}: max |dlogit| {d}", name(&dir));
        }
    }
}

/// A step that mixes prompt chunks and single tokens, in any order (the model runs the single
/// tokens first, as one batch): each sequence's logits row against the reference at its position.
pub fn mixed_batch_of_prompt_chunks_and_single_tokens_matches_reference<B: Backend>(b: &B) {
    for dir in all_fixtures() {
        let r = Reference::load(&dir);
        let m = Model::load(b, &dir).unwrap();
        let seq = r.sequence();
        // (tokens already run, tokens this step): chunks and single tokens interleaved.
        let plan = [(4, 5), (7, 1), (2, 1), (0, 3), (9, 1), (5, 4)];
        let pool = m.new_pool(&m.pool_config(plan.len(), 16, 16)).unwrap();
        let mut states: Vec<_> = plan
            .iter()
            .map(|&(done, _)| {
                let mut st = pool.new_state().unwrap();
                if done > 0 {
                    m.forward(&seq[..done], &mut st, Logits::Last).unwrap();
                }
                st
            })
            .collect();
        let mut batch: Vec<(&[u32], &mut _)> =
            plan.iter().zip(states.iter_mut()).map(|(&(done, n), st)| (&seq[done..done + n], st)).collect();
        let ours = b.to_f32(&m.forward_batch(&mut batch).unwrap()).unwrap();
        for (i, (row, &(done, n))) in ours.chunks(r.vocab).zip(&plan).enumerate() {
            let d = max_abs_diff(row, r.row(done + n - 1));
            assert!(d <= LOGIT_TOL, "{} sequence {i} at {}: max |dlogit| {d}", name(&dir), done + n - 1);
        }
        for (st, &(done, n)) in states.iter().zip(&plan) {
            assert_eq!(st.len(), done + n);
        }
    }
}
