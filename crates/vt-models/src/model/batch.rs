//! The batch runner: one step over many sequences. Their tokens are laid out as rows of one
//! batch (layout.rs: single-token steps first, in waves, then prompt chunks), so every
//! projection, norm and expert reads its weights once per step, while attention and the delta
//! rule run each sequence over its own state in the sequences' pool.

use std::ops::Range;
use std::sync::Arc;

use vt_core::{Backend, Error, GdnState, Result, Tensor};

use super::layer::Mixer;
use super::layout::{gather_rows, Layout};
use super::pool::{lock, GdnSlot, LayerSlot, PoolInner};
use super::state::SeqState;
use super::verify::{Saved, Unsettled};
use super::Model;

/// Which positions `forward` returns logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
}

/// The order a step runs sequences in, as indices into `tokens` (the count each sequence runs):
/// single-token sequences first, then the others, each group in the given order. The layers run
/// the leading single tokens as one batch, and a scheduler fills a step's token budget in this
/// order (decodes are latency-bound).
pub fn decode_first(tokens: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let tokens: Vec<usize> = tokens.into_iter().collect();
    let mut order: Vec<usize> = (0..tokens.len()).collect();
    order.sort_by_key(|&i| tokens[i] > 1);
    order
}

/// One row group of a step as the layers read it: a sequence's new tokens, where they start, its
/// block tables, its delta-net slot (a sequence's, or the pool's padding for a recorded step) and
/// whether it verifies (runs its tokens as single-token steps and gets every position's logits).
pub(super) struct Row<'a> {
    pub(super) ids: &'a [u32],
    pub(super) pos: usize,
    pub(super) tables: &'a [Vec<u32>],
    pub(super) slot: Option<usize>,
    /// The slot its delta-net layers also write their states after its first position into (a
    /// verification's rollback point: verify.rs).
    pub(super) first: Option<usize>,
    pub(super) verify: bool,
}

impl<'a> Row<'a> {
    pub(super) fn of<B: Backend>(ids: &'a [u32], state: &'a SeqState<B>) -> Self {
        Row { ids, pos: state.pos, tables: &state.tables, slot: state.slot, first: state.first_slot, verify: false }
    }
}

/// One sequence's part in `Model::step`.
pub struct StepSeq<'a, B: Backend> {
    /// The tokens to run after what the state holds.
    pub ids: &'a [u32],
    pub state: &'a mut SeqState<B>,
    /// Run `ids` as consecutive single-token steps and return the logits of every position: the
    /// target's side of speculative decoding (the last accepted token, then the drafts). The state
    /// then holds every position, unsettled, until `Model::settle` says how many it keeps.
    pub verify: bool,
}

/// A step as it ran: what it gave, each verifying sequence's rows of it (in the caller's order;
/// empty for the others) and the delta-net inputs of those rows, which `settle` reruns from.
pub(super) struct Ran<B: Backend> {
    pub(super) step: StepOutput<B>,
    pub(super) verified: Vec<Vec<usize>>,
    pub(super) saved: Arc<Saved<B>>,
}

/// What `Model::step` computed.
pub struct StepOutput<B: Backend> {
    /// `[rows, vocab]`: each sequence's logits rows, in the sequences' order.
    pub logits: Tensor<B>,
    /// Each sequence's rows of `logits`: its last position's, or every position's where it
    /// verifies (or the step was asked for all).
    pub rows: Vec<Range<usize>>,
    /// Where asked for: every position's hidden state after the last layer, before the final
    /// norm (what a multi-token-prediction drafter reads), `[tokens, hidden]`, each sequence's
    /// positions together in the sequences' order.
    pub hidden: Option<Tensor<B>>,
}

impl<B: Backend> Model<B> {
    /// `Model::forward`, `forward_batch` and `step`: checks the inputs, takes the blocks the step
    /// writes (all or none: an error when the pool is short), then replays the sequence's
    /// recorded step where one sequence runs one token, else runs the step op by op; afterwards
    /// sliding groups give back the blocks that left their windows (a verifying sequence's, when
    /// it settles).
    pub(super) fn run(&self, seqs: &mut [StepSeq<'_, B>], which: Logits, hidden: bool) -> Result<StepOutput<B>> {
        match self.peers.is_empty() {
            true => self.run_rank(seqs, which, hidden),
            false => self.run_ranks(seqs, which, hidden),
        }
    }

    /// `run` on one rank (the whole model where it is not split).
    pub(super) fn run_rank(&self, seqs: &mut [StepSeq<'_, B>], which: Logits, hidden: bool) -> Result<StepOutput<B>> {
        let Some(shared) = seqs.first().map(|s| s.state.pool.clone()) else {
            return Err(Error::input("forward needs at least one sequence"));
        };
        for s in seqs.iter() {
            if s.ids.is_empty() {
                return Err(Error::input("forward needs at least one token"));
            }
            if let Some(&bad) = s.ids.iter().find(|&&id| id as usize >= self.spec.vocab) {
                return Err(Error::input(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    self.spec.vocab
                )));
            }
            if !Arc::ptr_eq(&s.state.pool, &shared) {
                return Err(Error::input("the sequences of one step must share a pool"));
            }
            if s.state.unsettled.is_some() {
                return Err(Error::input("a sequence's verification is not settled (Model::settle)"));
            }
        }
        let mut p = lock(&shared);
        if p.layout != self.state_layout {
            return Err(Error::input("sequence state belongs to another model"));
        }
        let mut need = vec![0; p.groups.len()];
        for s in seqs.iter() {
            for (n, more) in need.iter_mut().zip(s.state.blocks_to_run(s.ids.len())) {
                *n += more;
            }
        }
        if let Some((g, n)) = need.iter().enumerate().find(|&(g, &n)| n > p.groups[g].free()) {
            return Err(Error::input(format!(
                "the KV pool is out of blocks: this step needs {n} more of group {g}, {} are free of {}",
                p.groups[g].free(),
                p.groups[g].total()
            )));
        }
        for s in seqs.iter_mut() {
            let end = s.state.pos + s.ids.len();
            s.state.grow(&mut p, end)?;
        }
        // Where a verifying sequence's linear-attention state after its first position goes, for
        // `settle`.
        self.take_first_slots(seqs, &mut p)?;
        let out = match self.run_recorded_or_not(seqs, which, hidden, &mut p) {
            Ok(ran) => ran,
            Err(e) => {
                seqs.iter_mut().filter_map(|s| s.state.first_slot.take()).for_each(|s| p.give_slot(s));
                return Err(e);
            }
        };
        for s in seqs.iter_mut() {
            s.state.pos += s.ids.len();
        }
        for (i, s) in seqs.iter_mut().enumerate() {
            if s.verify {
                let len = s.ids.len();
                let rows = out.verified[i].clone();
                let start = s.state.pos - len;
                let saved = out.saved.clone();
                let first = s.state.first_slot.take();
                s.state.unsettled = Some(Unsettled { start, len, first, rows, saved });
            } else {
                s.state.release_outside_windows(&mut p)?;
            }
        }
        Ok(out.step)
    }

    /// The step of `seqs` (their blocks taken): a replay of a recording where the backend
    /// records and the step is a decode step of one token a sequence, or one sequence's step
    /// (a decode token or a verification, with or without the hidden states), else op by op.
    fn run_recorded_or_not(
        &self,
        seqs: &mut [StepSeq<'_, B>],
        which: Logits,
        hidden: bool,
        p: &mut PoolInner<B>,
    ) -> Result<Ran<B>> {
        // A recording would have to capture the ranks' collectives: split models run unrecorded.
        // Recordings run single-token rows: decode tokens and verifications, not prompt chunks
        // (and such rows give the same logits rows whatever `which` asks).
        let records = self.record_decode && self.comm.is_none() && seqs.iter().all(|s| s.verify || s.ids.len() == 1);
        let recorded = match &mut *seqs {
            _ if !records => None,
            [s] => self.recorded_step(s, hidden, p)?,
            _ => self.recorded_batch(seqs, hidden, p)?,
        };
        if let Some(ran) = recorded {
            return Ok(ran);
        }
        let rows: Vec<Row<'_>> = seqs.iter().map(|s| Row { verify: s.verify, ..Row::of(s.ids, s.state) }).collect();
        let layout = Layout::of(&rows);
        let mut saved = Vec::new();
        let step = self.run_on(&self.backend, &rows, &layout, which, hidden, p, Some(&mut saved))?;
        let mut verified = vec![Vec::new(); seqs.len()];
        for (k, &i) in layout.order.iter().enumerate() {
            if seqs[i].verify {
                verified[i] = layout.rows_of(k);
            }
        }
        Ok(Ran { step, verified, saved: Arc::new(saved) })
    }

    /// Gives each verifying sequence of more than one position a spare slot of the pool
    /// (`SeqState::first_slot`), where the step writes its linear-attention state after its first
    /// position (none where the model has no such layers).
    fn take_first_slots(&self, seqs: &mut [StepSeq<'_, B>], p: &mut PoolInner<B>) -> Result<()> {
        for i in 0..seqs.len() {
            let s = &seqs[i];
            if !s.verify || s.ids.len() < 2 || s.state.slot.is_none() {
                continue;
            }
            let Some(spare) = p.take_slot() else {
                seqs.iter_mut().filter_map(|s| s.state.first_slot.take()).for_each(|s| p.give_slot(s));
                return Err(Error::input(
                    "no spare linear-attention slot for a verifying sequence's rollback: the pool needs one per \
                     verifying sequence (PoolConfig::snapshots)",
                ));
            };
            seqs[i].state.first_slot = Some(spare);
        }
        Ok(())
    }

    /// The forward pass of `rows`, laid out as `layout`, on `b` (the model's backend, or a
    /// recorder of it) over their pool `p`, whose blocks cover every position the step writes.
    /// Where the step verifies, each delta-net layer's inputs go to `saved` (for `settle`). The
    /// rows' positions are the caller's to advance.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_on(
        &self,
        b: &B,
        rows: &[Row<'_>],
        layout: &Layout,
        which: Logits,
        hidden: bool,
        p: &mut PoolInner<B>,
        mut saved: Option<&mut Saved<B>>,
    ) -> Result<StepOutput<B>> {
        let vt_core::Weight::Dense(table) = &self.embed.weight else {
            return Err(Error::tensor("embed_tokens", "quantized embeddings are not supported"));
        };
        let all_ids = layout.ids(rows);
        let (eps, kind) = (self.spec.eps, self.spec.norm);
        let mut x = b.embedding(table, &all_ids)?;
        // `h` is always the norm of `x` that comes next: each residual update and the following
        // norm are one fused step (the last one's norm is the model's final norm).
        let mut h = match self.layers.first() {
            Some(l) => b.rms_norm(&x, &l.input_norm, eps, kind)?,
            None => b.rms_norm(&x, &self.norm, eps, kind)?,
        };
        let other_model = || Error::input("sequence state belongs to another model");
        let order = &layout.order;
        for (li, layer) in self.layers.iter().enumerate() {
            let mixed = match (&layer.mixer, self.state_layout.layers[li]) {
                (Mixer::Attention(a), LayerSlot::Kv { group, pool_layer }) => {
                    let tables: Vec<&[u32]> = order.iter().map(|&i| rows[i].tables[group].as_slice()).collect();
                    a.forward(b, &h, layout, &mut p.kv, pool_layer, &tables, eps)?
                }
                (Mixer::DeltaNet(d), LayerSlot::Gdn(g)) => {
                    let mut by_slot: Vec<Option<&mut GdnSlot<B>>> = p.slots[g].iter_mut().map(Some).collect();
                    let mut take = |s: Option<usize>| {
                        let slot = s.and_then(|s| by_slot.get_mut(s)?.take()).ok_or_else(other_model)?;
                        Ok(GdnState { conv: &mut slot.conv, recurrent: &mut slot.recurrent })
                    };
                    let mut states = order.iter().map(|&i| take(rows[i].slot)).collect::<Result<Vec<_>>>()?;
                    let mut firsts = (order.iter())
                        .map(|&i| rows[i].first.map(|f| take(Some(f))).transpose())
                        .collect::<Result<Vec<_>>>()?;
                    let keep = saved.as_deref_mut().filter(|_| layout.verifies());
                    d.forward(b, &h, layout, &mut states, &mut firsts, eps, keep)?
                }
                _ => return Err(other_model()),
            };
            let mixed = self.reduce(b, mixed)?;
            let (x1, h1) = b.add_rms_norm(&x, &mixed, &layer.post_norm, eps, kind)?;
            let f = self.reduce(b, layer.ffn.forward(b, &h1)?)?;
            let next_norm = self.layers.get(li + 1).map_or(&self.norm, |l| &l.input_norm);
            (x, h) = b.add_rms_norm(&x1, &f, next_norm, eps, kind)?;
        }
        // The rows each sequence gets logits for, in the caller's order. The final norm is
        // row-wise: normalising all rows and keeping some equals the reverse.
        let mut at = vec![0; order.len()];
        for (k, &i) in order.iter().enumerate() {
            at[i] = k;
        }
        let (mut out_rows, mut ranges) = (Vec::new(), Vec::with_capacity(rows.len()));
        for (i, r) in rows.iter().enumerate() {
            let mine = layout.rows_of(at[i]);
            let from = out_rows.len();
            match which == Logits::All || r.verify {
                true => out_rows.extend(mine),
                false => out_rows.extend(mine.last()),
            }
            ranges.push(from..out_rows.len());
        }
        let identity = |r: &[usize]| r.len() == layout.rows && r.iter().enumerate().all(|(j, &r)| j == r);
        if !identity(&out_rows) {
            h = gather_rows(b, &h, &out_rows)?;
        }
        let hidden = match hidden {
            true => {
                let all: Vec<usize> = (0..rows.len()).flat_map(|i| layout.rows_of(at[i])).collect();
                Some(if identity(&all) { x } else { gather_rows(b, &x, &all)? })
            }
            false => None,
        };
        let logits = self.logits(b, &h)?;
        Ok(StepOutput { logits, rows: ranges, hidden })
    }
}
