//! The batch runner: one step over many sequences. Their tokens are laid out as rows of one
//! batch, single-token sequences first (`decode_first`), so every projection, norm and expert
//! reads its weights once per step, while attention and the delta rule run each sequence over
//! its own state.

use vt_core::backend::stack_rows;
use vt_core::{Backend, Error, Result, Tensor};

use super::state::{LayerState, SeqState};
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

/// Where one sequence's tokens sit in a batched step.
pub(super) struct Span {
    /// First row in the batch.
    pub(super) row: usize,
    pub(super) len: usize,
    /// Position of the first token in the sequence.
    pub(super) start: usize,
}

impl<B: Backend> Model<B> {
    /// `Model::forward` and `Model::forward_batch`: checks the inputs, then replays the sequence's
    /// recorded step where one sequence runs one token, else runs the step op by op.
    pub(super) fn run(&self, seqs: &mut [(&[u32], &mut SeqState<B>)], which: Logits) -> Result<Tensor<B>> {
        if seqs.is_empty() {
            return Err(Error::input("forward needs at least one sequence"));
        }
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
            if state.layers.len() != self.layers.len() {
                return Err(Error::input("sequence state belongs to another model"));
            }
        }
        if let [(&[id], ref mut state)] = seqs {
            if self.record_decode {
                if let Some(logits) = self.recorded_step(id, state)? {
                    return Ok(logits);
                }
            }
        }
        self.run_on(&self.backend, seqs, which)
    }

    /// The forward pass of `seqs` on `b` (the model's backend, or a recorder of it); logits come
    /// back in the caller's order.
    pub(super) fn run_on(&self, b: &B, seqs: &mut [(&[u32], &mut SeqState<B>)], which: Logits) -> Result<Tensor<B>> {
        let vt_core::Weight::Dense(table) = &self.embed.weight else {
            return Err(Error::tensor("embed_tokens", "quantized embeddings are not supported"));
        };
        let order = decode_first(seqs.iter().map(|(ids, _)| ids.len()));
        let mut spans = Vec::with_capacity(seqs.len());
        let mut row = 0;
        for &i in &order {
            let (ids, state) = &seqs[i];
            spans.push(Span { row, len: ids.len(), start: state.pos });
            row += ids.len();
        }
        let all_ids: Vec<u32> = order.iter().flat_map(|&i| seqs[i].0.iter().copied()).collect();
        let (eps, kind) = (self.spec.eps, self.spec.norm);
        let mut x = b.embedding(table, &all_ids)?;
        // `h` is always the norm of `x` that comes next: each residual update and the following
        // norm are one fused step (the last one's norm is the model's final norm).
        let mut h = match self.layers.first() {
            Some(l) => b.rms_norm(&x, &l.input_norm, eps, kind)?,
            None => b.rms_norm(&x, &self.norm, eps, kind)?,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let mut by_seq: Vec<Option<&mut LayerState<B>>> =
                seqs.iter_mut().map(|(_, s)| s.layers.get_mut(li)).collect();
            let mut states = order
                .iter()
                .map(|&i| by_seq[i].take().ok_or_else(|| Error::input("sequence state belongs to another model")))
                .collect::<Result<Vec<_>>>()?;
            let mixed = layer.mixer.forward(b, &h, &spans, &mut states, eps)?;
            let (x1, h1) = b.add_rms_norm(&x, &mixed, &layer.post_norm, eps, kind)?;
            let f = layer.ffn.forward(b, &h1)?;
            let next_norm = self.layers.get(li + 1).map_or(&self.norm, |l| &l.input_norm);
            (x, h) = b.add_rms_norm(&x1, &f, next_norm, eps, kind)?;
        }
        for (ids, state) in seqs.iter_mut() {
            state.pos += ids.len();
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
