//! The checkpoint's multi-token-prediction layer as the drafter (`vt_models::Model::draft`).
//!
//! The MTP's row at position `i` reads the target's hidden state at `i` and the token at `i + 1`;
//! its KV lives in the sequence's blocks beside the target's. The drafter keeps the MTP in step
//! with the target: after every step it feeds each sequence's kept positions (`observe`: one
//! batched call, the last row's next token the one just sampled), so wherever the target's KV is
//! (a block the prefix cache keeps, one a fork shares), the MTP's is too. To draft (`propose`) it
//! chains `k` drafts (one batched call per draft count) from the MTP's output at the sequence's
//! last position, which the state kept from `observe`'s feed (or, for a sequence whose state did
//! not keep it, a fork, from feeding that position again). The drafts are the MTP's argmax tokens: the acceptance rule
//! takes them as a point mass, so sampled requests keep their distribution.

use std::collections::HashMap;

use vt_core::{Backend, Error, Result, Tensor};
use vt_models::{DraftInput, Model};

use super::{Draft, Drafter, Observation, Proposal, SeqId};

/// Drafts with the target's MTP layer (`Model::has_mtp`).
pub struct MtpDrafter<B: Backend> {
    /// Each sequence's latest fed positions: where they start and the target's hidden states
    /// there, `[len, hidden]`, ending where the sequence's state ends.
    held: HashMap<SeqId, (usize, Tensor<B>)>,
}

impl<B: Backend> Default for MtpDrafter<B> {
    fn default() -> Self {
        MtpDrafter { held: HashMap::new() }
    }
}

/// Rows `from..end` of `rows`, which hold positions `start..` of sequence `seq`.
fn rows_of<B: Backend>(
    b: &B,
    seq: SeqId,
    (start, rows): &(usize, Tensor<B>),
    from: usize,
    end: usize,
) -> Result<Tensor<B>> {
    let held = *start..start + rows.rows();
    if from < held.start || held.end != end {
        return Err(Error::input(format!(
            "the MTP drafter holds sequence {seq}'s hidden states of positions {held:?}, not of {from}..{end}"
        )));
    }
    b.slice_rows(rows, from - start, end - from)
}

impl<B: Backend> Drafter<B> for MtpDrafter<B> {
    fn needs_hidden(&self) -> bool {
        true
    }

    fn propose(&mut self, model: &Model<B>, seqs: &mut [Proposal<'_, B>]) -> Result<Vec<Draft>> {
        let b = model.backend();
        // Each proposal's rows to feed: none where the MTP kept its output at the last position
        // (`observe` fed it), else from its last position (earlier where a fork has not fed its
        // own yet). No drafts for a sequence not observed yet.
        let mut feeds = Vec::with_capacity(seqs.len());
        for p in seqs.iter_mut() {
            let pos = p.state.len();
            let feed = match self.held.get(&p.seq) {
                Some(_) if p.k > 0 && p.state.mtp_ready() && p.state.mtp_len() == pos => Some(None),
                Some(held) if p.k > 0 && pos > 0 => {
                    let from = p.state.mtp_len().min(pos - 1);
                    let rows = rows_of(b, p.seq, held, from, pos)?;
                    p.state.cut_mtp(from);
                    Some(Some((from, rows)))
                }
                _ => None,
            };
            feeds.push(feed);
        }
        let mut ks: Vec<usize> = (seqs.iter().zip(&feeds)).filter(|(_, f)| f.is_some()).map(|(p, _)| p.k).collect();
        ks.sort_unstable();
        ks.dedup();
        let mut out = vec![Draft::default(); seqs.len()];
        for k in ks {
            let (mut inputs, mut at) = (Vec::new(), Vec::new());
            for (i, (p, feed)) in seqs.iter_mut().zip(&feeds).enumerate() {
                let Some(feed) = feed.as_ref().filter(|_| p.k == k) else { continue };
                let Some((from, rows)) = feed else {
                    inputs.push(DraftInput { state: &mut *p.state, hidden: None, next: &[] });
                    at.push(i);
                    continue;
                };
                let (tokens, pos) = (p.tokens, p.state.len());
                let next = tokens.get(from + 1..=pos).ok_or_else(|| {
                    Error::input(format!("sequence {}: {} tokens for a state of {pos}", p.seq, tokens.len()))
                })?;
                inputs.push(DraftInput { state: &mut *p.state, hidden: Some(rows), next });
                at.push(i);
            }
            for (i, d) in at.into_iter().zip(model.draft(&mut inputs, k)?) {
                out[i] = Draft { tokens: d.tokens, probs: None };
            }
        }
        Ok(out)
    }

    fn observe(&mut self, model: &Model<B>, seqs: &mut [Observation<'_, B>]) -> Result<()> {
        let b = model.backend();
        // Each sequence's rows from where its MTP stands: this step's, after the held ones a fork
        // has not fed yet.
        let mut feeds = Vec::with_capacity(seqs.len());
        for o in seqs.iter_mut() {
            let hidden = o.hidden.take().ok_or_else(|| Error::input("the MTP drafter needs the hidden states"))?;
            let at = o.state.mtp_len();
            let feed = match self.held.get(&o.seq) {
                _ if at >= o.start => (o.start, hidden),
                Some(held) => (at, b.concat_rows(&[&rows_of(b, o.seq, held, at, o.start)?, &hidden])?),
                None => {
                    return Err(Error::input(format!(
                        "the MTP drafter has no hidden states of sequence {}'s positions {at}..{}",
                        o.seq, o.start
                    )))
                }
            };
            o.state.cut_mtp(feed.0);
            feeds.push(feed);
        }
        let mut inputs = Vec::with_capacity(seqs.len());
        for (o, (from, rows)) in seqs.iter_mut().zip(&feeds) {
            let (tokens, end) = (o.tokens, o.start + o.len);
            let next = tokens.get(from + 1..=end).ok_or_else(|| {
                Error::input(format!("sequence {}: {} tokens, none after position {end}", o.seq, tokens.len()))
            })?;
            inputs.push(DraftInput { state: &mut *o.state, hidden: Some(rows), next });
        }
        if !inputs.is_empty() {
            model.draft(&mut inputs, 0)?;
        }
        for (o, feed) in seqs.iter().zip(feeds) {
            self.held.insert(o.seq, feed);
        }
        Ok(())
    }

    fn fork(&mut self, model: &Model<B>, parent: SeqId, child: SeqId) -> Result<()> {
        if let Some((start, rows)) = self.held.get(&parent) {
            let copy = model.backend().slice_rows(rows, 0, rows.rows())?;
            self.held.insert(child, (*start, copy));
        }
        Ok(())
    }

    fn release(&mut self, seq: SeqId) {
        self.held.remove(&seq);
    }
}
