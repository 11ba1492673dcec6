//! The batch runner: one step over many sequences. Their tokens are laid out as rows of one
//! batch, single-token sequences first (`decode_first`), so every projection, norm and expert
//! reads its weights once per step, while attention and the delta rule run each sequence over
//! its own state in the sequences' pool.

use std::sync::Arc;

use vt_core::backend::stack_rows;
use vt_core::{Backend, Error, GdnState, Result, Tensor};

use super::layer::Mixer;
use super::pool::{lock, GdnSlot, LayerSlot, PoolInner};
use super::state::SeqState;
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
/// block tables and its delta-net slot (a sequence's, or the pool's padding for a recorded step).
pub(super) struct Row<'a> {
    pub(super) ids: &'a [u32],
    pub(super) pos: usize,
    pub(super) tables: &'a [Vec<u32>],
    pub(super) slot: Option<usize>,
}

impl<'a> Row<'a> {
    pub(super) fn of<B: Backend>(ids: &'a [u32], state: &'a SeqState<B>) -> Self {
        Row { ids, pos: state.pos, tables: &state.tables, slot: state.slot }
    }
}

/// Where one sequence's tokens sit in a batched step.
pub(super) struct Span {
    /// First row in the batch.
    pub(super) row: usize,
    pub(super) len: usize,
    /// Position of the first token in the sequence.
    pub(super) start: usize,
}

impl<B: Backend> Model<B> {
    /// `Model::forward` and `Model::forward_batch`: checks the inputs, takes the blocks the step
    /// writes (all or none: an error when the pool is short), then replays the sequence's
    /// recorded step where one sequence runs one token, else runs the step op by op; afterwards
    /// sliding groups give back the blocks that left their windows.
    pub(super) fn run(&self, seqs: &mut [(&[u32], &mut SeqState<B>)], which: Logits) -> Result<Tensor<B>> {
        let Some(shared) = seqs.first().map(|(_, s)| s.pool.clone()) else {
            return Err(Error::input("forward needs at least one sequence"));
        };
        for (ids, state) in seqs.iter() {
            if ids.is_empty() {
                return Err(Error::input("forward needs at least one token"));
            }
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.spec.vocab) {
                return Err(Error::input(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    self.spec.vocab
                )));
            }
            if !Arc::ptr_eq(&state.pool, &shared) {
                return Err(Error::input("the sequences of one step must share a pool"));
            }
        }
        let mut p = lock(&shared);
        if p.layout != self.state_layout {
            return Err(Error::input("sequence state belongs to another model"));
        }
        let mut need = vec![0; p.groups.len()];
        for (ids, state) in seqs.iter() {
            for (n, more) in need.iter_mut().zip(state.blocks_to_run(ids.len())) {
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
        for (ids, state) in seqs.iter_mut() {
            let end = state.pos + ids.len();
            state.grow(&mut p, end)?;
        }
        let mut logits = None;
        if self.record_decode {
            if let [(&[id], ref mut state)] = seqs {
                logits = self.recorded_step(id, state, &mut p)?;
            } else if seqs.iter().all(|(ids, _)| ids.len() == 1) {
                logits = self.recorded_batch(seqs, &mut p)?;
            }
        }
        let logits = match logits {
            Some(l) => Ok(l),
            None => {
                let rows: Vec<Row<'_>> = seqs.iter().map(|(ids, s)| Row::of(ids, s)).collect();
                let logits = self.run_on(&self.backend, &rows, which, &mut p);
                if logits.is_ok() {
                    for (ids, state) in seqs.iter_mut() {
                        state.pos += ids.len();
                    }
                }
                logits
            }
        };
        for (_, state) in seqs.iter_mut() {
            state.release_outside_windows(&mut p)?;
        }
        logits
    }

    /// The forward pass of `rows` on `b` (the model's backend, or a recorder of it) over their
    /// pool `p`, whose blocks cover every position the step writes; logits come back in the
    /// caller's order. The rows' positions are the caller's to advance.
    pub(super) fn run_on(&self, b: &B, rows: &[Row<'_>], which: Logits, p: &mut PoolInner<B>) -> Result<Tensor<B>> {
        let vt_core::Weight::Dense(table) = &self.embed.weight else {
            return Err(Error::tensor("embed_tokens", "quantized embeddings are not supported"));
        };
        let order = decode_first(rows.iter().map(|r| r.ids.len()));
        let mut spans = Vec::with_capacity(rows.len());
        let mut at = 0;
        for &i in &order {
            spans.push(Span { row: at, len: rows[i].ids.len(), start: rows[i].pos });
            at += rows[i].ids.len();
        }
        let all_ids: Vec<u32> = order.iter().flat_map(|&i| rows[i].ids.iter().copied()).collect();
        let (eps, kind) = (self.spec.eps, self.spec.norm);
        let mut x = b.embedding(table, &all_ids)?;
        // `h` is always the norm of `x` that comes next: each residual update and the following
        // norm are one fused step (the last one's norm is the model's final norm).
        let mut h = match self.layers.first() {
            Some(l) => b.rms_norm(&x, &l.input_norm, eps, kind)?,
            None => b.rms_norm(&x, &self.norm, eps, kind)?,
        };
        let other_model = || Error::input("sequence state belongs to another model");
        for (li, layer) in self.layers.iter().enumerate() {
            let mixed = match (&layer.mixer, self.state_layout.layers[li]) {
                (Mixer::Attention(a), LayerSlot::Kv { group, pool_layer }) => {
                    let tables: Vec<&[u32]> = order.iter().map(|&i| rows[i].tables[group].as_slice()).collect();
                    a.forward(b, &h, &spans, &mut p.kv, pool_layer, &tables, eps)?
                }
                (Mixer::DeltaNet(d), LayerSlot::Gdn(g)) => {
                    let mut by_slot: Vec<Option<&mut GdnSlot<B>>> = p.slots[g].iter_mut().map(Some).collect();
                    let mut states = order
                        .iter()
                        .map(|&i| {
                            let slot = rows[i].slot.and_then(|s| by_slot.get_mut(s)?.take()).ok_or_else(other_model)?;
                            Ok(GdnState { conv: &mut slot.conv, recurrent: &mut slot.recurrent })
                        })
                        .collect::<Result<Vec<_>>>()?;
                    d.forward(b, &h, &spans, &mut states, eps)?
                }
                _ => return Err(other_model()),
            };
            let (x1, h1) = b.add_rms_norm(&x, &mixed, &layer.post_norm, eps, kind)?;
            let f = layer.ffn.forward(b, &h1)?;
            let next_norm = self.layers.get(li + 1).map_or(&self.norm, |l| &l.input_norm);
            (x, h) = b.add_rms_norm(&x1, &f, next_norm, eps, kind)?;
        }
        // The final norm is row-wise: normalising all rows and keeping the last equals the reverse.
        // (Where every sequence ran one token, its row is its last, in the caller's order.)
        if which == Logits::Last && spans.iter().any(|s| s.len > 1) {
            let mut at = vec![0; order.len()];
            for (p, &i) in order.iter().enumerate() {
                at[i] = p;
            }
            let last = at.iter().map(|&p| b.slice_rows(&h, spans[p].row + spans[p].len - 1, 1));
            h = stack_rows(b, last.collect::<Result<Vec<_>>>()?)?;
        }
        b.linear(&h, self.lm_head.as_ref().unwrap_or(&self.embed))
    }
}

/// How many of a step's leading sequences run one token each, where they are at least two (one
/// batched call); 0 otherwise.
pub(super) fn batched_decodes(spans: &[Span]) -> usize {
    match spans.iter().take_while(|sp| sp.len == 1).count() {
        n if n >= 2 => n,
        _ => 0,
    }
}

/// The rows of one sequence's span of a batched tensor: the tensor itself, taken, when the span is
/// all of it (a single sequence: no copy), else a copy of its rows.
pub(super) fn take_rows<B: Backend>(b: &B, m: &mut Option<Tensor<B>>, sp: &Span) -> Result<Tensor<B>> {
    let all = m.as_ref().ok_or_else(|| Error::input("a batched tensor's rows were taken twice"))?;
    if sp.row == 0 && sp.len == all.rows() {
        return m.take().ok_or_else(|| Error::input("a batched tensor's rows were taken twice"));
    }
    b.slice_rows(all, sp.row, sp.len)
}
