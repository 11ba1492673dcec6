//! The engine's side of speculative decoding: drafts for its decoding sequences, their
//! acceptance after the verification, settling each sequence's state to what it kept, and what
//! the drafter is told (`crate::speculative`).

use std::ops::Range;
use std::time::Instant;

use vt_core::backend::non_finite_row;
use vt_core::{Backend, Tensor};

use super::{finite_row, token_logprobs, Engine, Event, Picks, RowMasks, Running};
use crate::grammar::TokenMask;
use crate::speculative::{Draft, Observation, Proposal};

impl<B: Backend> Running<B> {
    /// Drafts this sequence may verify in a step beside its pending token: none unless it is
    /// decoding (its one pending token generated); at most `k`, and what its generation leaves
    /// (its last token is never run); and with a prefix cache (`block`), what keeps it within its
    /// block: the cache snapshots a decoding sequence at each block boundary it reaches, which a
    /// step must not jump over.
    pub(super) fn draft_room(&self, k: usize, block: Option<usize>) -> usize {
        let decoding = self.generated > 0 && self.pending().len() == 1;
        if !decoding {
            return 0;
        }
        let pos = self.state.len();
        let to_boundary = block.map_or(usize::MAX, |b| (pos / b + 1) * b - pos - 1);
        k.min(self.max_gen - self.generated - 1).min(to_boundary)
    }

    /// Takes this verifying sequence's tokens from its `rows` of `picks` (the pending token's
    /// row, then each draft's), accepting drafts while the target agrees (`Sampler::verify`),
    /// and sends them; returns how many of the verified positions it keeps, and the event that
    /// ends it, if it ends. Where it has a grammar, `masks` are its rows' (`Grammar::masks_along`;
    /// the picks on the device were made under them).
    fn pick_verified(
        &mut self,
        picks: &Picks,
        rows: Range<usize>,
        draft: &Draft,
        masks: Option<&[crate::Result<TokenMask>]>,
        vocab: usize,
    ) -> (usize, Option<Event>) {
        for (j, row) in rows.clone().enumerate() {
            let proposed = draft.tokens.get(j).copied();
            // Rows past the masks are never reached: the walk stopped at a draft rejected before.
            let mask = match masks.and_then(|m| m.get(j)) {
                Some(Err(e)) => return (j + 1, Some(Event::Failed(e.to_string()))),
                Some(Ok(m)) => Some(m),
                None => None,
            };
            let (id, accepted, logprobs) = match picks {
                Picks::Ids(picks, lps) => {
                    let pick = picks[row];
                    if !pick.finite {
                        return (j + 1, Some(Event::Failed(non_finite_row().to_string())));
                    }
                    (self.sampler.accept(pick.id), proposed == Some(pick.id), self.row_logprobs(lps, row))
                }
                Picks::Logits(logits) => {
                    let raw = match finite_row(logits, row, vocab) {
                        Ok(raw) => raw,
                        Err(e) => return (j + 1, Some(e)),
                    };
                    let masked = mask.map(|m| {
                        let mut masked = raw.to_vec();
                        m.apply(&mut masked);
                        masked
                    });
                    let target = masked.as_deref().unwrap_or(raw);
                    let (id, accepted) = match proposed {
                        Some(d) => {
                            let q = draft.probs.as_ref().and_then(|p| p.get(j)).map(Vec::as_slice);
                            let v = self.sampler.verify(target, d, q);
                            (v.token, v.accepted)
                        }
                        None => (self.sampler.sample(target), false),
                    };
                    (id, accepted, self.logprobs.map(|k| token_logprobs(raw, id, k)))
                }
            };
            if let Some(ev) = self.emit(id, logprobs) {
                return (j + 1, Some(ev));
            }
            if !accepted {
                return (j + 1, None);
            }
        }
        (rows.len(), None)
    }
}

impl<B: Backend> Engine<B> {
    /// Asks the drafter for tokens for each sequence the schedule gave more than its one pending
    /// token (`take`, which becomes one plus the drafts it got); `None` where a sequence verifies none.
    /// A drafter's error fails the sequences it was asked for (they do not run: the events).
    pub(super) fn draft(&mut self, take: &mut [usize]) -> (Vec<Option<Draft>>, Vec<Option<Event>>) {
        let (mut drafts, mut failed) = (vec![None; take.len()], vec![None; take.len()]);
        let Some(drafter) = &mut self.drafter else { return (drafts, failed) };
        // The schedule gave room beyond the pending token only to decoding sequences.
        let asked: Vec<usize> = (0..take.len()).filter(|&i| take[i] > self.running[i].pending().len()).collect();
        if asked.is_empty() {
            return (drafts, failed);
        }
        let started = Instant::now();
        let mut proposals: Vec<Proposal<'_, B>> = (self.running.iter_mut().enumerate())
            .filter(|(i, _)| asked.contains(i))
            .map(|(i, s)| Proposal {
                seq: s.id,
                tokens: &s.tokens,
                k: take[i] - 1,
                sampling: s.sampler.params(),
                state: &mut s.state,
            })
            .collect();
        let proposed = drafter.propose(&self.model, &mut proposals);
        drop(proposals);
        self.draft_time += started.elapsed();
        match proposed {
            Ok(got) => {
                for (&i, mut d) in asked.iter().zip(got) {
                    d.tokens.truncate(take[i] - 1);
                    if let Some(g) = &mut self.running[i].grammar {
                        match g.allowed_prefix(&d.tokens) {
                            // Drafts after the first the grammar forbids never run. That one is
                            // rejected at its row; one drawn from a distribution still goes there,
                            // where its rejection draws from the residual of p and q.
                            Ok(n) => d.tokens.truncate(n + usize::from(d.probs.is_some())),
                            Err(e) => {
                                take[i] = 0;
                                failed[i] = Some(Event::Failed(e.to_string()));
                                continue;
                            }
                        }
                    }
                    take[i] = 1 + d.tokens.len();
                    drafts[i] = (!d.tokens.is_empty()).then_some(d);
                }
                // A drafter that answered fewer proposals than asked drafted nothing for the rest.
                let rest = asked.iter().filter(|&&i| drafts[i].is_none() && failed[i].is_none());
                rest.for_each(|&i| take[i] = 1);
            }
            Err(e) => {
                for &i in &asked {
                    take[i] = 0;
                    failed[i] = Some(Event::Failed(format!("the drafter failed: {e}")));
                }
            }
        }
        (drafts, failed)
    }

    /// Picks the tokens of every verifying sequence (`drafts`, under its grammar's `masks`),
    /// then settles their states to the positions each keeps; returns, for every running
    /// sequence, the positions the step kept of it where it verified (`None` elsewhere). Events
    /// that end a sequence go to `events`.
    pub(super) fn accept_drafts(
        &mut self,
        picks: &Picks,
        rows: &[Range<usize>],
        drafts: &[Option<Draft>],
        masks: &[Option<RowMasks>],
        events: &mut [Option<Event>],
    ) -> Vec<Option<usize>> {
        let vocab = self.limits.spec.vocab;
        let mut kept = vec![None; self.running.len()];
        for (i, s) in self.running.iter_mut().enumerate() {
            if let Some(d) = &drafts[i] {
                let (keep, ev) = s.pick_verified(picks, rows[i].clone(), d, masks[i].as_deref(), vocab);
                self.drafted += d.tokens.len() as u64;
                self.accepted += keep as u64 - 1;
                kept[i] = Some(keep);
                events[i] = ev;
            }
        }
        let mut settle: Vec<(&mut vt_models::SeqState<B>, usize)> =
            (self.running.iter_mut().zip(&kept)).filter_map(|(s, k)| k.map(|k| (&mut s.state, k))).collect();
        let started = Instant::now();
        let settled = self.model.settle(&mut settle);
        drop(settle);
        self.settle_time += started.elapsed();
        if let Err(e) = settled {
            for (ev, k) in events.iter_mut().zip(&kept) {
                if k.is_some() {
                    *ev = Some(Event::Failed(e.to_string()));
                }
            }
        }
        kept
    }

    /// Tells the drafter what the target kept of each sequence the step ran whose state is intact
    /// (those that end with this step too: the prefix cache may keep their blocks): `take` tokens,
    /// or `kept` of a verification, with their hidden states where it reads them. A drafter's
    /// error fails the sequences it was told about that go on.
    pub(super) fn observe(
        &mut self,
        take: &[usize],
        kept: &[Option<usize>],
        hidden: Option<Tensor<B>>,
        events: &mut [Option<Event>],
    ) {
        let Some(drafter) = &mut self.drafter else { return };
        let started = Instant::now();
        let b = self.model.backend();
        // The hidden rows: each sequence that ran, all the tokens it ran, in order.
        let mut row = 0;
        let mut seen = Vec::new();
        let mut told = Vec::new();
        for (i, s) in self.running.iter_mut().enumerate() {
            if take[i] == 0 {
                continue;
            }
            let len = kept[i].unwrap_or(take[i]);
            let from = row;
            row += take[i];
            if matches!(events[i], Some(Event::Failed(_))) {
                continue;
            }
            let rows = match &hidden {
                Some(h) => match b.slice_rows(h, from, len) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        events[i] = Some(Event::Failed(e.to_string()));
                        continue;
                    }
                },
                None => None,
            };
            let start = s.state.len() - len;
            seen.push(Observation { seq: s.id, tokens: &s.tokens, start, len, hidden: rows, state: &mut s.state });
            told.push(i);
        }
        let observed = drafter.observe(&self.model, &mut seen);
        drop(seen);
        self.draft_time += started.elapsed();
        if let Err(e) = observed {
            let failed = Event::Failed(format!("the drafter failed: {e}"));
            for i in told {
                events[i].get_or_insert_with(|| failed.clone());
            }
        }
    }
}
