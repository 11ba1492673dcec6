//! Recorded decode steps: where the backend records (CUDA graphs), a sequence's single-token step
//! is recorded once and replayed while the backend says it fits (CUDA: for 256 positions past the
//! recorded one), so a decode step costs one launch instead of one per op. Replays compute exactly
//! what the unrecorded step computes: the same kernels over the same memory, with the token id, the
//! position and the block tables read from device memory.

use vt_core::{Backend, KvSeq, Result, Tensor};

use super::pool::{LayerSlot, PoolInner};
use super::state::{Recorded, SeqState};
use super::{Logits, Model};

/// A sequence's recorded step, the model it runs (its weights are in the recording), and where its
/// replays leave the logits (the recording's memory).
pub(super) struct RecordedStep<B: Backend> {
    model: u64,
    graph: B::StepGraph,
    logits: Tensor<B>,
}

impl<B: Backend> Model<B> {
    /// Whether single-token steps of one sequence run as recorded steps where the backend records
    /// (off by default: CUDA replays over the paged KV pool fault, docs/performance.md). Either
    /// way they are meant to compute the same logits.
    pub fn set_recorded_decode(&mut self, on: bool) {
        self.record_decode = on;
    }

    /// The step of `id` as the sequence's recorded step: replayed, recorded first if it has none.
    /// `None`: nothing ran and `state` is as it was; run the step unrecorded. `p` is the
    /// sequence's pool, whose blocks cover the step's position.
    pub(super) fn recorded_step(
        &self,
        id: u32,
        state: &mut SeqState<B>,
        p: &mut PoolInner<B>,
    ) -> Result<Option<Tensor<B>>> {
        // Another model's recording runs that model's weights: this one records its own.
        if matches!(&state.recorded, Recorded::Step(s) if s.model != self.id) {
            state.recorded = Recorded::None;
        }
        if matches!(state.recorded, Recorded::None) {
            match self.record(id, state, p) {
                Ok(Some(step)) => {
                    state.recorded = Recorded::Step(step);
                    state.recordings += 1;
                }
                Ok(None) => return Ok(None),
                Err(e) => {
                    state.recorded = Recorded::Failed(e);
                    return Ok(None);
                }
            }
        }
        let b = &self.backend;
        let seqs = self.kv_seqs(&state.tables, state.pos);
        let Recorded::Step(step) = &mut state.recorded else { return Ok(None) };
        if !b.replay(&mut step.graph, &[id], state.pos, &mut p.kv, &seqs)? {
            // The tables moved on from the recording: this step runs unrecorded, the next records
            // again.
            state.recorded = Recorded::None;
            return Ok(None);
        }
        state.pos += 1;
        // A copy: the next replay overwrites the recording's logits.
        b.slice_rows(&step.logits, 0, 1).map(Some)
    }

    /// A sequence's attention layers in its pool, in the order a step runs them, at `pos`.
    fn kv_seqs<'t>(&self, tables: &'t [Vec<u32>], pos: usize) -> Vec<KvSeq<'t>> {
        (self.state_layout.layers.iter())
            .filter_map(|l| match *l {
                LayerSlot::Kv { group, pool_layer } => {
                    Some(KvSeq { layer: pool_layer, table: tables[group].as_slice(), start: pos })
                }
                LayerSlot::Gdn(_) => None,
            })
            .collect()
    }

    /// Records the step of `id` at the sequence's position; `None` where the backend does not
    /// record. The recording has not run: `state` is left as it was (its tables already cover the
    /// step: each replay takes the tables of its own step).
    fn record(&self, id: u32, state: &mut SeqState<B>, p: &mut PoolInner<B>) -> Result<Option<RecordedStep<B>>> {
        let b = &self.backend;
        // The weights' derived state is built outside the recording (a recorder cannot build it).
        self.prepare()?;
        let Some(recorder) = b.recorder(1, state.pos)? else { return Ok(None) };
        let pos = state.pos;
        let logits = self.run_on(&recorder, &mut [(&[id], &mut *state)], Logits::Last, p);
        state.pos = pos;
        let logits = logits?;
        let graph = b.finish_recording(recorder)?;
        Ok(Some(RecordedStep { model: self.id, graph, logits }))
    }
}
