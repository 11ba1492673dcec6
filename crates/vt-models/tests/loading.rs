//! Loading reports its progress in bytes and reads every text tensor of a checkpoint exactly once.

use std::cell::RefCell;

use vt_cpu::CpuBackend;
use vt_models::Model;
use vt_test_support::all_fixtures;

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
