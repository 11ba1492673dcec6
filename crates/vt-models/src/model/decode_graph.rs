//! Recorded decode steps: where the backend records (CUDA graphs), a decode step is recorded once
//! and replayed while the backend says it fits (CUDA: for 256 positions past the recorded ones),
//! so a step costs one launch instead of one per op. Replays compute exactly what the unrecorded
//! step of the same rows computes: the same kernels over the same memory, with the token ids, the
//! positions, the block tables and the delta-net states' addresses read from device memory.
//!
//! A sequence stepping alone replays its own recording of the step's shape (kept in its state): a
//! decode step, or a verification of k drafts (its k + 1 positions as consecutive single-token
//! rows), with or without the hidden states a drafter reads. Steps of several sequences of one
//! shape replay the pool's recording for the smallest bucket of `BATCH_ROWS` that holds them; rows
//! past the sequences are padding, each over a block of each group and a delta-net slot the pool
//! keeps for it (at most 7: the buckets are 8 apart from 8 on), and their outputs are dropped.

use std::sync::Arc;

use vt_core::{Backend, Error, KvSeq, ReplayInputs, ReplayStates, Result, Tensor};

use super::batch::{Ran, Row, StepOutput, StepSeq};
use super::layout::Layout;
use super::pool::{GdnSlot, LayerSlot, Padding, PoolInner};
use super::state::{Recorded, SeqState};
use super::verify::Saved;
use super::{Logits, Model};

/// Rows of the pool's batched recordings: a step of n sequences replays the first bucket >= n.
pub const BATCH_ROWS: [usize; 18] = [2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128];

/// A recorded step, the model it runs (its weights are in the recording), and where its replays
/// leave what it gives (the recording's memory): the logits, the hidden states where it gives
/// them, and a verification's delta-net inputs (what `Model::settle` reruns).
pub(super) struct RecordedStep<B: Backend> {
    model: u64,
    graph: B::StepGraph,
    logits: Tensor<B>,
    hidden: Option<Tensor<B>>,
    saved: Arc<Saved<B>>,
}

impl<B: Backend> RecordedStep<B> {
    /// What a replay gave its first `n` sequences, of `shape`, laid out as `layout` (equal lengths
    /// keep the caller's order, padding last): copies of their logits and hidden rows, as the
    /// next replay overwrites the recording's; the delta-net inputs are shared, as `settle` reads
    /// them before these sequences step again.
    fn ran(&self, b: &B, n: usize, shape: StepShape, layout: &Layout) -> Result<Ran<B>> {
        let out = if shape.verify { shape.tokens } else { 1 };
        let logits = b.slice_rows(&self.logits, 0, n * out)?;
        let hidden = self.hidden.as_ref().map(|h| b.slice_rows(h, 0, n * shape.tokens)).transpose()?;
        let verified = (0..n).map(|k| if shape.verify { layout.rows_of(k) } else { Vec::new() }).collect();
        let rows = (0..n).map(|i| i * out..(i + 1) * out).collect();
        Ok(Ran { step: StepOutput { logits, rows, hidden }, verified, saved: self.saved.clone() })
    }
}

/// What a sequence's own recorded step runs: its tokens (1, or a verification's positions), and
/// whether it gives the hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StepShape {
    tokens: usize,
    verify: bool,
    hidden: bool,
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

    /// The step of one sequence (a decode token, or a verification) as a replay of its own
    /// recording of that shape, recorded first if it has none. `None`: nothing ran and the state
    /// is as it was; run the step unrecorded. `p` is the sequence's pool, whose blocks cover the
    /// step's positions. The state's position is the caller's to advance.
    pub(super) fn recorded_step(
        &self,
        s: &mut StepSeq<'_, B>,
        hidden: bool,
        p: &mut PoolInner<B>,
    ) -> Result<Option<Ran<B>>> {
        let shape = StepShape { tokens: s.ids.len(), verify: s.verify, hidden };
        let SeqState { pos, tables, slot, first_slot, recorded, recordings, .. } = &mut *s.state;
        let row = [Row { ids: s.ids, pos: *pos, tables, slot: *slot, first: *first_slot, verify: s.verify }];
        // Another model's recordings run that model's weights: this one records its own.
        recorded.retain(|(_, r)| !matches!(r, Recorded::Step(step) if step.model != self.id));
        let at = match recorded.iter().position(|(sh, _)| *sh == shape) {
            Some(at) => at,
            None => {
                let made = match self.record(&row, hidden, p) {
                    Ok(Some(step)) => Recorded::Step(step),
                    Ok(None) => return Ok(None),
                    Err(e) => Recorded::Failed(e),
                };
                *recordings += usize::from(matches!(made, Recorded::Step(_)));
                recorded.push((shape, made));
                recorded.len() - 1
            }
        };
        let Recorded::Step(step) = &mut recorded[at].1 else { return Ok(None) };
        if !self.replay(step, &row, p)? {
            // The tables moved on from the recording: this step runs unrecorded, the next records
            // again.
            recorded.swap_remove(at);
            return Ok(None);
        }
        step.ran(&self.backend, 1, shape, &Layout::of(&row)).map(Some)
    }

    /// A step of two or more sequences of one shape (a token each, or verifications of as many
    /// positions each) as a replay of the pool's recording for their bucket, recorded first where
    /// it has none or it no longer fits (each sequence's rows of what it gives in its order).
    /// `None`: nothing ran; run the step unrecorded. Positions are the caller's to advance.
    pub(super) fn recorded_batch(
        &self,
        seqs: &mut [StepSeq<'_, B>],
        hidden: bool,
        p: &mut PoolInner<B>,
    ) -> Result<Option<Ran<B>>> {
        let n = seqs.len();
        let Some(first) = seqs.first() else { return Ok(None) };
        let shape = StepShape { tokens: first.ids.len(), verify: first.verify, hidden };
        let same = seqs.iter().all(|s| s.ids.len() == shape.tokens && s.verify == shape.verify);
        let Some(&rows) = BATCH_ROWS.iter().find(|&&r| r >= n) else { return Ok(None) };
        // Padding rows run their positions from 0 in one block.
        if !same || !self.backend.records() || shape.tokens > p.layout.block {
            return Ok(None);
        }
        let key = (rows, shape);
        let old = match p.batch_steps.iter().position(|(k, _)| *k == key) {
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
        let zeros = vec![0u32; shape.tokens];
        let mut all: Vec<Row<'_>> = seqs.iter().map(|s| Row { verify: s.verify, ..Row::of(s.ids, s.state) }).collect();
        all.extend(pad.iter().map(|pad| Row {
            ids: &zeros,
            pos: 0,
            tables: &pad.tables,
            slot: pad.slot,
            first: None,
            verify: shape.verify,
        }));
        let replayed = match old {
            Some(BatchStep::Step(mut step)) if step.model == self.id => {
                self.replay(&mut step, &all, p)?.then_some(step)
            }
            _ => None,
        };
        let step = match replayed {
            Some(step) => step,
            None => match self.record(&all, hidden, p) {
                Ok(Some(mut step)) => {
                    if !self.replay(&mut step, &all, p)? {
                        return Ok(None);
                    }
                    p.batch_recordings += 1;
                    step
                }
                Ok(None) => return Ok(None),
                Err(error) => {
                    p.batch_steps.push((key, BatchStep::Failed { model: self.id, error }));
                    return Ok(None);
                }
            },
        };
        let ran = step.ran(&self.backend, n, shape, &Layout::of(&all));
        drop(all);
        p.batch_steps.push((key, BatchStep::Step(step)));
        ran.map(Some)
    }

    /// What a replay of `rows` (laid out as `layout`) over `p` is given: their ids and positions
    /// in row order, and, per layer in step order, the tables in its pool layer of every row's
    /// sequence, or the delta-net states of all of them (the calls `run_on` makes: one attention
    /// call and one delta-net call over all waves).
    fn replay_inputs<'a>(
        &self,
        rows: &'a [Row<'a>],
        layout: &Layout,
        ids: &'a [u32],
        positions: &'a [usize],
        slots: &'a [Vec<GdnSlot<B>>],
    ) -> Result<ReplayInputs<'a, B>> {
        let mut inputs = ReplayInputs { ids, positions, attention: Vec::new(), delta_net: Vec::new() };
        let seqs = |w: &super::layout::Wave| layout.order[..w.seqs].iter().map(|&i| &rows[i]);
        for l in &self.state_layout.layers {
            match *l {
                LayerSlot::Kv { group, pool_layer } => inputs.attention.push(
                    (layout.waves.iter().enumerate())
                        .flat_map(|(j, w)| {
                            seqs(w).map(move |r| KvSeq {
                                layer: pool_layer,
                                table: r.tables[group].as_slice(),
                                start: r.pos + j,
                            })
                        })
                        .collect(),
                ),
                LayerSlot::Gdn(g) => inputs.delta_net.push(
                    layout.order[..layout.stepwise()]
                        .iter()
                        .map(|&i| {
                            let slot = |s: Option<usize>| {
                                s.and_then(|s| slots[g].get(s))
                                    .ok_or_else(|| Error::input("sequence state belongs to another model"))
                            };
                            let s = slot(rows[i].slot)?;
                            let first =
                                rows[i].first.map(|f| slot(Some(f)).map(|f| (&f.conv, &f.recurrent))).transpose()?;
                            Ok(ReplayStates { conv: &s.conv, recurrent: &s.recurrent, first })
                        })
                        .collect::<Result<Vec<_>>>()?,
                ),
            }
        }
        Ok(inputs)
    }

    /// Queues `step` over `rows` (single-token steps: no prompt chunks) in `p`; `false` where it
    /// no longer fits them.
    fn replay(&self, step: &mut RecordedStep<B>, rows: &[Row<'_>], p: &mut PoolInner<B>) -> Result<bool> {
        let layout = Layout::of(rows);
        let (ids, positions) = (layout.ids(rows), layout.positions());
        let PoolInner { kv, slots, .. } = p;
        let inputs = self.replay_inputs(rows, &layout, &ids, &positions, slots)?;
        self.backend.replay(&mut step.graph, kv, &inputs)
    }

    /// Records the step of `rows` (single-token steps: no prompt chunks) over `p`, giving the
    /// hidden states where asked; `None` where the backend does not record. The recording has
    /// not run: nothing changed (the tables already cover the step: each replay takes the tables
    /// of its own step).
    fn record(&self, rows: &[Row<'_>], hidden: bool, p: &mut PoolInner<B>) -> Result<Option<RecordedStep<B>>> {
        let b = &self.backend;
        // The weights' derived state is built outside the recording (a recorder cannot build it).
        self.prepare()?;
        let layout = Layout::of(rows);
        let Some(recorder) = b.recorder(&layout.positions())? else { return Ok(None) };
        let mut saved = Vec::new();
        let out = self.run_on(&recorder, rows, &layout, Logits::Last, hidden, p, Some(&mut saved))?;
        let graph = b.finish_recording(recorder)?;
        Ok(Some(RecordedStep { model: self.id, graph, logits: out.logits, hidden: out.hidden, saved: Arc::new(saved) }))
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
