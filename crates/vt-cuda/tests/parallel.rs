//! Tensor parallelism over NCCL on two or more devices (tools/gpu/run_suite.sh runs it where the
//! machine has them): every fixture split over 2 ranks against the model alone on device 0, every
//! rank's device memory back to its baseline after each of two build/run/drop cycles in placement
//! arenas. Expert parallelism is refused on CUDA (its MoE kernels index every expert of a layer).
#![cfg(feature = "cuda")]

use std::sync::Arc;

use vt_core::checkpoint::Checkpoint;
use vt_core::{Communicator, Device};
use vt_cuda::{AllocMode, CudaBackend, NcclComm};
use vt_models::{Comms, Logits, Model};
use vt_test_support::fixture;
use vt_test_support::parallel::{split_matches_alone, Tol};

fn devices(n: usize) -> Vec<CudaBackend> {
    let found = CudaBackend::device_count().unwrap();
    assert!(found >= n, "tensor-parallel tests need {n} CUDA devices, found {found}");
    (0..n).map(|i| CudaBackend::on_device(i, AllocMode::PlacementArena).unwrap()).collect()
}

fn nccl(backends: &[CudaBackend]) -> Comms<CudaBackend> {
    let group = NcclComm::group(backends).unwrap();
    group.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator<CudaBackend>>).collect()
}

/// bf16 with bf16 all-reduces: the bound of tests/parity.rs (8 u of the largest logit) on the
/// median position; refused as on the CPU (the splits do not depend on the backend).
#[test]
fn two_devices_compute_what_one_does() {
    let refused = [("qwen35moe_fp8", 2)];
    let seen = split_matches_alone(&devices(1)[0], &[2], false, Tol::MedianRow(8.0 / 256.0), &refused, devices, nccl);
    assert_eq!(seen.len(), 12, "{seen:?}");
}

#[test]
fn expert_parallel_is_refused_with_an_error_naming_it() {
    let bs = devices(2);
    let ckpt = Checkpoint::open(&fixture("qwen35moe_text")).unwrap();
    let m = Model::load_ranks(&bs, &ckpt, nccl(&bs), true).unwrap();
    let mut st = m.new_state(8).unwrap();
    let e = m.forward(&[1, 2, 3], &mut st, Logits::Last).map(drop).unwrap_err().to_string();
    assert!(e.contains("expert parallelism"), "{e}");
    drop((st, m));
    assert!(bs.iter().all(|b| b.memory().bytes_live == 0), "memory left after the refused step");
}
