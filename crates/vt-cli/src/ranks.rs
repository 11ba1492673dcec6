//! The backends a model runs on (`--tensor-parallel N`): one, or one per rank with a communicator
//! group over them (host threads on the CPU, NCCL over devices 0..N on CUDA).

use std::sync::Arc;

use vt::checkpoint::Checkpoint;
use vt::{Backend, Comms, Communicator, DummyWeights, Error, Model, Result};

pub struct Ranks<B: Backend> {
    backends: Vec<B>,
    /// A new communicator group over the backends (each split model takes one).
    comms: fn(&[B]) -> Result<Comms<B>>,
    expert_parallel: bool,
}

impl<B: Backend> Ranks<B> {
    /// `backends` as ranks, exchanging through `comms`; an error when asked for expert
    /// parallelism without several ranks.
    fn new(backends: Vec<B>, comms: fn(&[B]) -> Result<Comms<B>>, expert_parallel: bool) -> Result<Self> {
        if expert_parallel && backends.len() < 2 {
            return Err(Error::input(
                "--expert-parallel partitions experts across ranks: give --tensor-parallel 2 or more",
            ));
        }
        Ok(Ranks { backends, comms, expert_parallel })
    }

    /// Rank 0's backend: the one the caller times, reads logits from and sizes pools on.
    pub fn first(&self) -> &B {
        &self.backends[0]
    }

    /// `ckpt`'s model (random weights with `dummy`), split over the ranks where there are several.
    pub fn model(
        &self,
        ckpt: &Checkpoint,
        dummy: Option<DummyWeights>,
        progress: &dyn Fn(u64, u64),
    ) -> Result<Model<B>> {
        match (self.backends.as_slice(), dummy) {
            ([b], None) => Model::from_checkpoint(b, ckpt, progress),
            ([b], Some(w)) => Model::dummy(b, ckpt, w),
            (bs, None) => Model::load_ranks(bs, ckpt, (self.comms)(bs)?, self.expert_parallel),
            (bs, Some(w)) => Model::dummy_ranks(bs, ckpt, (self.comms)(bs)?, self.expert_parallel, w),
        }
    }
}

/// `n` CPU backends as ranks, threads of this process over the host communicator.
#[cfg(feature = "cpu")]
pub fn cpu(n: usize, expert_parallel: bool) -> Result<Ranks<vt::CpuBackend>> {
    fn comms(bs: &[vt::CpuBackend]) -> Result<Comms<vt::CpuBackend>> {
        let group = vt::HostComm::group(bs.len())?;
        Ok(group.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator<vt::CpuBackend>>).collect())
    }
    Ranks::new((0..n).map(|_| vt::CpuBackend::new()).collect(), comms, expert_parallel)
}

/// CUDA devices 0..n as ranks over NCCL; an error naming the count when fewer devices exist.
#[cfg(feature = "cuda")]
pub fn cuda(n: usize, expert_parallel: bool) -> Result<Ranks<vt::CudaBackend>> {
    fn comms(bs: &[vt::CudaBackend]) -> Result<Comms<vt::CudaBackend>> {
        let group = vt::NcclComm::group(bs)?;
        Ok(group.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator<vt::CudaBackend>>).collect())
    }
    let found = vt::CudaBackend::device_count()?;
    if n > found {
        return Err(Error::input(format!("--tensor-parallel {n} needs {n} CUDA devices; this machine has {found}")));
    }
    let backends = (0..n).map(|i| vt::CudaBackend::on_device(i, vt::CudaAllocMode::System)).collect::<Result<_>>()?;
    Ranks::new(backends, comms, expert_parallel)
}

/// One backend that cannot be split (wgpu): an error for `n` > 1.
pub fn single<B: Backend>(b: B, n: usize, what: &str) -> Result<Ranks<B>> {
    if n > 1 {
        return Err(Error::input(format!("--tensor-parallel runs on the cpu and cuda backends, not {what}")));
    }
    fn none<B: Backend>(_: &[B]) -> Result<Comms<B>> {
        Ok(Vec::new())
    }
    Ranks::new(vec![b], none, false)
}
