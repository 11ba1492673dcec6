//! Recorded decode steps (optional): a backend that can capture one step's ops and run them again
//! (a CUDA graph). The model uses them where `recorder` gives one; the defaults record nothing.

use super::{KvOps, KvSeq};
use crate::Result;

pub trait StepRecording: KvOps {
    /// A recorded decode step that can run again; `()` where steps are not recorded.
    type StepGraph: Send + 'static;

    /// A backend that records the ops queued on it, instead of running them, for one step of `ids`
    /// new tokens at position `pos`: ops read the ids and the position from device memory that
    /// `replay` fills, so the recording runs any later step of that shape. Memory it allocates
    /// belongs to the recording. `None` where this backend does not record.
    fn recorder(&self, ids: usize, pos: usize) -> Result<Option<Self>> {
        let _ = (ids, pos);
        Ok(None)
    }
    /// Whether this instance is a recorder (derived weight state must not be built on one).
    fn is_recording(&self) -> bool {
        false
    }
    /// Ends `recorder`'s recording and makes it runnable.
    fn finish_recording(&self, recorder: Self) -> Result<Self::StepGraph> {
        drop(recorder);
        Err(crate::Error::backend(self.name(), "this backend does not record steps"))
    }
    /// Queues a recorded step for `ids` at position `pos` over the sequence's attention layers
    /// `seqs` in `pool` (in the order the step uses them, each at `start == pos`). `Ok(false)`,
    /// with nothing queued, where the recording no longer fits them (a table now names other
    /// blocks, or has no room for `pos`): run the step without it.
    fn replay(
        &self,
        graph: &mut Self::StepGraph,
        ids: &[u32],
        pos: usize,
        pool: &mut Self::KvPool,
        seqs: &[KvSeq<'_>],
    ) -> Result<bool> {
        let _ = (graph, ids, pos, pool, seqs);
        Err(crate::Error::backend(self.name(), "this backend does not record steps"))
    }
}
