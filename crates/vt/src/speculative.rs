//! Speculative decoding's drafters: what proposes tokens for the target to verify. The engine
//! asks a drafter for up to `k` tokens per decoding sequence, verifies them in one batched
//! forward (`vt_models::Model::step` with `StepSeq::verify`), accepts a prefix of them
//! (`Sampler::verify`: exact for greedy, the rejection rule for sampled requests), and tells the
//! drafter what the target kept. The output is what the target alone would produce, whatever the
//! drafter proposes; a good drafter only makes it faster.
//!
//! Two drafters come with vt: the checkpoint's multi-token-prediction layer (`MtpDrafter`, where
//! the model has one) and prompt lookup (`NgramDrafter`, any model).

mod mtp;

use vt_core::{Backend, Result, Tensor};
use vt_models::{Model, SeqState};

use crate::sampling::SamplingParams;

pub use mtp::MtpDrafter;

/// A running sequence, as the engine names it to its drafter (unique within the engine).
pub type SeqId = u64;

/// One sequence's request for drafts.
pub struct Proposal<'a, B: Backend> {
    pub seq: SeqId,
    /// The whole sequence so far, prompt and generated: the target holds all but the last token,
    /// which the verification runs first, followed by the drafts.
    pub tokens: &'a [u32],
    /// Most drafts wanted (fewer, or none, are fine).
    pub k: usize,
    pub sampling: &'a SamplingParams,
    /// The sequence's state in the target (which holds the MTP layer's KV too).
    pub state: &'a mut SeqState<B>,
}

/// What a drafter proposes for one sequence.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// For each token, the distribution over the vocabulary it was drawn from (the request's
    /// sampling parameters applied as the drafter chose); `None` when the tokens were picked
    /// deterministically (e.g. argmax), which the acceptance rule treats as a point mass.
    pub probs: Option<Vec<Vec<f32>>>,
}

/// What the target kept of one sequence in one step.
pub struct Observation<'a, B: Backend> {
    pub seq: SeqId,
    /// The whole sequence so far: its newest token not yet run by the target (or, where the
    /// sequence ends with this step, never run).
    pub tokens: &'a [u32],
    /// The target ran and kept positions `start..start + len` this step (`tokens[start..start +
    /// len]`; the token after each is `tokens[p + 1]`). Observations of a sequence follow each
    /// other, except that its first may start past 0: the positions before came from the prefix
    /// cache (computed for an earlier sequence with the same prefix), and the drafter has not
    /// seen them.
    pub start: usize,
    pub len: usize,
    /// The target's hidden states at those positions after its last layer, before the final
    /// norm, `[len, hidden]`, where the drafter `needs_hidden`.
    pub hidden: Option<Tensor<B>>,
    /// The sequence's state in the target (holding those positions).
    pub state: &'a mut SeqState<B>,
}

/// Proposes tokens for the target to verify. The engine calls, per step: `propose` for its
/// decoding sequences, then (after the verification) `observe` for every sequence the step ran,
/// those that end with it included; `fork` when a request's further choices start from its first
/// one's state, `release` when a sequence ends or is preempted (it then starts again from
/// position 0, or from the prefix cache). `model` is the target.
pub trait Drafter<B: Backend>: Send {
    /// Whether `observe` gets the target's hidden states (a multi-token-prediction layer reads
    /// them; gathering them costs a copy per step).
    fn needs_hidden(&self) -> bool {
        false
    }

    /// Up to `k` tokens to follow each proposal's sequence, in the proposals' order.
    fn propose(&mut self, model: &Model<B>, seqs: &mut [Proposal<'_, B>]) -> Result<Vec<Draft>>;

    /// What the target kept of each sequence the step ran.
    fn observe(&mut self, model: &Model<B>, seqs: &mut [Observation<'_, B>]) -> Result<()>;

    /// Sequence `child` continues from `parent`'s state (`n` choices share one prefill): the
    /// child's state is a fork of the parent's from before the parent's latest observation.
    fn fork(&mut self, model: &Model<B>, parent: SeqId, child: SeqId) -> Result<()>;

    /// Sequence `seq` ended, or starts again from nothing: forget it.
    fn release(&mut self, seq: SeqId);
}

/// Which drafter an engine speculates with (`EngineConfig::drafter`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DrafterKind {
    /// The model's multi-token-prediction layer where it has one, else prompt lookup.
    #[default]
    Auto,
    /// The model's multi-token-prediction layer (`MtpDrafter`).
    Mtp,
    /// Prompt lookup (`NgramDrafter`).
    Ngram,
}

impl DrafterKind {
    /// The drafter of this kind for `model`; an error for `Mtp` where the model has no MTP layer.
    pub fn make<B: Backend>(self, model: &Model<B>) -> Result<Box<dyn Drafter<B>>> {
        Ok(match self {
            DrafterKind::Mtp if !model.has_mtp() => {
                return Err(vt_core::Error::input(
                    "the MTP drafter: this model has no multi-token-prediction layer (mtp.* tensors)",
                ))
            }
            DrafterKind::Auto | DrafterKind::Mtp if model.has_mtp() => Box::new(MtpDrafter::default()),
            _ => Box::new(NgramDrafter::default()),
        })
    }
}

/// Prompt lookup: proposes the tokens that followed the latest earlier occurrence of the
/// sequence's last `n` tokens (the longest `n` up to `max_n` that occurs), for text that repeats
/// itself (code, quotes, edits). Needs no model: the drafter of models without an MTP layer.
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    pub max_n: usize,
    pub min_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { max_n: 4, min_n: 2 }
    }
}

impl NgramDrafter {
    /// Up to `k` tokens that followed the latest earlier occurrence of `tokens`' longest suffix.
    pub fn lookup(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if tokens.len() <= n {
                continue;
            }
            let tail = &tokens[tokens.len() - n..];
            // Latest first; the match must leave at least one token after it.
            if let Some(at) = (0..tokens.len() - n).rev().find(|&i| &tokens[i..i + n] == tail) {
                let from = at + n;
                return tokens[from..(from + k).min(tokens.len())].to_vec();
            }
        }
        Vec::new()
    }
}

impl<B: Backend> Drafter<B> for NgramDrafter {
    fn propose(&mut self, _: &Model<B>, seqs: &mut [Proposal<'_, B>]) -> Result<Vec<Draft>> {
        Ok(seqs.iter().map(|p| Draft { tokens: self.lookup(p.tokens, p.k), probs: None }).collect())
    }

    fn observe(&mut self, _: &Model<B>, _: &mut [Observation<'_, B>]) -> Result<()> {
        Ok(())
    }

    fn fork(&mut self, _: &Model<B>, _: SeqId, _: SeqId) -> Result<()> {
        Ok(())
    }

    fn release(&mut self, _: SeqId) {}
}

#[cfg(test)]
mod tests {
    use super::NgramDrafter;

    #[test]
    fn ngram_lookup_takes_the_latest_longest_match() {
        let d = NgramDrafter::default();
        // "5 6" occurs twice before the end; the latest is followed by 9 9.
        assert_eq!(d.lookup(&[5, 6, 7, 8, 5, 6, 9, 9, 1, 5, 6], 3), [9, 9, 1]);
        assert_eq!(d.lookup(&[5, 6, 7, 5, 6], 5), [7, 5, 6]);
        assert!(d.lookup(&[1, 2, 3, 4], 3).is_empty());
        assert!(d.lookup(&[1], 3).is_empty());
    }
}
