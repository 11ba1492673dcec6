//! The engine: many sequences at once. Requests join the running batch between steps
//! (continuous batching); each step runs every decoding sequence's next token plus chunks of
//! prompts (chunked prefill) within a token limit, through one batched forward.
//!
//! Sequence state lives in one pool per engine (`vt_models::StatePool`): KV blocks, taken as
//! positions arrive, and a linear-attention slot per sequence. Each step schedules by free blocks:
//! running sequences first, oldest first, decodes before prompt chunks; when the pool runs out, the
//! newest sequences are preempted (their blocks freed, their tokens recomputed later as a prompt,
//! invisibly to their clients), and waiting requests start only while the pool has room for their
//! prompt. A request that could never fit the pool, even alone, is refused at submission with the
//! sizes; any other waits.

mod speculate;

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use rayon::prelude::*;
use vt_core::backend::{mask_words, non_finite_row, Pick};
use vt_core::{Backend, Error};
use vt_models::{Model, ModelSpec, PoolConfig, PoolShape, PoolStats, SeqState, StatePool, StepSeq};

use crate::grammar::{Grammar, TokenMask};
use crate::prefix_cache::{PrefixCache, SeqPrefix};
pub use crate::prefix_index::PrefixStats;
use crate::sampling::{token_logprobs, Sampler, SamplingParams, TokenLogprobs};
use crate::speculative::{Drafter, DrafterKind, SeqId};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most tokens one step runs (decodes plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Most requests waiting for a free sequence slot, beyond those running; more are refused
    /// with `SubmitError::QueueFull`.
    pub max_queue: usize,
    /// Bytes of the sequence-state pool (KV blocks and linear-attention states). `None`: on a
    /// device with its own memory, `gpu_memory_utilization` of it less what is in use when the
    /// engine starts (weights, workspace); on the host, enough for `max_seqs` sequences of
    /// `max_context` tokens (host blocks are taken as they are first written).
    pub memory_budget: Option<usize>,
    /// Fraction of the device's memory the process may use, pool included (`memory_budget: None`).
    pub gpu_memory_utilization: f64,
    /// Longest sequence, prompt plus generated tokens (the checkpoint's `max_position_embeddings`).
    pub max_context: usize,
    /// Keep finished prefixes' KV blocks and linear-attention snapshots for later prompts that
    /// start with them (`prefix_cache.rs`); models with sliding-window layers cache nothing.
    pub prefix_cache: bool,
    /// Speculative decoding: tokens a drafter proposes per decode step, verified in one forward
    /// (0: off). The drafter is `Engine::set_drafter`'s, else `drafter`'s.
    pub speculative_tokens: usize,
    /// Which drafter speculates: by default the model's MTP layer where it has one, else prompt
    /// lookup.
    pub drafter: DrafterKind,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch_tokens: 512,
            max_seqs: 32,
            max_queue: 256,
            memory_budget: None,
            gpu_memory_utilization: 0.9,
            max_context: 4096,
            prefix_cache: true,
            speculative_tokens: 0,
            drafter: DrafterKind::Auto,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Most tokens to generate (fewer if the context ends first).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Finish after generating one of these (it is sent, then `Finish::Stop`).
    pub stop_token_ids: Vec<u32>,
    /// Only tokens this grammar allows are generated.
    pub grammar: Option<Grammar>,
    /// Send each token's log-probability and this many most likely alternatives
    /// (`Event::Logprobs`, before its `Event::Token`).
    pub logprobs: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    Cancelled,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The log-probabilities of the token sent next (when the request asked for them).
    Logprobs(TokenLogprobs),
    Token(u32),
    Done(Finish),
    /// The step that ran this sequence failed; nothing more comes.
    Failed(String),
}

/// Where a sequence's events go. Returning `false` (the receiver is gone) cancels the sequence.
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

#[derive(Debug)]
pub enum SubmitError {
    /// The request can never run (bad ids, too long, larger than the pool...).
    Invalid(Error),
    /// Too many requests are waiting; try again later.
    QueueFull,
    /// The engine has stopped.
    Closed,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::Invalid(e) => write!(f, "{e}"),
            SubmitError::QueueFull => write!(f, "too many requests are waiting; try again later"),
            SubmitError::Closed => write!(f, "the engine has stopped"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Cancels one request: it finishes with `Finish::Cancelled` at the next step.
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// What admission needs to know, copied out of the model so a handle can check requests
/// without reaching into the engine thread.
#[derive(Clone)]
struct Limits {
    spec: ModelSpec,
    pool: PoolShape,
    config: EngineConfig,
}

impl Limits {
    /// How many submitted requests not yet started the queue may hold while `running` sequences
    /// run: those that will start in free slots, plus `max_queue` waiting beyond them.
    fn waiting_room(&self, running: usize) -> usize {
        self.config.max_queue + self.config.max_seqs.max(1).saturating_sub(running)
    }

    /// A checked request with one choice per sink, choice `i` sampling with seed `seed + i`.
    fn waiting(&self, req: Request, sinks: Vec<Sink>) -> Result<(Waiting, Vec<CancelToken>), SubmitError> {
        let max_gen = self.admit(&req)?;
        if sinks.is_empty() || sinks.len() > self.config.max_seqs {
            return Err(SubmitError::Invalid(Error::input(format!(
                "{} choices: a request has from 1 to max_seqs ({}) choices",
                sinks.len(),
                self.config.max_seqs
            ))));
        }
        let cancels: Vec<CancelToken> = sinks.iter().map(|_| CancelToken::default()).collect();
        let mut sinks = sinks.into_iter().zip(cancels.iter().cloned());
        let (sink, cancel) = sinks.next().expect("a choice");
        let forks = (sinks.enumerate())
            .map(|(i, (sink, cancel))| {
                let mut sampling = req.sampling.clone();
                sampling.seed = sampling.seed.wrapping_add(i as u64 + 1);
                let sampler = Sampler::new(sampling, &req.prompt).map_err(SubmitError::Invalid)?;
                Ok(Fork { sink, cancel, sampler })
            })
            .collect::<Result<Vec<_>, SubmitError>>()?;
        Ok((Waiting { req, sink, cancel, max_gen, forks }, cancels))
    }

    /// Checks a request; returns the tokens it may generate.
    fn admit(&self, req: &Request) -> Result<usize, SubmitError> {
        let invalid = |m: String| Err(SubmitError::Invalid(Error::input(m)));
        let ctx = self.config.max_context;
        if req.prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if let Some(bad) = req.prompt.iter().find(|&&id| id as usize >= self.spec.vocab) {
            return invalid(format!("token id {bad} is outside the vocabulary (size {})", self.spec.vocab));
        }
        if req.prompt.len() >= ctx {
            return invalid(format!("the prompt has {} tokens; this model's context limit is {ctx} tokens (prompt plus at least one generated)", req.prompt.len()));
        }
        if req.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        req.sampling.validate().map_err(SubmitError::Invalid)?;
        let gen = req.max_tokens.min(ctx - req.prompt.len());
        // The last generated token is never run: the sequence holds prompt + gen - 1 positions.
        self.pool.check_fits(req.prompt.len() + gen - 1, self.config.max_batch_tokens).map_err(SubmitError::Invalid)?;
        Ok(gen)
    }
}

struct Waiting {
    req: Request,
    sink: Sink,
    cancel: CancelToken,
    max_gen: usize,
    /// The request's further choices.
    forks: Vec<Fork>,
}

/// A further choice of a request (`n > 1`): it shares the first choice's prefill, forking from
/// it when the prompt has run (the pool shares the blocks and copies the linear-attention state),
/// and samples with its own seed. A choice cancelled before the fork just ends; the first
/// choice's cancellation before it cancels them all.
struct Fork {
    sink: Sink,
    cancel: CancelToken,
    sampler: Sampler,
}

struct Running<B: Backend> {
    /// Its name to the drafter.
    id: SeqId,
    sink: Sink,
    cancel: CancelToken,
    state: SeqState<B>,
    sampler: Sampler,
    /// The prompt and every token generated so far; those past `state.len()` run next (the rest
    /// of the prompt, or the last generated token; all of them after a preemption).
    tokens: Vec<u32>,
    stop_token_ids: Vec<u32>,
    grammar: Option<Grammar>,
    logprobs: Option<usize>,
    generated: usize,
    max_gen: usize,
    /// Its part in the prefix cache.
    prefix: SeqPrefix,
    /// Further choices of its request, until its prompt has run.
    forks: Vec<Fork>,
}

impl<B: Backend> Running<B> {
    /// Tokens not yet in the state.
    fn pending(&self) -> &[u32] {
        &self.tokens[self.state.len()..]
    }

    /// Takes this sequence's next token from entry `row` of `picks` (its pick, or its logits
    /// row masked by `mask` where it has a grammar) and sends it; returns the event that ends
    /// the sequence, if it ends.
    fn pick(
        &mut self,
        picks: &Picks,
        row: usize,
        mask: Option<crate::Result<TokenMask>>,
        vocab: usize,
    ) -> Option<Event> {
        let (id, logprobs) = match picks {
            Picks::Ids(picks, lps) => {
                let pick = picks[row];
                match mask {
                    _ if !pick.finite => return Some(Event::Failed(non_finite_row().to_string())),
                    Some(Err(e)) => return Some(Event::Failed(e.to_string())),
                    _ => {}
                }
                (self.sampler.accept(pick.id), self.row_logprobs(lps, row))
            }
            Picks::Logits(logits) => {
                let raw = match finite_row(logits, row, vocab) {
                    Ok(raw) => raw,
                    Err(e) => return Some(e),
                };
                let id = match mask {
                    None => self.sampler.sample(raw),
                    Some(Ok(mask)) => {
                        let mut masked = raw.to_vec();
                        mask.apply(&mut masked);
                        self.sampler.sample(&masked)
                    }
                    Some(Err(e)) => {
                        return Some(Event::Failed(e.to_string()));
                    }
                };
                (id, self.logprobs.map(|k| token_logprobs(raw, id, k)))
            }
        };
        self.emit(id, logprobs)
    }

    /// The logprobs of row `row` of a greedy step's, as many alternatives as this sequence asks.
    fn row_logprobs(&self, lps: &Option<Vec<TokenLogprobs>>, row: usize) -> Option<TokenLogprobs> {
        self.logprobs.zip(lps.as_ref()).map(|(k, lps)| {
            let mut lp = lps[row].clone();
            lp.top.truncate(k);
            lp
        })
    }

    /// Sends `id` (chosen and recorded by the sampler) with its logprobs; returns the event that
    /// ends the sequence, if it ends.
    fn emit(&mut self, id: u32, logprobs: Option<TokenLogprobs>) -> Option<Event> {
        if let Some(Err(e)) = self.grammar.as_mut().map(|g| g.accept(id)) {
            return Some(Event::Failed(e.to_string()));
        }
        self.generated += 1;
        let sent = logprobs.is_none_or(|lp| (self.sink)(Event::Logprobs(lp)));
        let end = if !sent || !(self.sink)(Event::Token(id)) {
            Some(Event::Done(Finish::Cancelled))
        } else if self.stop_token_ids.contains(&id) {
            Some(Event::Done(Finish::Stop))
        } else if self.generated >= self.max_gen {
            Some(Event::Done(Finish::Length))
        } else {
            None
        };
        // Kept even where it ends the sequence: the drafter reads it after the last position.
        self.tokens.push(id);
        end
    }

    /// A further choice of this request, starting from `state` (a fork of this one's).
    fn fork(&self, f: Fork, state: SeqState<B>, id: SeqId) -> Running<B> {
        Running {
            id,
            sink: f.sink,
            cancel: f.cancel,
            state,
            sampler: f.sampler,
            tokens: self.tokens.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            grammar: self.grammar.clone(),
            logprobs: self.logprobs,
            generated: 0,
            max_gen: self.max_gen,
            prefix: self.prefix.fork(),
            forks: Vec::new(),
        }
    }
}

/// Row `row` of `logits` (`[rows, vocab]`), or the event that fails a sequence whose row is not
/// finite.
fn finite_row(logits: &[f32], row: usize, vocab: usize) -> Result<&[f32], Event> {
    let raw = &logits[row * vocab..(row + 1) * vocab];
    vt_core::backend::check_finite(raw).map(|()| raw).map_err(|e| Event::Failed(e.to_string()))
}

/// A sequence's grammar masks of its rows in a step, in order (`Grammar::masks_along`): one
/// where it picks one token; where it verifies drafts, as many as the walk through them got
/// (rows past them are never picked from).
type RowMasks = Vec<crate::Result<TokenMask>>;

/// What a step reads back to choose its tokens: one per logits row (then, where sampled, one per
/// further choice forking off in this step: `sample_picks`), or the rows themselves.
enum Picks {
    /// Picks made where the logits are (under the grammars' masks), with their logprobs when a
    /// sequence asks for them.
    Ids(Vec<Pick>, Option<Vec<TokenLogprobs>>),
    Logits(Vec<f32>),
}

/// The engine's core, driven by `step`. `EngineHandle` runs one on its own thread.
pub struct Engine<B: Backend> {
    model: Model<B>,
    limits: Limits,
    waiting: VecDeque<Waiting>,
    /// In the order they started: the earlier, the higher their priority for blocks.
    running: Vec<Running<B>>,
    /// Every sequence's state lives here.
    pool: StatePool<B>,
    /// States of finished sequences, emptied (`Model::reset_state`: no blocks) for later requests:
    /// each keeps its linear-attention slot and its recorded decode step, so the request that
    /// takes it allocates and records nothing. At most `max_seqs` with the running ones.
    spare: Vec<SeqState<B>>,
    /// Prefixes of earlier sequences, where the config and the model allow.
    prefix: Option<PrefixCache>,
    /// Proposes tokens to verify, where `speculative_tokens` > 0.
    drafter: Option<Box<dyn Drafter<B>>>,
    /// The next sequence's `SeqId`.
    next_seq: SeqId,
    /// Drafts verified and accepted so far.
    drafted: u64,
    accepted: u64,
    /// Time spent in the drafter so far, and in settling verified states (`Model::settle`).
    draft_time: Duration,
    settle_time: Duration,
    /// What a handle reads of this engine between steps.
    shared: Arc<Shared>,
}

/// An engine's counts, published for its handle (queue bound, metrics).
#[derive(Default)]
struct Shared {
    /// Requests taken from the queue; a handle's waiting count goes down by this much.
    admitted: AtomicUsize,
    /// Sequences running.
    running: AtomicUsize,
    /// KV blocks in use and in the pool.
    blocks_used: AtomicUsize,
    blocks_total: AtomicUsize,
    /// Sequences preempted so far.
    preemptions: AtomicUsize,
    /// The prefix cache's counts (`PrefixStats`) and blocks.
    prefix_lookups: AtomicU64,
    prefix_hits: AtomicU64,
    prefix_prompt_tokens: AtomicU64,
    prefix_hit_tokens: AtomicU64,
    prefix_blocks: AtomicUsize,
}

impl<B: Backend> Engine<B> {
    /// An engine over `model`, with its state pool sized by `config` (an error when the pool
    /// cannot hold one sequence of two tokens).
    pub fn new(model: Model<B>, mut config: EngineConfig) -> vt_core::Result<Self> {
        // A step must be able to make progress.
        config.max_batch_tokens = config.max_batch_tokens.max(1);
        config.max_seqs = config.max_seqs.max(1);
        // The pool for `max_seqs` sequences of the longest context; its bytes are the host's default.
        // Beside them, spare linear-attention slots for the prefix cache's snapshots: one per
        // running sequence (its latest while it decodes), and as many again cached.
        let snapshots = if config.prefix_cache { 2 * config.max_seqs } else { 0 };
        let sized = model.pool_config(config.max_seqs, config.max_context, config.max_batch_tokens);
        // Speculative decoding: a slot per sequence for its state before a verification, which a
        // budget holds with the sequences (verify.rs in vt-models).
        let verify_slots = if config.speculative_tokens > 0 { config.max_seqs } else { 0 };
        let verify_bytes = model.pool_config(verify_slots, 0, config.max_batch_tokens).bytes;
        let sized = PoolConfig { bytes: sized.bytes + verify_bytes, ..sized };
        let slot_bytes = model.pool_config(1, 0, config.max_batch_tokens).bytes.max(1);
        // A budget given in bytes holds the sequences first; snapshots get what it leaves.
        let snapshots = match config.memory_budget {
            Some(bytes) => snapshots.min(bytes.saturating_sub(sized.bytes) / slot_bytes),
            None => snapshots,
        };
        let snapshot_bytes = model.pool_config(snapshots, 0, config.max_batch_tokens).bytes;
        let sized = PoolConfig { bytes: sized.bytes + snapshot_bytes, snapshots: snapshots + verify_slots, ..sized };
        let bytes = match config.memory_budget {
            Some(bytes) => bytes,
            None => match model.backend().device_memory()? {
                Some((free, total)) => {
                    let allowed = (total as f64 * config.gpu_memory_utilization.clamp(0.0, 1.0)) as usize;
                    allowed.checked_sub(total - free).ok_or_else(|| {
                        Error::input(format!(
                            "{} bytes of the device's {total} are in use, over the {} allowed \
                             (gpu memory utilization {}): no room for the KV pool",
                            total - free,
                            allowed,
                            config.gpu_memory_utilization
                        ))
                    })?
                }
                None => sized.bytes,
            },
        };
        let pool = model.new_pool(&PoolConfig { bytes, ..sized })?;
        let prefix = if config.prefix_cache { PrefixCache::new(&pool, snapshots) } else { None };
        let limits = Limits { spec: model.spec().clone(), pool: pool.shape(), config };
        limits.pool.check_fits(2, limits.config.max_batch_tokens)?;
        let drafter = match limits.config.speculative_tokens {
            0 => None,
            _ => Some(limits.config.drafter.make(&model)?),
        };
        let engine = Engine {
            model,
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pool,
            spare: Vec::new(),
            prefix,
            drafter,
            next_seq: 0,
            drafted: 0,
            accepted: 0,
            draft_time: Duration::ZERO,
            settle_time: Duration::ZERO,
            shared: Arc::default(),
        };
        engine.publish();
        Ok(engine)
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// Queues a request; its events go to `sink` as steps run.
    pub fn add(&mut self, req: Request, sink: Sink) -> Result<CancelToken, SubmitError> {
        self.add_choices(req, vec![sink]).map(|mut c| c.remove(0))
    }

    /// Queues a request of one choice per sink (`n`), which share its prefill; choice `i`
    /// samples with seed `req.sampling.seed + i`.
    pub fn add_choices(&mut self, req: Request, sinks: Vec<Sink>) -> Result<Vec<CancelToken>, SubmitError> {
        if self.waiting.len() >= self.limits.waiting_room(self.running.len()) {
            return Err(SubmitError::QueueFull);
        }
        let (w, cancels) = self.limits.waiting(req, sinks)?;
        self.waiting.push_back(w);
        Ok(cancels)
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Sequences running now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// States of finished sequences kept for later requests (at most as many as ran at once).
    pub fn kept_states(&self) -> usize {
        self.spare.len()
    }

    /// The pool's blocks and slots in use and in all.
    /// The pool's block groups and their sizes.
    pub fn pool_shape(&self) -> &PoolShape {
        &self.limits.pool
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Sequences preempted so far (their blocks freed, their tokens recomputed).
    pub fn preemptions(&self) -> usize {
        self.shared.preemptions.load(Ordering::Relaxed)
    }

    /// The prefix cache's counts so far (zeros when it is off).
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix.as_ref().map(PrefixCache::stats).unwrap_or_default()
    }

    /// Drafts verified and accepted so far (speculative decoding).
    pub fn speculation_stats(&self) -> (u64, u64) {
        (self.drafted, self.accepted)
    }

    /// Time the drafter took so far (proposing, and following what the target kept: for the MTP
    /// drafter, every run of the MTP layer).
    pub fn draft_time(&self) -> Duration {
        self.draft_time
    }

    /// Time spent so far settling verified sequences to the positions they kept (the linear
    /// attention's rollback: `vt_models::Model::settle`), as the host sees it.
    pub fn settle_time(&self) -> Duration {
        self.settle_time
    }

    /// Proposes the drafts from now on (`EngineConfig::speculative_tokens` says how many per
    /// step; with 0 none are asked for).
    pub fn set_drafter(&mut self, drafter: Box<dyn Drafter<B>>) {
        self.drafter = Some(drafter);
    }

    /// KV blocks the prefix cache holds.
    pub fn cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::blocks)
    }

    /// One batched forward over the running sequences (admitting waiting ones first), verifying
    /// drafts where speculative decoding is on. Returns the number of tokens it ran.
    pub fn step(&mut self) -> usize {
        self.drop_cancelled();
        let mut take = self.schedule();
        let (drafts, mut failed) = self.draft(&mut take);
        // A sequence needs a token when this step ends its pending tokens. The tokens are picked
        // where the logits are (a grammar's mask goes to the device) and only they are read back:
        // greedy ones by `argmax_rows` when all are greedy, else each by `sample_rows`. A
        // verification of a sequence that samples or penalises reads its rows back instead (its
        // later rows' penalties depend on the drafts it accepts before them).
        let needs: Vec<bool> = (self.running.iter().zip(&take).zip(&drafts))
            .map(|((s, &n), d)| n > 0 && (d.is_some() || n == s.pending().len()))
            .collect();
        let greedy = (self.running.iter().zip(&needs)).all(|(s, &need)| !need || s.sampler.is_greedy());
        let host = (self.running.iter().zip(&drafts)).any(|(s, d)| d.is_some() && !s.sampler.is_greedy());
        // Picks' logprobs are computed where the logits are, for the most any sequence asks.
        let top_k = (self.running.iter().zip(&needs)).filter(|(_, &need)| need).filter_map(|(s, _)| s.logprobs).max();
        // A verification runs the pending token, then the drafts.
        let verify_ids: Vec<Option<Vec<u32>>> = (self.running.iter().zip(&drafts))
            .map(|(s, d)| d.as_ref().map(|d| [s.pending(), &d.tokens].concat()))
            .collect();
        let mut batch: Vec<StepSeq<'_, B>> = (self.running.iter_mut().zip(&take).zip(&verify_ids))
            .filter(|((_, &n), _)| n > 0)
            .map(|((s, &n), v)| {
                let at = s.state.len();
                match v {
                    Some(ids) => StepSeq { ids, state: &mut s.state, verify: true },
                    None => StepSeq { ids: &s.tokens[at..at + n], state: &mut s.state, verify: false },
                }
            })
            .collect();
        if batch.is_empty() {
            drop(batch);
            self.finish_where(true, |_, i| failed[i].take());
            return 0;
        }
        // The forward is launched (a device backend runs it asynchronously); while it runs, the
        // grammars work out their masks on the CPU, across host threads: a batch of constrained
        // sequences costs about one sequence's masks' time (one per row it verifies, in turn).
        let hidden = self.drafter.as_ref().is_some_and(|d| d.needs_hidden());
        let out = self.model.step(&mut batch, hidden);
        drop(batch);
        let mut grammars: Vec<Option<(&mut Grammar, &[u32])>> = (self.running.iter_mut().zip(&needs).zip(&drafts))
            .map(|((s, &need), d)| {
                let drafted = d.as_ref().map_or(&[][..], |d| &d.tokens);
                s.grammar.as_mut().filter(|_| need).map(|g| (g, drafted))
            })
            .collect();
        let mut masks: Vec<Option<RowMasks>> =
            grammars.par_iter_mut().map(|g| g.as_mut().map(|(g, d)| g.masks_along(d))).collect();
        drop(grammars);
        let backend = self.model.backend();
        let vocab = self.limits.spec.vocab;
        // Where each sequence's further choices' own picks start, when they have them (sampled).
        let mut fork_at: Option<Vec<usize>> = None;
        let picks = out.and_then(|out| {
            let l = &out.logits;
            // Each running sequence's rows of the logits (none where it did not run).
            let mut at = out.rows.into_iter();
            let rows: Vec<Range<usize>> =
                take.iter().map(|&n| if n > 0 { at.next().unwrap_or(0..0) } else { 0..0 }).collect();
            let picks = if greedy {
                let allowed = allowed_bits(rows.iter().map(Range::len), &masks, vocab);
                let picks = backend.argmax_rows(l, allowed.as_deref())?;
                let logprobs = match top_k {
                    Some(k) => {
                        let ids: Vec<u32> = picks.iter().map(|p| p.id).collect();
                        Some(backend.top_logprobs_rows(l, &ids, k)?)
                    }
                    None => None,
                };
                Picks::Ids(picks, logprobs)
            } else if host {
                Picks::Logits(backend.to_f32(l)?)
            } else {
                let words = mask_rows(&masks, vocab);
                let (list, at) = sample_picks(&mut self.running, &needs, &rows, l.rows(), &words);
                fork_at = Some(at);
                let sampled = backend.sample_rows(l, &list, top_k)?;
                Picks::Ids(sampled.picks, sampled.logprobs)
            };
            Ok((picks, rows, out.hidden))
        });
        let ran = take.iter().sum();
        let (picks, rows, hidden) = match picks {
            Ok(p) => p,
            Err(e) => {
                // The states of every sequence in the batch are now unusable.
                let msg = e.to_string();
                let mut fail =
                    |i: usize| failed[i].take().or_else(|| (take[i] > 0).then(|| Event::Failed(msg.clone())));
                self.finish_where(false, |_, i| fail(i));
                return ran;
            }
        };
        let mut events: Vec<Option<Event>> = failed;
        // Verifications first: their tokens, then what each keeps.
        let kept = self.accept_drafts(&picks, &rows, &drafts, &masks, &mut events);
        let mut forked = Vec::new();
        for (i, s) in self.running.iter_mut().enumerate() {
            if take[i] == 0 || events[i].is_some() {
                continue;
            }
            if let Some(cache) = &mut self.prefix {
                if let Err(e) = cache.after_step(&self.pool, &s.state, &s.tokens, &mut s.prefix) {
                    events[i] = Some(Event::Failed(e.to_string()));
                    continue;
                }
            }
            if drafts[i].is_some() || !s.pending().is_empty() {
                continue; // verified above, or mid-prompt: this chunk's logits are not needed
            }
            let row = rows[i].start;
            // The request's further choices fork off here and take this row too (their own picks
            // of it where they sample); they copy the grammar before this choice's token moves it.
            for (j, f) in std::mem::take(&mut s.forks).into_iter().enumerate() {
                if f.cancel.is_cancelled() {
                    let mut sink = f.sink;
                    sink(Event::Done(Finish::Cancelled));
                    continue;
                }
                let child = self.spare.pop().map_or_else(|| self.pool.new_state(), Ok).and_then(|mut state| {
                    self.pool.fork_into(&s.state, &mut state)?;
                    Ok(state)
                });
                match child {
                    Ok(state) => {
                        self.next_seq += 1;
                        let pick = fork_at.as_ref().map_or(row, |at| at[i] + j);
                        forked.push((s.fork(f, state, self.next_seq - 1), s.id, pick));
                    }
                    Err(e) => {
                        let mut sink = f.sink;
                        sink(Event::Failed(e.to_string()));
                    }
                }
            }
            let mask = masks[i].take().and_then(|m| m.into_iter().next());
            events[i] = s.pick(&picks, row, mask, vocab);
        }
        self.observe(&take, &kept, hidden, &mut events);
        for (mut child, parent, r) in forked {
            let forked = self.drafter.as_mut().map_or(Ok(()), |d| d.fork(&self.model, parent, child.id));
            // Picks on the device were made under the first choice's mask, which a fork's is.
            let mask = match picks {
                Picks::Ids(..) => None,
                Picks::Logits(_) => child.grammar.as_mut().map(|g| g.mask()),
            };
            events.push(match forked {
                Ok(()) => child.pick(&picks, r, mask, vocab),
                Err(e) => Some(Event::Failed(format!("the drafter failed: {e}"))),
            });
            self.running.push(child);
        }
        self.finish_where(true, |_, i| events[i].take());
        ran
    }

    /// Removes the running sequences for which `done` gives an event, sending it; their states
    /// are kept for later requests when `reuse` (they are intact) and they empty without error.
    fn finish_where(&mut self, reuse: bool, mut done: impl FnMut(&Running<B>, usize) -> Option<Event>) {
        let mut kept = Vec::with_capacity(self.running.len());
        for (i, mut s) in std::mem::take(&mut self.running).into_iter().enumerate() {
            match done(&s, i) {
                Some(ev) => {
                    for mut f in s.forks.drain(..) {
                        (f.sink)(ev.clone());
                    }
                    (s.sink)(ev);
                    if let Some(d) = &mut self.drafter {
                        d.release(s.id);
                    }
                    if let Some(cache) = &mut self.prefix {
                        // An intact state's latest snapshot is cached; a failed one's is not.
                        if !reuse || cache.finish(&self.pool, &s.state, &s.tokens, &mut s.prefix).is_err() {
                            cache.forget(&self.pool, &mut s.prefix);
                        }
                    }
                    if reuse && self.model.reset_state(&mut s.state).is_ok() {
                        self.spare.push(s.state);
                    }
                }
                None => kept.push(s),
            }
        }
        self.running = kept;
        self.publish();
    }

    fn publish(&self) {
        let stats = self.pool.stats();
        self.shared.running.store(self.running.len(), Ordering::Relaxed);
        self.shared.blocks_used.store(stats.blocks_used, Ordering::Relaxed);
        self.shared.blocks_total.store(stats.blocks_total, Ordering::Relaxed);
        let p = self.prefix_stats();
        let sh = &self.shared;
        sh.prefix_lookups.store(p.lookups, Ordering::Relaxed);
        sh.prefix_hits.store(p.hits, Ordering::Relaxed);
        sh.prefix_prompt_tokens.store(p.prompt_tokens, Ordering::Relaxed);
        sh.prefix_hit_tokens.store(p.hit_tokens, Ordering::Relaxed);
        sh.prefix_blocks.store(self.cached_blocks(), Ordering::Relaxed);
    }

    fn drop_cancelled(&mut self) {
        self.finish_where(true, |s, _| s.cancel.is_cancelled().then_some(Event::Done(Finish::Cancelled)));
        let before = self.waiting.len();
        self.waiting.retain_mut(|w| {
            let cancelled = w.cancel.is_cancelled();
            if cancelled {
                for f in &mut w.forks {
                    (f.sink)(Event::Done(Finish::Cancelled));
                }
                (w.sink)(Event::Done(Finish::Cancelled));
            }
            !cancelled
        });
        self.shared.admitted.fetch_add(before - self.waiting.len(), Ordering::Relaxed);
    }

    /// How many tokens each running sequence runs this step (starting waiting requests as the
    /// pool allows): decodes first, then prompt chunks, within the step's token limit and the
    /// pool's free blocks. A sequence short of blocks preempts the newest sequences that hold
    /// some; with none left to preempt it runs what fits (perhaps nothing) and waits.
    fn schedule(&mut self) -> Vec<usize> {
        let mut budget = self.limits.config.max_batch_tokens;
        let mut free = self.pool.free_blocks();
        let mut take = vec![0; self.running.len()];
        let mut failed: Vec<Option<Event>> = vec![None; self.running.len()];
        let mut preempted = false;
        let speculative = if self.drafter.is_some() { self.limits.config.speculative_tokens } else { 0 };
        let snapshot_block = self.prefix.as_ref().map(PrefixCache::block_size);
        for i in vt_models::decode_first(self.running.iter().map(|s| s.pending().len())) {
            let s = &mut self.running[i];
            if let (true, Some(cache)) = (s.state.is_empty(), &mut self.prefix) {
                // Preempted: it starts again, from what the cache has of it.
                match cache.start(&self.pool, &mut s.state, &s.tokens) {
                    Ok(p) => s.prefix = p,
                    Err(e) => {
                        failed[i] = Some(Event::Failed(e.to_string()));
                        continue;
                    }
                }
            }
            let mut want = s.prefix.cap(s.state.len(), s.pending().len().min(budget));
            if want == 1 {
                want += s.draft_room(speculative, snapshot_block).min(budget - 1);
            }
            if want == 0 {
                continue;
            }
            let fits = |s: &Running<B>, n: usize, free: &[usize]| {
                s.state.blocks_to_run(n).iter().zip(free).all(|(a, f)| a <= f)
            };
            while !fits(&self.running[i], want, &free) {
                // Cached blocks no sequence holds go first.
                if self.prefix.as_mut().is_some_and(|c| c.evict_one(&self.pool)) {
                    free[0] += 1;
                    continue;
                }
                // The newest sequence after `i` that holds blocks or is scheduled to take some.
                let Some(j) = (i + 1..self.running.len())
                    .rev()
                    .find(|&j| take[j] > 0 || self.running[j].state.blocks_held().iter().any(|&n| n > 0))
                else {
                    break;
                };
                let victim = &mut self.running[j];
                for ((f, held), more) in
                    free.iter_mut().zip(victim.state.blocks_held()).zip(victim.state.blocks_to_run(take[j]))
                {
                    *f += held;
                    if take[j] > 0 {
                        *f += more;
                    }
                }
                budget += take[j];
                take[j] = 0;
                if let Some(cache) = &mut self.prefix {
                    cache.forget(&self.pool, &mut victim.prefix);
                }
                if let Some(d) = &mut self.drafter {
                    d.release(victim.id);
                }
                if let Err(e) = self.model.reset_state(&mut victim.state) {
                    // It cannot be emptied: it fails, and its blocks go with its state.
                    failed[j] = Some(Event::Failed(e.to_string()));
                }
                preempted = true;
                self.shared.preemptions.fetch_add(1, Ordering::Relaxed);
            }
            let s = &self.running[i];
            let n = (1..=want).rev().find(|&n| fits(s, n, &free)).unwrap_or(0);
            for (f, more) in free.iter_mut().zip(s.state.blocks_to_run(n)) {
                *f -= more;
            }
            take[i] = n;
            budget -= n;
        }
        if failed.iter().any(Option::is_some) {
            take = take.iter().zip(&failed).filter(|(_, f)| f.is_none()).map(|(&n, _)| n).collect();
            self.finish_where(false, |_, i| failed[i].take());
        }
        if !preempted {
            self.admit(&mut budget, &mut free, &mut take);
        }
        self.publish();
        take
    }

    /// Starts waiting requests, in order, while sequences, the step's tokens and the pool's
    /// blocks (for each one's whole prompt) allow; schedules their first chunks.
    fn admit(&mut self, budget: &mut usize, free: &mut [usize], take: &mut Vec<usize>) {
        let chunk = self.limits.config.max_batch_tokens;
        while self.running.len() < self.limits.config.max_seqs && *budget > 0 {
            let Some(w) = self.waiting.front() else { break };
            // Every choice of the request takes a sequence once its prompt has run.
            let forking: usize = self.running.iter().map(|s| s.forks.len()).sum();
            if self.running.len() + forking + 1 + w.forks.len() > self.limits.config.max_seqs {
                break;
            }
            // Blocks the prompt takes beyond what it finds cached; cached blocks no sequence
            // holds are evicted to make room.
            let fits = loop {
                let mut need = self.limits.pool.peak_blocks(w.req.prompt.len(), chunk);
                if let Some(c) = &self.prefix {
                    need[0] -= c.cached_len(&w.req.prompt) / c.block_size();
                }
                if need.iter().zip(free.iter()).all(|(n, f)| n <= f) {
                    break true;
                }
                if !self.prefix.as_mut().is_some_and(|c| c.evict_one(&self.pool)) {
                    break false;
                }
                free[0] += 1;
            };
            if !fits {
                break;
            }
            let mut w = self.waiting.pop_front().expect("front exists");
            self.shared.admitted.fetch_add(1, Ordering::Relaxed);
            let started = self.spare.pop().map_or_else(|| self.pool.new_state(), Ok).and_then(|mut state| {
                let prefix = match &mut self.prefix {
                    Some(c) => c.start(&self.pool, &mut state, &w.req.prompt)?,
                    None => SeqPrefix::default(),
                };
                Ok((state, Sampler::new(w.req.sampling.clone(), &w.req.prompt)?, prefix))
            });
            match started {
                Ok((state, sampler, prefix)) => {
                    let n = prefix.cap(state.len(), (w.req.prompt.len() - state.len()).min(*budget));
                    for (f, more) in free.iter_mut().zip(state.blocks_to_run(n)) {
                        *f -= more;
                    }
                    *budget -= n;
                    take.push(n);
                    self.next_seq += 1;
                    self.running.push(Running {
                        id: self.next_seq - 1,
                        sink: w.sink,
                        cancel: w.cancel,
                        state,
                        sampler,
                        tokens: w.req.prompt,
                        stop_token_ids: w.req.stop_token_ids,
                        grammar: w.req.grammar,
                        logprobs: w.req.logprobs,
                        generated: 0,
                        max_gen: w.max_gen,
                        prefix,
                        forks: w.forks,
                    });
                }
                Err(e) => {
                    for f in &mut w.forks {
                        (f.sink)(Event::Failed(e.to_string()));
                    }
                    (w.sink)(Event::Failed(e.to_string()));
                }
            }
        }
    }
}

/// The grammars' masks as `Device::argmax_rows` takes them, one row per logits row (`rows`: each
/// running sequence's count of rows, 0 where it did not run, several where it verifies drafts,
/// each under its own mask), every token allowed in a row without a mask; `None` when no row
/// has one.
fn allowed_bits(rows: impl Iterator<Item = usize>, masks: &[Option<RowMasks>], vocab: usize) -> Option<Vec<u32>> {
    if !masks.iter().flatten().flatten().any(|m| m.is_ok()) {
        return None;
    }
    let words = mask_words(vocab);
    let mut bits = Vec::new();
    for (n, masks) in rows.zip(masks) {
        for j in 0..n {
            let at = bits.len();
            bits.resize(at + words, u32::MAX);
            if let Some(Ok(mask)) = masks.as_ref().and_then(|m| m.get(j)) {
                mask.write_words(&mut bits[at..]);
            }
        }
    }
    Some(bits)
}

/// Each sequence's grammar masks of its rows as `SampleRow::allowed` takes them, where it has
/// them.
fn mask_rows(masks: &[Option<RowMasks>], vocab: usize) -> Vec<Vec<Option<Vec<u32>>>> {
    let as_words = |m: &crate::Result<TokenMask>| {
        let Ok(mask) = m else { return None };
        let mut words = vec![0; mask_words(vocab)];
        mask.write_words(&mut words);
        Some(words)
    };
    masks.iter().map(|m| m.iter().flatten().map(as_words).collect()).collect()
}

/// The picks of a step whose tokens `Device::sample_rows` draws: one per logits row (`n_rows`),
/// row `rows[i].start` drawn by sequence `i`'s sampler where it needs a token (`needs`; one that
/// verifies drafts here is greedy, as its other rows are), each of its rows under its mask
/// (`words`), every other row greedy; then one for each further choice forking off a sequence
/// here, by the choice's own sampler from the same row. Returns them, and where each sequence's
/// choices' picks start.
fn sample_picks<'a, B: Backend>(
    running: &'a mut [Running<B>],
    needs: &[bool],
    rows: &[Range<usize>],
    n_rows: usize,
    words: &'a [Vec<Option<Vec<u32>>>],
) -> (Vec<vt_core::backend::SampleRow<'a>>, Vec<usize>) {
    // The draws first (they advance the generators), then the picks that borrow the samplers.
    let uniforms: Vec<Option<(f64, Vec<f64>)>> = (running.iter_mut().zip(needs))
        .map(|(s, &need)| {
            need.then(|| (s.sampler.uniform(), s.forks.iter_mut().map(|f| f.sampler.uniform()).collect()))
        })
        .collect();
    let greedy = |row| vt_core::backend::SampleRow::plain(row, 0.0, 0.0);
    let mut list: Vec<_> = (0..n_rows).map(greedy).collect();
    let mut at = vec![0; running.len()];
    for (i, s) in running.iter().enumerate() {
        let Some((own, forks)) = &uniforms[i] else { continue };
        let mask = move |j: usize| words[i].get(j).and_then(Option::as_deref);
        let row = rows[i].start;
        list[row] = s.sampler.pick(row, mask(0), *own);
        for (j, r) in rows[i].clone().enumerate().skip(1) {
            list[r] = vt_core::backend::SampleRow { allowed: mask(j), ..greedy(r) };
        }
        at[i] = list.len();
        for (f, &u) in s.forks.iter().zip(forks) {
            list.push(f.sampler.pick(row, mask(0), u));
        }
    }
    (list, at)
}

enum Msg {
    Add(Box<Waiting>),
}

/// An engine on its own thread. Submitting checks the request and the queue bound at once;
/// dropping the handle lets running requests finish, then stops the thread.
pub struct EngineHandle {
    tx: Option<mpsc::Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
    limits: Limits,
    /// Requests submitted so far, and taken from the queue by the engine so far.
    submitted: AtomicUsize,
    shared: Arc<Shared>,
}

impl EngineHandle {
    /// Starts an engine (`Engine::new`) on its own thread.
    pub fn spawn<B: Backend>(model: Model<B>, config: EngineConfig) -> vt_core::Result<Self>
    where
        Model<B>: Send,
    {
        let mut engine = Engine::new(model, config)?;
        let limits = engine.limits.clone();
        let shared = engine.shared.clone();
        let (tx, rx) = mpsc::channel::<Msg>();
        let thread = std::thread::Builder::new()
            .name("vt-engine".into())
            .spawn(move || loop {
                // Block only when idle; otherwise pick up new requests between steps.
                if !engine.has_work() {
                    match rx.recv() {
                        Ok(Msg::Add(w)) => engine.waiting.push_back(*w),
                        Err(_) => return,
                    }
                }
                while let Ok(Msg::Add(w)) = rx.try_recv() {
                    engine.waiting.push_back(*w);
                }
                engine.step();
            })
            .expect("spawning the engine thread");
        Ok(EngineHandle { tx: Some(tx), thread: Some(thread), limits, submitted: AtomicUsize::new(0), shared })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.limits.spec
    }

    pub fn config(&self) -> &EngineConfig {
        &self.limits.config
    }

    /// Requests submitted and not yet started (some may start at the next step, in free slots).
    pub fn queued(&self) -> usize {
        self.submitted.load(Ordering::Relaxed).saturating_sub(self.shared.admitted.load(Ordering::Relaxed))
    }

    /// Sequences running at the last step.
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::Relaxed)
    }

    /// KV blocks in use and in the pool at the last step.
    pub fn pool_blocks(&self) -> (usize, usize) {
        (self.shared.blocks_used.load(Ordering::Relaxed), self.shared.blocks_total.load(Ordering::Relaxed))
    }

    /// Sequences preempted so far.
    pub fn preemptions(&self) -> usize {
        self.shared.preemptions.load(Ordering::Relaxed)
    }

    /// The prefix cache's counts and the blocks it holds, at the last step.
    pub fn prefix_cache(&self) -> (PrefixStats, usize) {
        let sh = &self.shared;
        let stats = PrefixStats {
            lookups: sh.prefix_lookups.load(Ordering::Relaxed),
            hits: sh.prefix_hits.load(Ordering::Relaxed),
            prompt_tokens: sh.prefix_prompt_tokens.load(Ordering::Relaxed),
            hit_tokens: sh.prefix_hit_tokens.load(Ordering::Relaxed),
        };
        (stats, sh.prefix_blocks.load(Ordering::Relaxed))
    }

    pub fn submit(&self, req: Request, sink: Sink) -> Result<CancelToken, SubmitError> {
        self.submit_choices(req, vec![sink]).map(|mut c| c.remove(0))
    }

    /// Submits a request of one choice per sink (`Engine::add_choices`).
    pub fn submit_choices(&self, req: Request, sinks: Vec<Sink>) -> Result<Vec<CancelToken>, SubmitError> {
        let (w, cancels) = self.limits.waiting(req, sinks)?;
        if self.queued() >= self.limits.waiting_room(self.running()) {
            return Err(SubmitError::QueueFull);
        }
        let tx = self.tx.as_ref().ok_or(SubmitError::Closed)?;
        tx.send(Msg::Add(Box::new(w))).map_err(|_| SubmitError::Closed)?;
        self.submitted.fetch_add(1, Ordering::Relaxed);
        Ok(cancels)
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
