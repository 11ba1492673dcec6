//! Recorded decode steps: where the backend records (CUDA graphs), a decode step is recorded once
//! and replayed while the backend says it fits (CUDA: for 256 positions past the recorded ones),
//! so a step costs one launch instead of one per op. Replays compute exactly what the unrecorded
//! step of the same rows computes: the same kernels over the same memory, with the token ids, the
//! positions, the block tables and the delta-net states' addresses read from device memory.
//!
//! A sequence decoding alone replays its own recording (kept in its state). Steps of several
//! single-token sequences replay the pool's recording for the smallest bucket of `BATCH_ROWS` that
//! holds them; rows past the sequences are padding, each over a block of each group and a
//! delta-net slot the pool keeps for it (at most 7: the buckets are 8 apart from 8 on), and their
//! logits are dropped.

use vt_core::{Backend, Error, KvSeq, ReplayInputs, Result, Tensor};

use super::batch::Row;
use super::layout::Layout;
use super::pool::{GdnSlot, LayerSlot, Padding, PoolInner};
use super::state::{Recorded, SeqState};
use super::{Logits, Model};

/// Rows of the pool's batched recordings: a step of n sequences replays the first bucket >= n.
pub const BATCH_ROWS: [usize; 18] = [2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128];

/// A recorded step, the model it runs (its weights are in the recording), and where its replays
/// leave the logits (the recording's memory).
pub(super) struct RecordedStep<B: Backend> {
    model: u64,
    graph: B::StepGraph,
    logits: Tensor<B>,
}

/// One of a pool's batched recordings (`PoolInner::batch_steps`, with its rows).
pub(super) enum BatchStep<B: Backend> {
    Step(RecordedStep<B>),
    /// Recording it failed for this model: its steps run unrecorded.
    Failed {
        model: u64,
        error: Error,
    },
}

impl<B: Backend> Model<B> {
    /// Whether single-token steps run as recorded steps where the backend records (on by
    /// default). Either way they compute the same logits.
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
        let ids = [id];
        if matches!(state.recorded, Recorded::None) {
            match self.record(&[Row::of(&ids, state)], p) {
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
        let Recorded::Step(step) = &mut state.recorded else { return Ok(None) };
        let rows = [Row { ids: &ids, pos: state.pos, tables: &state.tables, slot: state.slot, verify: false }];
        if !self.replay(step, &rows, p)? {
            // The tables moved on from the recording: this step runs unrecorded, the next records
            // again.
            state.recorded = Recorded::None;
            return Ok(None);
        }
        state.pos += 1;
        // A copy: the next replay overwrites the recording's logits.
        self.backend.slice_rows(&step.logits, 0, 1).map(Some)
    }

    /// A step of one token of each of `seqs` (two or more) as a replay of the pool's recording
    /// for their bucket, recorded first where it has none or it no longer fits. `None`: nothing
    /// ran; run the step unrecorded.
    pub(super) fn recorded_batch(
        &self,
        seqs: &mut [(&[u32], &mut SeqState<B>)],
        p: &mut PoolInner<B>,
    ) -> Result<Option<Tensor<B>>> {
        let n = seqs.len();
        let Some(&rows) = BATCH_ROWS.iter().find(|&&r| r >= n) else { return Ok(None) };
        if !self.backend.records() {
            return Ok(None);
        }
        let old = match p.batch_steps.iter().position(|(r, _)| *r == rows) {
            Some(i) => match &p.batch_steps[i].1 {
                BatchStep::Failed { model, .. } if *model == self.id => return Ok(None),
                _ => Some(p.batch_steps.swap_remove(i).1),
            },
            None => None,
        };
        while p.padding.len() < rows - n {
            match self.padding_row(p)? {
                Some(pad) => p.padding.push(pad),
                None => return Ok(None),
            }
        }
        let pad = p.padding[..rows - n].to_vec();
        let zero = [0u32];
        let mut all: Vec<Row<'_>> = seqs.iter().map(|(ids, s)| Row::of(ids, s)).collect();
        all.extend(pad.iter().map(|pad| Row {
            ids: &zero,
            pos: 0,
            tables: &pad.tables,
            slot: pad.slot,
            verify: false,
        }));
        let replayed = match old {
            Some(BatchStep::Step(mut step)) if step.model == self.id => {
                self.replay(&mut step, &all, p)?.then_some(step)
            }
            _ => None,
        };
        let step = match replayed {
            Some(step) => step,
            None => match self.record(&all, p) {
                Ok(Some(mut step)) => {
                    if !self.replay(&mut step, &all, p)? {
                        return Ok(None);
                    }
                    p.batch_recordings += 1;
                    step
                }
                Ok(None) => return Ok(None),
                Err(error) => {
                    p.batch_steps.push((rows, BatchStep::Failed { model: self.id, error }));
                    return Ok(None);
                }
            },
        };
        drop(all);
        let logits = self.backend.slice_rows(&step.logits, 0, n);
        p.batch_steps.push((rows, BatchStep::Step(step)));
        for (_, state) in seqs.iter_mut() {
            state.pos += 1;
        }
        logits.map(Some)
    }

    /// What a replay of `rows` over `p` is given: their ids, positions, and, per layer in step
    /// order, their tables in its pool layer or their delta-net states.
    fn replay_inputs<'a>(
        &self,
        rows: &'a [Row<'a>],
        ids: &'a [u32],
        positions: &'a [usize],
        slots: &'a [Vec<GdnSlot<B>>],
    ) -> Result<ReplayInputs<'a, B>> {
        let mut inputs = ReplayInputs { ids, positions, attention: Vec::new(), delta_net: Vec::new() };
        for l in &self.state_layout.layers {
            match *l {
                LayerSlot::Kv { group, pool_layer } => inputs.attention.push(
                    rows.iter()
                        .map(|r| KvSeq { layer: pool_layer, table: r.tables[group].as_slice(), start: r.pos })
                        .collect(),
                ),
                LayerSlot::Gdn(g) => inputs.delta_net.push(
                    rows.iter()
                        .map(|r| {
                            let s = r
                                .slot
                                .and_then(|s| slots[g].get(s))
                                .ok_or_else(|| Error::input("sequence state belongs to another model"))?;
                            Ok((&s.conv, &s.recurrent))
                        })
                        .collect::<Result<Vec<_>>>()?,
                ),
            }
        }
        Ok(inputs)
    }

    /// Queues `step` over `rows` (one token each) in `p`; `false` where it no longer fits them.
    fn replay(&self, step: &mut RecordedStep<B>, rows: &[Row<'_>], p: &mut PoolInner<B>) -> Result<bool> {
        let ids: Vec<u32> = rows.iter().map(|r| r.ids[0]).collect();
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        let PoolInner { kv, slots, .. } = p;
        let inputs = self.replay_inputs(rows, &ids, &positions, slots)?;
        self.backend.replay(&mut step.graph, kv, &inputs)
    }

    /// Records the step of `rows` (one token each) over `p`; `None` where the backend does not
    /// record. The recording has not run: nothing changed (the tables already cover the step:
    /// each replay takes the tables of its own step).
    fn record(&self, rows: &[Row<'_>], p: &mut PoolInner<B>) -> Result<Option<RecordedStep<B>>> {
        let b = &self.backend;
        // The weights' derived state is built outside the recording (a recorder cannot build it).
        self.prepare()?;
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        let Some(recorder) = b.recorder(&positions)? else { return Ok(None) };
        let layout = Layout::of(rows);
        let logits = self.run_on(&recorder, rows, &layout, Logits::Last, false, p, None)?.logits;
        let graph = b.finish_recording(recorder)?;
        Ok(Some(RecordedStep { model: self.id, graph, logits }))
    }

    /// A padding row for the pool's recorded steps: a block of each group (at position 0) and a
    /// delta-net slot past the sequences' ones, taken now; `None` where the pool has no block to
    /// spare.
    fn padding_row(&self, p: &mut PoolInner<B>) -> Result<Option<Padding>> {
        let mut tables = Vec::with_capacity(p.groups.len());
        for g in 0..p.groups.len() {
            match p.groups[g].alloc() {
                Some(block) => tables.push(vec![block]),
                None => {
                    for (g, t) in tables.iter().enumerate() {
                        p.groups[g].release(t[0])?;
                    }
                    return Ok(None);
                }
            }
        }
        let slot = if self.state_layout.gdn.is_empty() {
            None
        } else {
            // Padding never takes a sequence's place.
            let b = &self.backend;
            for (layer, (conv, rec)) in p.slots.iter_mut().zip(&self.state_layout.gdn) {
                layer.push(GdnSlot { conv: b.zeros(conv)?, recurrent: b.zeros_f32(rec)? });
            }
            p.slots.first().map(|l| l.len() - 1)
        };
        Ok(Some(Padding { tables, slot }))
    }
}
