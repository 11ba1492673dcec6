//! Recorded decode steps (optional): a backend that can capture one step's ops and run them again
//! (a CUDA graph). The model uses them where `recorder` gives one; the defaults record nothing.

use super::{KvOps, KvSeq};
use crate::{Result, Tensor};

/// What a replay of a recorded step of `rows` single-token steps is given (a row per decoding
/// sequence, or per position of a verifying one), each list in row order: what changes from step
/// to step, which the recorded ops read from device memory that `replay` fills before the launch.
pub struct ReplayInputs<'a, B: KvOps> {
    /// Each row's token id.
    pub ids: &'a [u32],
    /// Each row's position.
    pub positions: &'a [usize],
    /// Each attention call of the step, in the order the step makes them: its rows' sequences in
    /// its pool layer (each at `start == positions[row]`). A call serves consecutive rows: all of
    /// the step's single-token rows (a verification's waves one after another), or, where an op
    /// runs a call per row, those rows in turn.
    pub attention: Vec<Vec<KvSeq<'a>>>,
    /// Each delta-net call of the step, in order: its sequences' states.
    pub delta_net: Vec<Vec<ReplayStates<'a, B>>>,
}

/// A sequence's Gated DeltaNet states in a replayed delta-net call.
pub struct ReplayStates<'a, B: KvOps> {
    pub conv: &'a Tensor<B>,
    pub recurrent: &'a Tensor<B>,
    /// Where the call also writes them after the sequence's first position (`(conv,
    /// recurrent)`: `FusedOps::gated_delta_waves`' `firsts`), if it does.
    pub first: Option<(&'a Tensor<B>, &'a Tensor<B>)>,
}

pub trait StepRecording: KvOps {
    /// A recorded decode step that can run again; `()` where steps are not recorded.
    type StepGraph: Send + 'static;

    /// Whether `recorder` gives recorders (what a caller checks before it sets anything up for one).
    fn records(&self) -> bool {
        false
    }
    /// A backend that records the ops queued on it, instead of running them, for one step of
    /// `positions.len()` rows at those positions, a token each: ops read the ids, the positions,
    /// block tables and delta-net states from device memory that `replay` fills, so the recording
    /// runs later steps of that shape. An op over some of the rows names them by their positions,
    /// which must match one run of consecutive rows. Memory it allocates belongs to the
    /// recording. `None` where this backend does not record.
    fn recorder(&self, positions: &[usize]) -> Result<Option<Self>> {
        let _ = positions;
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
    /// Queues a recorded step over `pool` for `inputs`. `Ok(false)`, with nothing queued, where
    /// the recording no longer fits them (a table has outgrown it, a pool layer or a state it
    /// holds fixed differs): run the step without it.
    fn replay(
        &self,
        graph: &mut Self::StepGraph,
        pool: &mut Self::KvPool,
        inputs: &ReplayInputs<'_, Self>,
    ) -> Result<bool> {
        let _ = (graph, pool, inputs);
        Err(crate::Error::backend(self.name(), "this backend does not record steps"))
    }
}
