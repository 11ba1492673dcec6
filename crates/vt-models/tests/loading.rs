//! Loading reports its progress in bytes and reads every text tensor of a checkpoint exactly once;
//! random weights are NVFP4 where their scope says.

use std::cell::RefCell;

use vt_core::checkpoint::Checkpoint;
use vt_core::Weight;
use vt_cpu::CpuBackend;
use vt_models::{DummyNvfp4, DummyWeights, Model};
use vt_test_support::{all_fixtures, fixture};

#[test]
fn progress_counts_every_text_tensor_once() {
    for dir in all_fixtures() {
        let seen = RefCell::new(Vec::new());
        Model::load_with_progress(&CpuBackend::new(), &dir, &|done, total| seen.borrow_mut().push((done, total)))
            .unwrap();
        let seen = seen.into_inner();
        let &(last, total) = seen.last().unwrap();
        assert!(
            seen.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 == w[1].1),
            "{}: progress not increasing",
            dir.display()
        );
        // Every tensor outside mtp.*, model.visual.* and W4A4 activation scales is read exactly once: nothing is read
        // twice and nothing (an unexpected tensor) is silently ignored.
        assert_eq!(last, total, "{}: read {last} of {total} text-tensor bytes", dir.display());
    }
}

/// `vt bench`'s random weights: the routed experts are NVFP4 in both NVFP4 scopes, the MTP
/// layer's only where every projection is, and a decode token reads the fewest bytes there.
#[test]
fn dummy_nvfp4_scopes_quantize_what_they_name() {
    let b = CpuBackend::new();
    let ckpt = Checkpoint::open(&fixture("qwen35moe_dims")).unwrap();
    let model = |nvfp4| Model::dummy(&b, &ckpt, DummyWeights { seed: 1, nvfp4 }).unwrap();
    // The two layers' experts, then the MTP layer's.
    let nvfp4_experts = |m: &Model<CpuBackend>| {
        m.moe_experts().map(|e| matches!(e.experts[0].gate, Weight::Nvfp4(_))).collect::<Vec<_>>()
    };
    let (off, routed, all) = (model(DummyNvfp4::Off), model(DummyNvfp4::RoutedExperts), model(DummyNvfp4::Projections));
    assert_eq!(nvfp4_experts(&off), [false, false, false]);
    assert_eq!(nvfp4_experts(&routed), [true, true, false]);
    assert_eq!(nvfp4_experts(&all), [true, true, true]);
    let bytes = [&off, &routed, &all].map(|m| m.decode_weight_bytes());
    assert!(bytes[0] > bytes[1] && bytes[1] > bytes[2], "decode bytes off / routed experts / projections: {bytes:?}");
}
