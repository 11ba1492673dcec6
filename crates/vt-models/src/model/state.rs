//! A sequence's state: per layer its KV cache or its convolution and recurrent states, its
//! length, and its recorded decode step.

use vt_core::{Backend, Error, KvGrowth, Result, Tensor};

use super::decode_graph::{RecordedStep, RESERVE_AHEAD};
use super::layer::Mixer;
use super::Model;

/// Per-layer sequence state.
pub(super) enum LayerState<B: Backend> {
    Attention(B::KvCache),
    DeltaNet { conv: Tensor<B>, recurrent: Tensor<B> },
}

/// One sequence's state: KV caches, convolution and recurrent states, its length, and its
/// recorded decode step.
pub struct SeqState<B: Backend> {
    pub(super) pos: usize,
    pub(super) layers: Vec<LayerState<B>>,
    pub(super) recorded: Recorded<B>,
    pub(super) recordings: usize,
}

/// A sequence's recorded decode step (decode_graph.rs).
pub(super) enum Recorded<B: Backend> {
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

/// What one sequence's state costs in bytes on a model's backend, before it exists: a fixed part
/// and the KV caches, which grow with its positions as the backend grows them (`at`). The engine
/// reserves memory by it. A recorded decode step's own scratch (one step's activations) is not
/// counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateBytes {
    /// Held whatever the length: every Gated DeltaNet layer's convolution and recurrent states.
    pub fixed: usize,
    /// Per attention layer: bytes of keys and values per position held, and its sliding window.
    pub kv_layers: Vec<(usize, Option<usize>)>,
    /// How the backend's KV caches grow.
    pub growth: KvGrowth,
    /// Positions a recorded decode step reserves ahead in each cache (0 where steps are not
    /// recorded).
    pub reserve_ahead: usize,
}

impl StateBytes {
    /// The most bytes a sequence's state holds once it has seen `tokens` positions.
    pub fn at(&self, tokens: usize) -> usize {
        let kv = self.kv_layers.iter().map(|&(per_position, window)| {
            per_position * self.growth.positions_held(window, tokens, self.reserve_ahead)
        });
        self.fixed + kv.sum::<usize>()
    }
}

impl<B: Backend> Model<B> {
    /// What a sequence's state (`new_state`) costs on this model's backend.
    pub fn state_bytes(&self) -> StateBytes {
        let b = &self.backend;
        let act = b.activation_dtype().bytes_for(1).unwrap_or(4);
        let (mut fixed, mut kv_layers) = (0, Vec::new());
        for layer in &self.layers {
            match &layer.mixer {
                Mixer::Attention(a) => kv_layers.push((2 * a.spec.kv_heads * a.spec.head_dim * act, a.spec.window)),
                Mixer::DeltaNet(d) => {
                    let s = &d.spec;
                    fixed += s.conv_channels() * (s.conv_kernel - 1) * act + s.value_heads * s.key_dim * s.value_dim * 4
                }
            }
        }
        let reserve_ahead = if self.record_decode { RESERVE_AHEAD } else { 0 };
        StateBytes { fixed, kv_layers, growth: b.kv_growth(), reserve_ahead }
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
}
