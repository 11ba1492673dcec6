//! The decoder graph shared by all three families, generic over the backend.

mod decode_graph;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vt_core::backend::stack_rows;
use vt_core::checkpoint::Checkpoint;
use vt_core::{
    AttentionParams, Backend, Error, GateAct, GdnInputs, GdnMode, GdnState, GdnStep, Linear, MoeExperts, Result,
    Router, Tensor,
};

use crate::loader::{DummyWeights, Loader};
use crate::spec::{AttnGate, AttnSpec, FfnSpec, GdnSpec, LayerSpec, MixerSpec, ModelSpec, MoeSpec, SharedExpert};
use decode_graph::RecordedStep;

struct Attention<B: Backend> {
    spec: AttnSpec,
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    q_norm: Tensor<B>,
    k_norm: Tensor<B>,
    /// Laguna's `g_proj`.
    g_proj: Option<Linear<B>>,
}

struct DeltaNet<B: Backend> {
    spec: GdnSpec,
    in_proj_qkv: Linear<B>,
    in_proj_z: Linear<B>,
    in_proj_b: Linear<B>,
    in_proj_a: Linear<B>,
    conv: Tensor<B>,
    a_log: Tensor<B>,
    dt_bias: Tensor<B>,
    norm: Tensor<B>,
    out_proj: Linear<B>,
}

impl<B: Backend> DeltaNet<B> {
    /// The single-token step of the sequences whose rows `qkv`, `a` and `b` hold.
    fn step<'a>(&'a self, qkv: &'a Tensor<B>, a: &'a Tensor<B>, b: &'a Tensor<B>) -> GdnStep<'a, B> {
        let s = &self.spec;
        GdnStep {
            qkv,
            conv: &self.conv,
            a,
            b,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            key_heads: s.key_heads,
            key_dim: s.key_dim,
            value_heads: s.value_heads,
            value_dim: s.value_dim,
        }
    }
}

enum Mixer<B: Backend> {
    Attention(Attention<B>),
    DeltaNet(DeltaNet<B>),
}

struct Mlp<B: Backend> {
    gate: Linear<B>,
    up: Linear<B>,
    down: Linear<B>,
}

struct MoeBlock<B: Backend> {
    router: Router<B>,
    experts: MoeExperts<B>,
    shared: Option<Mlp<B>>,
    shared_gate: Option<Linear<B>>,
}

// One per layer, never moved after loading: the larger MoE variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Moe(MoeBlock<B>),
}

struct Layer<B: Backend> {
    input_norm: Tensor<B>,
    mixer: Mixer<B>,
    post_norm: Tensor<B>,
    ffn: Ffn<B>,
}

/// Source of model ids. An id only tells models apart (a sequence's recorded step belongs to the
/// model that recorded it); nothing is keyed by it.
static NEXT_MODEL: AtomicU64 = AtomicU64::new(1);

/// A loaded model: weights on one backend, in their stored dtypes.
pub struct Model<B: Backend> {
    id: u64,
    backend: B,
    spec: ModelSpec,
    embed: Linear<B>,
    layers: Vec<Layer<B>>,
    norm: Tensor<B>,
    /// `None` when tied to the embeddings.
    lm_head: Option<Linear<B>>,
    /// Whether single-token steps of one sequence run as recorded steps where the backend records.
    record_decode: bool,
    /// Set once a single-token step of one sequence has run unrecorded on this model: its weights
    /// have built the derived state decode uses, so any sequence's single-token step may record (a
    /// recorder must not build it). That state belongs to the weights, not to a sequence.
    decode_state_built: AtomicBool,
}

/// Per-layer sequence state.
enum LayerState<B: Backend> {
    Attention(B::KvCache),
    DeltaNet { conv: Tensor<B>, recurrent: Tensor<B> },
}

/// One sequence's state: KV caches, convolution and recurrent states, its length, and its
/// recorded decode step.
pub struct SeqState<B: Backend> {
    pos: usize,
    layers: Vec<LayerState<B>>,
    recorded: Recorded<B>,
    recordings: usize,
}

/// A sequence's recorded decode step (decode_graph.rs).
enum Recorded<B: Backend> {
    /// Not recorded yet (or its recording no longer fits the caches).
    None,
    Step(RecordedStep<B>),
    /// Recording failed; this sequence decodes unrecorded.
    Failed(Error),
}

impl<B: Backend> SeqState<B> {
    /// Tokens processed so far.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    /// Decode steps recorded for this sequence so far (each replayed until its caches move).
    pub fn recordings(&self) -> usize {
        self.recordings
    }

    /// Why recording this sequence's decode step failed, if it did.
    pub fn recording_error(&self) -> Option<&Error> {
        match &self.recorded {
            Recorded::Failed(e) => Some(e),
            _ => None,
        }
    }
}

/// Where one sequence's tokens sit in a batched step.
struct Span {
    /// First row in the batch.
    row: usize,
    len: usize,
    /// Position of the first token in the sequence.
    start: usize,
}

/// Which positions `forward` returns logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
}

impl<B: Backend> Model<B> {
    /// Loads the checkpoint in `dir` onto `backend`.
    pub fn load(backend: &B, dir: &Path) -> Result<Self> {
        Self::load_with_progress(backend, dir, &|_, _| {})
    }

    /// As `load`, telling `progress(bytes uploaded, bytes to upload)` after each tensor.
    pub fn load_with_progress(backend: &B, dir: &Path, progress: &dyn Fn(u64, u64)) -> Result<Self> {
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(backend, &ckpt, progress)
    }

    pub fn from_checkpoint(backend: &B, ckpt: &Checkpoint, progress: &dyn Fn(u64, u64)) -> Result<Self> {
        Self::build(backend, ckpt, Loader::new(ckpt, backend, progress)?)
    }

    /// The model `ckpt`'s config describes, with random weights made on `backend` (only the
    /// config is read: benchmarks at real shapes without the checkpoint).
    pub fn dummy(backend: &B, ckpt: &Checkpoint, weights: DummyWeights) -> Result<Self> {
        Self::build(backend, ckpt, Loader::dummy(ckpt, backend, weights, &|_, _| {}))
    }

    fn build(backend: &B, ckpt: &Checkpoint, ld: Loader<'_, B>) -> Result<Self> {
        let spec = ModelSpec::from_config(&ckpt.config)?;
        let p = ld.prefix.clone();
        let h = spec.hidden;
        let embed = ld.linear(&format!("{p}embed_tokens"), spec.vocab, h)?;
        if !matches!(embed.weight, vt_core::Weight::Dense(_)) {
            return Err(Error::tensor(format!("{p}embed_tokens"), "quantized embeddings are not supported"));
        }
        let layers = spec
            .layers
            .iter()
            .enumerate()
            .map(|(i, ls)| load_layer(&ld, &spec, ls, &format!("{p}layers.{i}")))
            .collect::<Result<Vec<_>>>()?;
        let norm = ld.float(&format!("{p}norm.weight"), &[h])?;
        let lm_head = if spec.tie_embeddings { None } else { Some(ld.linear("lm_head", spec.vocab, h)?) };
        let id = NEXT_MODEL.fetch_add(1, Ordering::Relaxed);
        Ok(Model {
            id,
            backend: backend.clone(),
            spec,
            embed,
            layers,
            norm,
            lm_head,
            record_decode: true,
            decode_state_built: AtomicBool::new(false),
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Bytes of weights one decode token reads: every matrix, norm and gate once, one embedding
    /// row, and of each MoE layer's experts only the routed top-k (the weight-bytes roofline's
    /// numerator).
    pub fn decode_weight_bytes(&self) -> usize {
        let t = |t: &Tensor<B>| t.dtype().bytes_for(t.numel()).unwrap_or(0);
        let l = |l: &Linear<B>| l.weight.resident_bytes();
        let mlp = |m: &Mlp<B>| l(&m.gate) + l(&m.up) + l(&m.down);
        let layers: usize =
            self.layers
                .iter()
                .map(|layer| {
                    let mixer = match &layer.mixer {
                        Mixer::Attention(a) => {
                            l(&a.q_proj)
                                + l(&a.k_proj)
                                + l(&a.v_proj)
                                + l(&a.o_proj)
                                + t(&a.q_norm)
                                + t(&a.k_norm)
                                + a.g_proj.as_ref().map_or(0, l)
                        }
                        Mixer::DeltaNet(d) => {
                            l(&d.in_proj_qkv)
                                + l(&d.in_proj_z)
                                + l(&d.in_proj_b)
                                + l(&d.in_proj_a)
                                + l(&d.out_proj)
                                + t(&d.conv)
                                + t(&d.a_log)
                                + t(&d.dt_bias)
                                + t(&d.norm)
                        }
                    };
                    let ffn = match &layer.ffn {
                        Ffn::Dense(m) => mlp(m),
                        Ffn::Moe(m) => {
                            let expert = m.experts.experts.first().map_or(0, |e| {
                                e.gate.resident_bytes() + e.up.resident_bytes() + e.down.resident_bytes()
                            });
                            l(&m.router.weight)
                                + m.router.kind.top_k() * expert
                                + m.shared.as_ref().map_or(0, mlp)
                                + m.shared_gate.as_ref().map_or(0, l)
                        }
                    };
                    t(&layer.input_norm) + t(&layer.post_norm) + mixer + ffn
                })
                .sum();
        let row = l(&self.embed) / self.spec.vocab.max(1);
        row + layers + t(&self.norm) + l(self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    /// The routed experts of every MoE layer, in layer order (lifetime tests check where they live
    /// and what their resident slots hold).
    pub fn moe_experts(&self) -> impl Iterator<Item = &MoeExperts<B>> {
        self.layers.iter().filter_map(|l| match &l.ffn {
            Ffn::Moe(m) => Some(&m.experts),
            Ffn::Dense(_) => None,
        })
    }

    /// A fresh, empty sequence.
    pub fn new_state(&self) -> Result<SeqState<B>> {
        let b = &self.backend;
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => {
                    Ok(LayerState::Attention(b.new_kv_cache(a.spec.kv_heads, a.spec.head_dim, a.spec.window)?))
                }
                Mixer::DeltaNet(d) => Ok(LayerState::DeltaNet {
                    conv: b.zeros(&[d.spec.conv_channels(), d.spec.conv_kernel - 1])?,
                    recurrent: b.zeros_f32(&[d.spec.value_heads, d.spec.key_dim, d.spec.value_dim])?,
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SeqState { pos: 0, layers, recorded: Recorded::None, recordings: 0 })
    }

    /// Empties `state` (a state of this model's `new_state`) for a new sequence: it then computes
    /// as a new state does, but keeps its storage and its recorded decode step, so the sequence
    /// that reuses it (the engine keeps finished sequences' states) allocates and records nothing
    /// while its caches hold still. A recording that had failed is tried again.
    pub fn reset_state(&self, state: &mut SeqState<B>) -> Result<()> {
        let b = &self.backend;
        let fits = state.layers.len() == self.layers.len()
            && state.layers.iter().zip(&self.layers).all(|(s, l)| {
                matches!(
                    (s, &l.mixer),
                    (LayerState::Attention(_), Mixer::Attention(_)) | (LayerState::DeltaNet { .. }, Mixer::DeltaNet(_))
                )
            });
        if !fits {
            return Err(Error::input("reset_state: the state was made by a model of other layers"));
        }
        for layer in &mut state.layers {
            match layer {
                LayerState::Attention(cache) => b.kv_clear(cache)?,
                LayerState::DeltaNet { conv, recurrent } => {
                    b.zero(conv)?;
                    b.zero(recurrent)?;
                }
            }
        }
        state.pos = 0;
        if matches!(state.recorded, Recorded::Failed(_)) {
            state.recorded = Recorded::None;
        }
        Ok(())
    }

    /// Runs `ids` after what `state` holds and returns logits `[rows, vocab]` for all positions or
    /// the last. A failed call leaves `state` unusable for further decoding (start a new one).
    pub fn forward(&self, ids: &[u32], state: &mut SeqState<B>, which: Logits) -> Result<Tensor<B>> {
        self.run(&mut [(ids, state)], which)
    }

    /// One step for many sequences: each runs its `ids` after what its state holds. Returns the
    /// logits of each sequence's last position, `[seqs.len(), vocab]`, in order.
    ///
    /// Every token of the batch goes through the projections, norms and experts together (the
    /// weights are read once per step); attention and the delta rule run per sequence over its own
    /// state. Each row equals what `forward` gives for that sequence alone. A failed call leaves
    /// every state in the batch unusable.
    pub fn forward_batch(&self, seqs: &mut [(&[u32], &mut SeqState<B>)]) -> Result<Tensor<B>> {
        self.run(seqs, Logits::Last)
    }

    fn run(&self, seqs: &mut [(&[u32], &mut SeqState<B>)], which: Logits) -> Result<Tensor<B>> {
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
        let logits = self.run_on(&self.backend, seqs, which)?;
        if let [(&[_], _)] = seqs {
            self.decode_state_built.store(true, Ordering::Release);
        }
        Ok(logits)
    }

    /// The forward pass of `run` on `b` (the model's backend, or a recorder of it).
    fn run_on(&self, b: &B, seqs: &mut [(&[u32], &mut SeqState<B>)], which: Logits) -> Result<Tensor<B>> {
        let vt_core::Weight::Dense(table) = &self.embed.weight else {
            return Err(Error::tensor("embed_tokens", "quantized embeddings are not supported"));
        };
        // Single-token sequences first (in the caller's order), then the prompt chunks: the layers
        // run the leading single tokens as one batch. Logits come back in the caller's order.
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        if which == Logits::Last {
            order.sort_by_key(|&i| seqs[i].0.len() > 1);
        }
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
            let mixed = match &layer.mixer {
                Mixer::Attention(a) => self.attention(b, a, &h, &spans, &mut states)?,
                Mixer::DeltaNet(d) => self.delta_net(b, d, &h, &spans, &mut states)?,
            };
            let (x1, h1) = b.add_rms_norm(&x, &mixed, &layer.post_norm, eps, kind)?;
            let f = match &layer.ffn {
                Ffn::Dense(m) => self.mlp(b, m, &h1)?,
                Ffn::Moe(m) => self.moe(b, m, &h1)?,
            };
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

    fn attention(
        &self,
        b: &B,
        a: &Attention<B>,
        x: &Tensor<B>,
        spans: &[Span],
        states: &mut [&mut LayerState<B>],
    ) -> Result<Tensor<B>> {
        let s = &a.spec;
        let t = x.rows();
        let width = s.q_heads * s.head_dim;
        // One pass over `x` for every projection that reads it (Laguna's softplus gate included).
        let mut ws = vec![&a.q_proj, &a.k_proj, &a.v_proj];
        ws.extend(&a.g_proj);
        let mut projs = b.linear_many(x, &ws)?.into_iter();
        let mut next = || projs.next().ok_or_else(|| Error::input("linear_many returned too few outputs"));
        let (q, k, v) = (next()?, next()?, next()?);
        let g_proj = a.g_proj.as_ref().map(|_| next()).transpose()?;
        let (q, gate) = match s.gate {
            AttnGate::SigmoidFromQProj => {
                let qg = q.reshape(&[t * s.q_heads, 2 * s.head_dim])?;
                let q = b.narrow_cols(&qg, 0, s.head_dim)?;
                let g = b.narrow_cols(&qg, s.head_dim, s.head_dim)?.reshape(&[t, width])?;
                (q, Some(g))
            }
            _ => (q, None),
        };
        let q = b.rms_norm(&q.reshape(&[t, s.q_heads, s.head_dim])?, &a.q_norm, self.spec.eps, s.qk_norm)?;
        let k = b.rms_norm(&k.reshape(&[t, s.kv_heads, s.head_dim])?, &a.k_norm, self.spec.eps, s.qk_norm)?;
        let params = AttentionParams { scale: (s.head_dim as f32).powf(-0.5), window: s.window };
        // Many sequences' single-token steps (run_on puts them first): one batched call. One
        // sequence keeps the per-sequence ops, which a recorded step records.
        let decodes = batched_decodes(spans);
        if decodes == spans.len() {
            let positions: Vec<usize> = spans.iter().map(|sp| sp.start).collect();
            let v = v.reshape(&[t, s.kv_heads, s.head_dim])?;
            let o = b.attention_decode(&q, &k, &v, &s.rope, &positions, &mut kv_caches(states)?, &params)?;
            return self.attention_out(b, a, o.reshape(&[t, width])?, gate, g_proj);
        }
        let mut parts = Vec::with_capacity(spans.len() - decodes + 1);
        let (decoding, prompts) = states.split_at_mut(decodes);
        if decodes > 0 {
            // Their rows lead each tensor (q and k are [t, heads, d], v [t, kv_heads * d]).
            let lead = |x: &Tensor<B>, rows: usize, heads: usize| {
                b.slice_rows(x, 0, rows)?.reshape(&[decodes, heads, s.head_dim])
            };
            let (qd, kd, vd) = (
                lead(&q, decodes * s.q_heads, s.q_heads)?,
                lead(&k, decodes * s.kv_heads, s.kv_heads)?,
                lead(&v, decodes, s.kv_heads)?,
            );
            let positions: Vec<usize> = spans[..decodes].iter().map(|sp| sp.start).collect();
            let o = b.attention_decode(&qd, &kd, &vd, &s.rope, &positions, &mut kv_caches(decoding)?, &params)?;
            parts.push(o.reshape(&[decodes, width])?);
        }
        let (mut q, mut k, mut v) =
            (Some(q.reshape(&[t, width])?), Some(k.reshape(&[t, s.kv_heads * s.head_dim])?), Some(v));
        for (sp, state) in spans[decodes..].iter().zip(prompts.iter_mut()) {
            let LayerState::Attention(cache) = &mut **state else {
                return Err(Error::input("sequence state belongs to another model"));
            };
            let rows =
                |m: &mut Option<Tensor<B>>, heads: usize| take_rows(b, m, sp)?.reshape(&[sp.len, heads, s.head_dim]);
            let q = b.rope(&rows(&mut q, s.q_heads)?, sp.start, &s.rope)?;
            let k = b.rope(&rows(&mut k, s.kv_heads)?, sp.start, &s.rope)?;
            parts.push(b.attention(&q, &k, &rows(&mut v, s.kv_heads)?, cache, &params)?.reshape(&[sp.len, width])?);
        }
        self.attention_out(b, a, stack_rows(b, parts)?, gate, g_proj)
    }

    /// The attention output `o` `[t, q_heads * head_dim]` gated as the model gates it, projected.
    fn attention_out(
        &self,
        b: &B,
        a: &Attention<B>,
        o: Tensor<B>,
        gate: Option<Tensor<B>>,
        g_proj: Option<Tensor<B>>,
    ) -> Result<Tensor<B>> {
        let o = match (a.spec.gate, gate, g_proj) {
            (AttnGate::SigmoidFromQProj, Some(g), _) => b.gate(&o, &g, GateAct::Sigmoid)?,
            (AttnGate::Softplus { .. }, _, Some(g)) => b.gate(&o, &g, GateAct::Softplus)?,
            _ => o,
        };
        b.linear(&o, &a.o_proj)
    }

    fn delta_net(
        &self,
        b: &B,
        d: &DeltaNet<B>,
        x: &Tensor<B>,
        spans: &[Span],
        states: &mut [&mut LayerState<B>],
    ) -> Result<Tensor<B>> {
        let s = &d.spec;
        let t = x.rows();
        let [qkv_in, z, a, beta_in]: [Tensor<B>; 4] = b
            .linear_many(x, &[&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_a, &d.in_proj_b])?
            .try_into()
            .map_err(|_| Error::input("linear_many returned too few outputs"))?;
        // Single-token steps (run_on puts them first), of one sequence or many: the recurrent
        // form, one call for all; prompt chunks a sequence at a time, in the chunked form. (As
        // transformers: the recurrent form for single-token steps, the chunked form otherwise.)
        let decodes = spans.iter().take_while(|sp| sp.len == 1).count();
        let o = if decodes == spans.len() {
            b.gated_delta_step(&d.step(&qkv_in, &a, &beta_in), &mut gdn_states(states)?)?
        } else {
            let (decoding, prompts) = states.split_at_mut(decodes);
            let mut parts = Vec::with_capacity(spans.len() - decodes + 1);
            if decodes > 0 {
                let lead = |x: &Tensor<B>| b.slice_rows(x, 0, decodes);
                let (qkv, a, beta) = (lead(&qkv_in)?, lead(&a)?, lead(&beta_in)?);
                let o = b.gated_delta_step(&d.step(&qkv, &a, &beta), &mut gdn_states(decoding)?)?;
                parts.push(o.reshape(&[decodes, s.value_heads * s.value_dim])?);
            }
            parts.extend(self.delta_net_chunks(b, d, [qkv_in, a, beta_in], &spans[decodes..], prompts)?);
            stack_rows(b, parts)?
        };
        let o = o.reshape(&[t * s.value_heads, s.value_dim])?;
        let z = z.reshape(&[t * s.value_heads, s.value_dim])?;
        let o = b.rms_norm_gated(&o, &z, &d.norm, self.spec.eps)?.reshape(&[t, s.value_heads * s.value_dim])?;
        b.linear(&o, &d.out_proj)
    }

    /// The delta rule of `spans` (rows of the step's tensors; prompt chunks), a sequence at a time
    /// in the chunked form -> each sequence's `[len, value_heads * value_dim]`.
    fn delta_net_chunks(
        &self,
        b: &B,
        d: &DeltaNet<B>,
        [qkv_in, a, beta_in]: [Tensor<B>; 3],
        spans: &[Span],
        states: &mut [&mut LayerState<B>],
    ) -> Result<Vec<Tensor<B>>> {
        let s = &d.spec;
        let key_total = s.key_heads * s.key_dim;
        let (mut qkv_in, mut a, mut beta_in) = (Some(qkv_in), Some(a), Some(beta_in));
        let mut parts = Vec::with_capacity(spans.len());
        for (sp, state) in spans.iter().zip(states.iter_mut()) {
            let LayerState::DeltaNet { conv, recurrent } = &mut **state else {
                return Err(Error::input("sequence state belongs to another model"));
            };
            let n = sp.len;
            let (a, beta_in) = (take_rows(b, &mut a, sp)?, take_rows(b, &mut beta_in, sp)?);
            let qkv = b.causal_conv1d(&take_rows(b, &mut qkv_in, sp)?, &d.conv, conv)?;
            let q = b.narrow_cols(&qkv, 0, key_total)?.reshape(&[n, s.key_heads, s.key_dim])?;
            let k = b.narrow_cols(&qkv, key_total, key_total)?.reshape(&[n, s.key_heads, s.key_dim])?;
            let v = b.narrow_cols(&qkv, 2 * key_total, s.value_heads * s.value_dim)?.reshape(&[
                n,
                s.value_heads,
                s.value_dim,
            ])?;
            let inputs = GdnInputs { q: &q, k: &k, v: &v, a: &a, b: &beta_in, a_log: &d.a_log, dt_bias: &d.dt_bias };
            parts.push(
                b.gated_delta_rule(&inputs, recurrent, GdnMode::Chunked)?.reshape(&[n, s.value_heads * s.value_dim])?,
            );
        }
        Ok(parts)
    }

    fn mlp(&self, b: &B, m: &Mlp<B>, x: &Tensor<B>) -> Result<Tensor<B>> {
        let act = b.swiglu(&b.linear(x, &m.gate)?, &b.linear(x, &m.up)?)?;
        b.linear(&act, &m.down)
    }

    fn moe(&self, b: &B, m: &MoeBlock<B>, x: &Tensor<B>) -> Result<Tensor<B>> {
        let shared = m.shared.as_ref().map(|s| vt_core::SharedExpert {
            gate: &s.gate,
            up: &s.up,
            down: &s.down,
            gate_proj: m.shared_gate.as_ref(),
        });
        b.moe_block(x, &m.router, &m.experts, shared.as_ref())
    }
}

/// How many of a step's leading sequences run one token each, where they are at least two (one
/// batched call); 0 otherwise.
fn batched_decodes(spans: &[Span]) -> usize {
    match spans.iter().take_while(|sp| sp.len == 1).count() {
        n if n >= 2 => n,
        _ => 0,
    }
}

/// The Gated DeltaNet states of one layer's `states`, a sequence each.
fn gdn_states<'s, B: Backend>(states: &'s mut [&mut LayerState<B>]) -> Result<Vec<GdnState<'s, B>>> {
    states
        .iter_mut()
        .map(|st| match &mut **st {
            LayerState::DeltaNet { conv, recurrent } => Ok(GdnState { conv, recurrent }),
            LayerState::Attention(_) => Err(Error::input("sequence state belongs to another model")),
        })
        .collect()
}

/// The KV caches of one attention layer's `states`, a sequence each.
fn kv_caches<'s, B: Backend>(states: &'s mut [&mut LayerState<B>]) -> Result<Vec<&'s mut B::KvCache>> {
    states
        .iter_mut()
        .map(|st| match &mut **st {
            LayerState::Attention(cache) => Ok(cache),
            LayerState::DeltaNet { .. } => Err(Error::input("sequence state belongs to another model")),
        })
        .collect()
}

/// The rows of one sequence's span of a batched tensor: the tensor itself, taken, when the span is
/// all of it (a single sequence: no copy), else a copy of its rows.
fn take_rows<B: Backend>(b: &B, m: &mut Option<Tensor<B>>, sp: &Span) -> Result<Tensor<B>> {
    let all = m.as_ref().ok_or_else(|| Error::input("a batched tensor's rows were taken twice"))?;
    if sp.row == 0 && sp.len == all.rows() {
        return m.take().ok_or_else(|| Error::input("a batched tensor's rows were taken twice"));
    }
    b.slice_rows(all, sp.row, sp.len)
}

fn load_layer<B: Backend>(ld: &Loader<B>, spec: &ModelSpec, ls: &LayerSpec, p: &str) -> Result<Layer<B>> {
    let h = spec.hidden;
    let mixer = match &ls.mixer {
        MixerSpec::Attention(s) => {
            let a = format!("{p}.self_attn");
            let q_out = s.q_heads * s.head_dim * if s.gate == AttnGate::SigmoidFromQProj { 2 } else { 1 };
            let g_proj = match s.gate {
                AttnGate::Softplus { per_head } => Some(ld.linear(
                    &format!("{a}.g_proj"),
                    if per_head { s.q_heads } else { s.q_heads * s.head_dim },
                    h,
                )?),
                _ => None,
            };
            Mixer::Attention(Attention {
                spec: s.clone(),
                q_proj: ld.linear(&format!("{a}.q_proj"), q_out, h)?,
                k_proj: ld.linear(&format!("{a}.k_proj"), s.kv_heads * s.head_dim, h)?,
                v_proj: ld.linear(&format!("{a}.v_proj"), s.kv_heads * s.head_dim, h)?,
                o_proj: ld.linear(&format!("{a}.o_proj"), h, s.q_heads * s.head_dim)?,
                q_norm: ld.float(&format!("{a}.q_norm.weight"), &[s.head_dim])?,
                k_norm: ld.float(&format!("{a}.k_norm.weight"), &[s.head_dim])?,
                g_proj,
            })
        }
        MixerSpec::DeltaNet(s) => {
            let a = format!("{p}.linear_attn");
            let (key_total, value_total) = (s.key_heads * s.key_dim, s.value_heads * s.value_dim);
            Mixer::DeltaNet(DeltaNet {
                spec: s.clone(),
                in_proj_qkv: ld.linear(&format!("{a}.in_proj_qkv"), 2 * key_total + value_total, h)?,
                in_proj_z: ld.linear(&format!("{a}.in_proj_z"), value_total, h)?,
                in_proj_b: ld.linear(&format!("{a}.in_proj_b"), s.value_heads, h)?,
                in_proj_a: ld.linear(&format!("{a}.in_proj_a"), s.value_heads, h)?,
                conv: ld.float(&format!("{a}.conv1d.weight"), &[s.conv_channels(), s.conv_kernel])?,
                a_log: ld.float(&format!("{a}.A_log"), &[s.value_heads])?,
                dt_bias: ld.float(&format!("{a}.dt_bias"), &[s.value_heads])?,
                norm: ld.float(&format!("{a}.norm.weight"), &[s.value_dim])?,
                out_proj: ld.linear(&format!("{a}.out_proj"), h, value_total)?,
            })
        }
    };
    let ffn = match &ls.ffn {
        FfnSpec::Dense { intermediate } => Ffn::Dense(load_mlp(ld, &format!("{p}.mlp"), h, *intermediate)?),
        FfnSpec::Moe(m) => Ffn::Moe(load_moe(ld, m, &format!("{p}.mlp"), h)?),
    };
    Ok(Layer {
        input_norm: ld.float(&format!("{p}.input_layernorm.weight"), &[h])?,
        mixer,
        post_norm: ld.float(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
        ffn,
    })
}

fn load_mlp<B: Backend>(ld: &Loader<B>, p: &str, h: usize, inter: usize) -> Result<Mlp<B>> {
    Ok(Mlp {
        gate: ld.linear(&format!("{p}.gate_proj"), inter, h)?,
        up: ld.linear(&format!("{p}.up_proj"), inter, h)?,
        down: ld.linear(&format!("{p}.down_proj"), h, inter)?,
    })
}

/// The first of `candidates` present in the checkpoint (name variants seen in the wild).
fn first_present<'n, B: Backend>(ld: &Loader<B>, candidates: &[&'n str], probe: &str) -> Option<&'n str> {
    candidates.iter().copied().find(|c| ld.has(&format!("{c}{probe}")))
}

fn load_moe<B: Backend>(ld: &Loader<B>, m: &MoeSpec, p: &str, h: usize) -> Result<MoeBlock<B>> {
    let correction_bias = if m.correction_bias {
        let names = [format!("{p}.experts.e_score_correction_bias"), format!("{p}.gate.e_score_correction_bias")];
        let name = names
            .iter()
            .find(|n| ld.has(n))
            .ok_or_else(|| Error::MissingTensor { name: names.join(" or "), dir: ld.ckpt.dir.clone() })?;
        Some(ld.float(name, &[m.num_experts])?)
    } else {
        None
    };
    let router =
        Router { weight: ld.linear(&format!("{p}.gate"), m.num_experts, h)?, kind: m.router.clone(), correction_bias };
    let experts = ld.experts(&format!("{p}.experts"), m.num_experts, h, m.intermediate)?;
    let (shared, shared_gate) = match m.shared {
        SharedExpert::None => (None, None),
        SharedExpert::Plain { intermediate } | SharedExpert::SigmoidGated { intermediate } => {
            let singular = format!("{p}.shared_expert");
            let plural = format!("{p}.shared_experts");
            let base = first_present(ld, &[singular.as_str(), plural.as_str()], ".gate_proj.weight")
                .unwrap_or(singular.as_str())
                .to_string();
            let gate = match m.shared {
                SharedExpert::SigmoidGated { .. } => Some(ld.linear(&format!("{p}.shared_expert_gate"), 1, h)?),
                _ => None,
            };
            (Some(load_mlp(ld, &base, h, intermediate)?), gate)
        }
    };
    Ok(MoeBlock { router, experts, shared, shared_gate })
}
