//! The MTP layer as a draft model on the CPU: drafts against tools/oracle/mtp.py's f32 reference
//! (vt-test-support's `mtp` bodies), alone and split over ranks, and models without one.

use std::path::Path;

use vt_core::backend::Device;
use vt_cpu::CpuBackend;
use vt_models::{DraftInput, Logits, Model};
use vt_test_support::parallel::cpu_ranks;
use vt_test_support::{all_fixtures, fixture, mtp};

fn alone(dir: &Path) -> Model<CpuBackend> {
    Model::load(&CpuBackend::new(), dir).unwrap()
}

#[test]
fn draft_matches_reference() {
    mtp::draft_matches_reference(alone);
}

#[test]
fn draft_after_pieces_and_a_rejected_chain() {
    mtp::draft_after_pieces_and_a_rejected_chain(alone);
}

#[test]
fn batched_drafts_match_reference() {
    mtp::batched_drafts_match_reference(alone);
}

/// The same bodies on models split over 2 ranks, tensor- and expert-parallel: the MTP layer is
/// split as the model's layers are (heads, experts, its KV in every rank's pool), rank 0's hidden
/// states reach every rank, and the drafts' logits are gathered over the ranks' vocabulary rows.
/// Its sums differ from the model's alone by f32 rounding, well within the reference's tolerance.
#[test]
fn split_models_draft_as_the_reference() {
    for ep in [false, true] {
        let split = |dir: &Path| cpu_ranks(dir, 2, ep);
        mtp::draft_matches_reference(split);
        mtp::draft_after_pieces_and_a_rejected_chain(split);
        mtp::batched_drafts_match_reference(split);
    }
}

/// Laguna, Qwen3-MoE and two quantized Qwen3.5 fixtures (qwen35moe_nvfp4, qwen35moe_fp8) carry no
/// MTP layer: the model says so and `draft` is an error naming it.
#[test]
fn models_without_an_mtp_layer_say_so() {
    let b = CpuBackend::new();
    let without: Vec<_> = all_fixtures().into_iter().filter(|d| !d.join(mtp::FILE).exists()).collect();
    assert!(without.iter().any(|d| d.ends_with("laguna_a")) && without.iter().any(|d| d.ends_with("qwen3moe")));
    for dir in without {
        let m = Model::load(&b, &dir).unwrap();
        assert!(!m.has_mtp(), "{}", dir.display());
        let mut st = m.new_state(16).unwrap();
        m.forward(&[1, 2], &mut st, Logits::Last).unwrap();
        let h = b.upload(vt_core::DType::F32, &[1, m.spec().hidden], &vec![0; 4 * m.spec().hidden]).unwrap();
        let e = m.draft(&mut [DraftInput { state: &mut st, hidden: Some(&h), next: &[3] }], 1).err().expect("no MTP");
        assert!(e.to_string().contains("no MTP layer"), "{e}");
    }
}

/// Bad draft inputs are errors naming what was wrong, and leave the state as it was.
#[test]
fn bad_draft_inputs_are_errors() {
    let b = CpuBackend::new();
    let m = Model::load(&b, &fixture("qwen35moe_text")).unwrap();
    let h = m.spec().hidden;
    let mut st = m.new_state(64).unwrap();
    m.forward(&[1, 2, 3], &mut st, Logits::Last).unwrap();
    let rows = |n: usize| b.upload(vt_core::DType::F32, &[n, h], &vec![0; 4 * n * h]).unwrap();
    let cases: [(&[u32], usize, &str); 4] = [
        (&[5, 6, 7, 8], 4, "go past them"),
        (&[5, 6], 3, "need hidden states [2,"),
        (&[], 0, "at least one row"),
        (&[5, 100_000], 2, "outside the vocabulary"),
    ];
    for (next, n, want) in cases {
        let hid = rows(n.max(1));
        let e = m.draft(&mut [DraftInput { state: &mut st, hidden: Some(&hid), next }], 2).err().expect(want);
        assert!(e.to_string().contains(want), "{e}");
        assert_eq!(st.mtp_len(), 0);
    }
}

/// Without its MTP layer a model's pools hold less per block, and its logits are the same.
#[test]
fn drop_mtp_frees_its_kv_and_keeps_the_logits() {
    let b = CpuBackend::new();
    let dir = fixture("qwen35moe_nested");
    let with = Model::load(&b, &dir).unwrap();
    let mut without = Model::load(&b, &dir).unwrap();
    without.drop_mtp();
    assert!(with.has_mtp() && !without.has_mtp());
    let (cw, co) = (with.pool_config(1, 256, 256), without.pool_config(1, 256, 256));
    assert!(co.bytes < cw.bytes, "{} !< {}", co.bytes, cw.bytes);
    let ids = [3, 1, 4, 1, 5, 9, 2, 6];
    let run = |m: &Model<CpuBackend>| {
        let mut st = m.new_state(64).unwrap();
        b.to_f32(&m.forward(&ids, &mut st, Logits::All).unwrap()).unwrap()
    };
    assert_eq!(run(&with), run(&without));
}
