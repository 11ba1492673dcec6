//! The multi-token-prediction (MTP) layer of Qwen3.5/3.6 as the draft model of speculative
//! decoding. As vLLM and SGLang run it (qwen3_5_mtp), one row at position `i` reads the model's
//! hidden state at `i` after the model's final norm (what its LM head reads; the caller hands the
//! state before that norm, as a step leaves it, and `draft` applies it) and the token at `i + 1`:
//!
//! ```text
//! x      = fc([pre_fc_norm_embedding(embed(token)) | pre_fc_norm_hidden(norm(hidden))])
//! x      = one decoder layer (gated attention over its own KV in the pool, MoE)
//! out    = norm(x)          -> logits = lm_head(out), the model's LM head
//! ```
//!
//! Draft `j + 1` is a row at the next position that reads the MTP's own `out` and draft `j`.
//! The MTP's KV must hold every position the sequence has: `Model::draft` first feeds the
//! positions it has not seen (the model's hidden states of the tokens it accepted), then chains.

use vt_core::backend::stack_rows;
use vt_core::{Backend, Error, Linear, MoeExperts, Result, Tensor, Weight};

use super::layer::{Ffn, Layer, Mixer};
use super::layout::Layout;
use super::pool::{lock, LayerSlot, PoolInner};
use super::state::SeqState;
use super::Model;
use crate::loader::Loader;
use crate::spec::LayerSpec;
use crate::split::Shard;

/// The tensor whose presence says a checkpoint carries the MTP layer: its final norm, stored as
/// floats whatever the checkpoint quantizes (compressed-tensors names a quantized
/// `mtp.fc.weight` `mtp.fc.weight_packed`).
pub(super) const MARKER: &str = "mtp.norm.weight";

pub(super) struct Mtp<B: Backend> {
    pre_fc_norm_embedding: Tensor<B>,
    pre_fc_norm_hidden: Tensor<B>,
    /// `[hidden, 2 * hidden]`, over the normed embedding then the normed hidden state.
    fc: Linear<B>,
    pub(super) layer: Layer<B>,
    norm: Tensor<B>,
}

impl<B: Backend> Mtp<B> {
    /// The checkpoint's `mtp.*` module (layer 0) of a model of width `h`.
    /// Split over ranks, its layer is split as the model's are (`shard`); the rest, which every
    /// row needs whole, is on every rank.
    pub(super) fn load(ld: &Loader<B>, ls: &LayerSpec, h: usize, shard: &Shard) -> Result<Self> {
        let layer = Layer::load(ld, ls, "mtp.layers.0", h, shard)?;
        if !matches!(layer.mixer, Mixer::Attention(_)) {
            return Err(Error::tensor("mtp.layers.0", "the MTP layer must be an attention layer"));
        }
        Ok(Mtp {
            pre_fc_norm_embedding: ld.float("mtp.pre_fc_norm_embedding.weight", &[h])?,
            pre_fc_norm_hidden: ld.float("mtp.pre_fc_norm_hidden.weight", &[h])?,
            fc: ld.linear("mtp.fc", h, 2 * h)?,
            layer,
            norm: ld.float("mtp.norm.weight", &[h])?,
        })
    }

    pub(super) fn experts(&self) -> Option<&MoeExperts<B>> {
        match &self.layer.ffn {
            Ffn::Moe(m) => m.experts.as_ref(),
            Ffn::Dense(_) | Ffn::Idle => None,
        }
    }
}

/// One sequence's part of a `Model::draft` call.
pub struct DraftInput<'a, B: Backend> {
    pub state: &'a mut SeqState<B>,
    /// The rows to feed: the model's last hidden states *before* its final norm (the residual
    /// stream after the last layer), at positions `state.mtp_len()..`, `[next.len(), hidden]`.
    /// `None` (and no `next`) where the last call fed every position the drafts need
    /// (`SeqState::mtp_ready`): the drafts chain from the output it kept.
    pub hidden: Option<&'a Tensor<B>>,
    /// The token at the position after each of those rows: the sequence's next tokens, the last
    /// one the token just sampled when the rows end at the sequence's end.
    pub next: &'a [u32],
}

/// A sequence's drafts: greedy picks of the MTP's distributions.
pub struct Draft<B: Backend> {
    /// `k` tokens, in order.
    pub tokens: Vec<u32>,
    /// `[k, vocab]`: row `j` is the distribution (logits) `tokens[j]` is the argmax of.
    pub logits: Tensor<B>,
}

/// The rows a step of the MTP runs, in batch order.
struct Step<'t, B: Backend> {
    /// The embeddings of the tokens after the rows' positions (before the MTP's norm).
    embedded: Tensor<B>,
    /// The model's hidden states after its final norm, or the MTP's own output (chained rows).
    hidden: &'t Tensor<B>,
    layout: Layout,
}

impl<B: Backend> Model<B> {
    /// Whether the checkpoint carries a multi-token-prediction layer vt runs as a draft model.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Drops the MTP layer (its weights and its KV in pools made afterwards, on every rank), for
    /// serving without speculation. States of pools made before no longer fit the model.
    pub fn drop_mtp(&mut self) {
        self.mtp = None;
        self.state_layout = super::pool::StateLayout::of(&self.backend, &self.layers, None);
        self.peers.iter_mut().for_each(Model::drop_mtp);
    }

    /// Feeds the MTP layer each sequence's rows (`DraftInput`), then drafts `k` tokens per
    /// sequence after its last fed row: the first from that row, each next one from a row at the
    /// following position reading the MTP's own output and the previous draft. Returns the
    /// drafts in the order of `seqs` (empty for `k = 0`: feeding only).
    ///
    /// Fed rows advance `mtp_len()` (they must lie within what the model has run: `mtp_len() +
    /// rows <= len()`), and the state keeps the MTP's output at the last one, so a sequence fed
    /// in one call drafts in the next without rows (`DraftInput::hidden` `None`). The chain's rows
    /// are scratch, overwritten when later rows are fed, so a sequence cut back to its accepted
    /// tokens needs nothing else. The chain writes KV up to position `mtp_len() + k - 2`: blocks
    /// are taken for it (all or none).
    pub fn draft(&self, seqs: &mut [DraftInput<'_, B>], k: usize) -> Result<Vec<Draft<B>>> {
        if self.peers.is_empty() {
            return self.draft_rank(seqs, k);
        }
        // Refused here, before any rank waits for the others in a collective.
        self.check_draft(seqs, k)?;
        self.draft_ranks(seqs, k)
    }

    /// `draft` on one rank (the whole model where it is not split).
    pub(super) fn draft_rank(&self, seqs: &mut [DraftInput<'_, B>], k: usize) -> Result<Vec<Draft<B>>> {
        let shared = self.check_draft(seqs, k)?;
        let mtp = self.mtp.as_ref().ok_or_else(|| Error::input("draft: the model has no MTP layer"))?;
        let b = &self.backend;
        let mut p = lock(&shared);
        let Some(LayerSlot::Kv { group, pool_layer }) = self.state_layout.mtp else {
            return Err(Error::input("draft: the MTP layer has no KV in the pool"));
        };
        for s in seqs.iter_mut() {
            let end = s.state.mtp_len() + s.next.len() + k.saturating_sub(1);
            s.state.grow(&mut p, end)?;
        }
        let table = self.embed_table()?;
        let mut fed: Vec<&mut DraftInput<'_, B>> = seqs.iter_mut().filter(|s| s.hidden.is_some()).collect();
        if !fed.is_empty() {
            self.feed_mtp(mtp, table, &mut fed, &mut p, group, pool_layer)?;
        }
        if k == 0 {
            return Ok(Vec::new());
        }
        // Each sequence's output at its last fed position, then k - 1 chained single rows, each
        // reading the previous row's pick where the logits are (`embed_argmax`): the picks are
        // read back once, at the end.
        let last = (seqs.iter())
            .map(|s| s.state.mtp_out.as_ref().ok_or_else(|| Error::input("draft: the MTP has no output to chain from")))
            .collect::<Result<Vec<_>>>()?;
        let mut stacked = None;
        let first = joined(b, &last, &mut stacked)?;
        let tables: Vec<Vec<u32>> = seqs.iter().map(|s| s.state.tables[group].clone()).collect();
        let (mut chained, mut logits) = (None, Vec::with_capacity(k));
        for j in 0..k {
            let out = chained.as_ref().unwrap_or(first);
            let l = self.logits(b, out)?;
            if j + 1 < k {
                // One row per sequence, in the given order (equal lengths keep it).
                let layout = Layout::new(&seqs.iter().map(|s| (1, s.state.mtp_len() + j, false)).collect::<Vec<_>>());
                let chain = Step { embedded: b.embed_argmax(table, &l)?, hidden: out, layout };
                chained = Some(self.mtp_step(mtp, &chain, &mut p, pool_layer, &tables)?);
            }
            logits.push(l);
        }
        // Row `j * n + r`: draft j of sequence r (the picks the chain embedded).
        let n = seqs.len();
        let picks = b.argmax_rows(&b.concat_rows(&logits.iter().collect::<Vec<_>>())?, None)?;
        if picks.iter().any(|p| !p.finite) {
            return Err(Error::input("draft: the MTP's logits are not finite"));
        }
        (0..n)
            .map(|r| {
                let rows = logits.iter().map(|l| b.slice_rows(l, r, 1)).collect::<Result<Vec<_>>>()?;
                Ok(Draft { tokens: (0..k).map(|j| picks[j * n + r].id).collect(), logits: stack_rows(b, rows)? })
            })
            .collect()
    }

    /// Feeds the MTP every row of `seqs` (each has `hidden`; `table` embeds their next tokens):
    /// their KV, and each state's output at its last fed position (`SeqState::mtp_out`), where its
    /// drafts chain from.
    fn feed_mtp(
        &self,
        mtp: &Mtp<B>,
        table: &Tensor<B>,
        seqs: &mut [&mut DraftInput<'_, B>],
        p: &mut PoolInner<B>,
        group: usize,
        pool_layer: usize,
    ) -> Result<()> {
        let b = &self.backend;
        // Single rows first (the attention batches them).
        let layout = Layout::new(&seqs.iter().map(|s| (s.next.len(), s.state.mtp_len(), false)).collect::<Vec<_>>());
        let order = layout.order.clone();
        // Each sequence's (first row, rows, first position), in `order`.
        let parts: Vec<(usize, usize, usize)> = (0..order.len())
            .map(|r| match r.checked_sub(layout.stepwise()) {
                None => (r, 1, layout.starts[r]),
                Some(c) => (layout.spans[c].row, layout.spans[c].len, layout.spans[c].start),
            })
            .collect();
        let hidden: Vec<&Tensor<B>> = order.iter().filter_map(|&i| seqs[i].hidden).collect();
        let mut stacked = None;
        let hidden = joined(b, &hidden, &mut stacked)?;
        // Split, the peers hand zeros (parallel.rs `draft_ranks`): the sum is rank 0's rows.
        let summed;
        let hidden = match &self.comm {
            Some(c) => {
                summed = c.all_reduce_sum(b, hidden)?;
                &summed
            }
            None => hidden,
        };
        let normed = b.rms_norm(hidden, &self.norm, self.spec.eps, self.spec.norm)?;
        let tokens: Vec<u32> = order.iter().flat_map(|&i| seqs[i].next.iter().copied()).collect();
        let step = Step { embedded: b.embedding(table, &tokens)?, hidden: &normed, layout };
        let tables: Vec<Vec<u32>> = order.iter().map(|&i| seqs[i].state.tables[group].clone()).collect();
        let out = self.mtp_step(mtp, &step, p, pool_layer, &tables)?;
        for (&i, &(row, len, start)) in order.iter().zip(&parts) {
            let s = &mut seqs[i].state;
            s.mtp_out = Some(b.slice_rows(&out, row + len - 1, 1)?);
            s.mtp_pos = start + len;
        }
        Ok(())
    }

    /// Checks `draft`'s inputs against the sequences' pool (which holds the blocks the draft
    /// takes); the pool.
    fn check_draft(&self, seqs: &[DraftInput<'_, B>], k: usize) -> Result<super::pool::Shared<B>> {
        if self.mtp.is_none() {
            return Err(Error::input("draft: the model has no MTP layer"));
        }
        let h = self.spec.hidden;
        let Some(shared) = seqs.first().map(|s| s.state.pool.clone()) else {
            return Err(Error::input("draft needs at least one sequence"));
        };
        let p = lock(&shared);
        if p.layout != self.state_layout {
            return Err(Error::input("sequence state belongs to another model"));
        }
        let mut need = vec![0; p.groups.len()];
        for s in seqs.iter() {
            let (start, rows) = (s.state.mtp_len(), s.next.len());
            if !std::sync::Arc::ptr_eq(&s.state.pool, &shared) {
                return Err(Error::input("the sequences of one draft must share a pool"));
            }
            match s.hidden {
                Some(hidden) if rows == 0 || hidden.shape() != [rows, h] => {
                    return Err(Error::input(format!(
                        "draft: {rows} next tokens need hidden states [{rows}, {h}] (at least one row), found {:?}",
                        hidden.shape()
                    )))
                }
                None if rows > 0 || k == 0 || !s.state.mtp_ready() => {
                    return Err(Error::input(
                        "draft: no rows to feed, and no output of the MTP at the sequence's end to chain from",
                    ))
                }
                _ => {}
            }
            if start + rows > s.state.pos {
                return Err(Error::input(format!(
                    "draft: the MTP has {start} of the sequence's {} positions; {rows} more rows go past them",
                    s.state.pos
                )));
            }
            if let Some(&bad) = s.next.iter().find(|&&id| id as usize >= self.spec.vocab) {
                return Err(Error::input(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    self.spec.vocab
                )));
            }
            let end = (start + rows + k.saturating_sub(1)).div_ceil(p.layout.block);
            for (n, t) in need.iter_mut().zip(&s.state.tables) {
                *n += end.saturating_sub(t.len());
            }
        }
        if let Some((g, n)) = need.iter().enumerate().find(|&(g, &n)| n > p.groups[g].free()) {
            return Err(Error::input(format!(
                "the KV pool is out of blocks: this draft needs {n} more of group {g}, {} are free",
                p.groups[g].free()
            )));
        }
        drop(p);
        Ok(shared)
    }

    /// The token embedding table the MTP's rows read.
    fn embed_table(&self) -> Result<&Tensor<B>> {
        match &self.embed.weight {
            Weight::Dense(table) => Ok(table),
            _ => Err(Error::tensor("embed_tokens", "quantized embeddings are not supported")),
        }
    }

    /// One MTP forward over `step`'s rows (each span attending through its sequence's table in
    /// `tables`, batch order); returns the MTP's output after its norm, `[rows, hidden]`.
    fn mtp_step(
        &self,
        mtp: &Mtp<B>,
        step: &Step<B>,
        p: &mut PoolInner<B>,
        pool_layer: usize,
        tables: &[Vec<u32>],
    ) -> Result<Tensor<B>> {
        let (b, h, eps, kind) = (&self.backend, self.spec.hidden, self.spec.eps, self.spec.norm);
        let Mixer::Attention(attn) = &mtp.layer.mixer else {
            return Err(Error::input("the MTP layer must be an attention layer"));
        };
        let rows = step.embedded.rows();
        let e = b.rms_norm(&step.embedded, &mtp.pre_fc_norm_embedding, eps, kind)?;
        let hn = b.rms_norm(step.hidden, &mtp.pre_fc_norm_hidden, eps, kind)?;
        // [e | hn] per row: the two stacked, then gathered row by row (a copy, exact).
        let both = b.concat_rows(&[&e, &hn])?;
        let interleave: Vec<u32> = (0..rows as u32).flat_map(|r| [r, rows as u32 + r]).collect();
        let x = b.linear(&b.embedding(&both, &interleave)?.reshape(&[rows, 2 * h])?, &mtp.fc)?;
        let l = &mtp.layer;
        let tables: Vec<&[u32]> = tables.iter().map(Vec::as_slice).collect();
        let normed = b.rms_norm(&x, &l.input_norm, eps, kind)?;
        let mixed = self.reduce(b, attn.forward(b, &normed, &step.layout, &mut p.kv, pool_layer, &tables, eps)?)?;
        let (x1, h1) = b.add_rms_norm(&x, &mixed, &l.post_norm, eps, kind)?;
        let f = self.reduce(b, l.ffn.forward(b, &h1)?)?;
        Ok(b.add_rms_norm(&x1, &f, &mtp.norm, eps, kind)?.1)
    }
}

/// `parts` as one tensor: the one part itself, or their rows stacked, kept in `held`.
fn joined<'t, B: Backend>(b: &B, parts: &[&'t Tensor<B>], held: &'t mut Option<Tensor<B>>) -> Result<&'t Tensor<B>> {
    match parts {
        &[one] => Ok(one),
        many => Ok(held.insert(b.concat_rows(many)?)),
    }
}
