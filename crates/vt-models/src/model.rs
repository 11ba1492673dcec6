//! The decoder graph shared by all three families, generic over the backend: an embedding, the
//! layers (model/layer.rs: a mixer and a feed-forward block each, one module per kind), a final
//! norm and the LM head.

mod attention;
mod batch;
mod decode_graph;
mod delta_net;
mod layer;
mod layout;
mod mlp;
mod moe;
mod mtp;
mod parallel;
mod pool;
mod share;
mod state;
mod verify;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vt_core::checkpoint::Checkpoint;
use vt_core::{Backend, Communicator, Error, Linear, MoeExperts, Result, Tensor};

use crate::loader::{DummyWeights, Loader};
use crate::spec::ModelSpec;
use crate::split::Shard;
pub use batch::{decode_first, Logits, StepOutput, StepSeq};
pub use decode_graph::BATCH_ROWS;
use layer::{linear_bytes, tensor_bytes, Ffn, Layer};
pub use mtp::{Draft, DraftInput};
pub use parallel::Comms;
pub use pool::{PoolConfig, PoolShape, PoolStats, StatePool};
pub use state::SeqState;

/// Source of model ids. An id only tells models apart (a sequence's recorded step belongs to the
/// model that recorded it); nothing is keyed by it.
static NEXT_MODEL: AtomicU64 = AtomicU64::new(1);

/// A loaded model: weights on one backend, in their stored dtypes; or, split over several ranks
/// (tensor parallelism, parallel.rs), rank 0's part, with the other ranks' parts in `peers`.
pub struct Model<B: Backend> {
    id: u64,
    backend: B,
    spec: ModelSpec,
    embed: Linear<B>,
    layers: Vec<Layer<B>>,
    norm: Tensor<B>,
    /// `None` when tied to the embeddings.
    lm_head: Option<Linear<B>>,
    /// The multi-token-prediction layer, the draft model of speculative decoding (`draft`).
    mtp: Option<mtp::Mtp<B>>,
    /// Whether single-token steps of one sequence run as recorded steps where the backend records.
    record_decode: bool,
    /// Where each layer's sequence state lives in a pool.
    state_layout: pool::StateLayout,
    /// This rank's end of its group, where the model is split over ranks.
    comm: Option<Arc<dyn Communicator<B>>>,
    /// On rank 0 of a split model: ranks 1.., each run on a thread of its own.
    peers: Vec<Model<B>>,
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
        Self::build(backend, ckpt, Loader::new(ckpt, backend, progress)?, &Shard::ALONE, None)
    }

    /// The model `ckpt`'s config describes, with random weights made on `backend` (only the
    /// config is read: benchmarks at real shapes without the checkpoint).
    pub fn dummy(backend: &B, ckpt: &Checkpoint, weights: DummyWeights) -> Result<Self> {
        Self::build(backend, ckpt, Loader::dummy(ckpt, backend, weights, &|_, _| {}), &Shard::ALONE, None)
    }

    /// `shard`'s part of the model (all of it for `Shard::ALONE`), exchanging through `comm`.
    fn build(
        backend: &B,
        ckpt: &Checkpoint,
        ld: Loader<'_, B>,
        shard: &Shard,
        comm: Option<Arc<dyn Communicator<B>>>,
    ) -> Result<Self> {
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
            .map(|(i, ls)| Layer::load(&ld, ls, &format!("{p}layers.{i}"), h, shard))
            .collect::<Result<Vec<_>>>()?;
        let norm = ld.float(&format!("{p}norm.weight"), &[h])?;
        let lm_head = parallel::lm_head(&ld, &spec, shard)?;
        let mtp = match &spec.mtp {
            Some(ls) if ld.has(mtp::MARKER) => Some(mtp::Mtp::load(&ld, ls, h, shard)?),
            _ => None,
        };
        let id = NEXT_MODEL.fetch_add(1, Ordering::Relaxed);
        let state_layout = pool::StateLayout::of(backend, &layers, mtp.as_ref().map(|m| &m.layer));
        Ok(Model {
            id,
            backend: backend.clone(),
            spec,
            embed,
            layers,
            norm,
            lm_head,
            mtp,
            // Off until CUDA replays over the block pool are fixed (docs/performance.md).
            record_decode: true,
            state_layout,
            comm,
            peers: Vec::new(),
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
        let layers: usize = self.layers.iter().map(Layer::weight_bytes).sum();
        let row = linear_bytes(&self.embed) / self.spec.vocab.max(1);
        row + layers + tensor_bytes(&self.norm) + linear_bytes(self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    /// The routed experts of every MoE layer, in layer order, then the MTP layer's (lifetime tests
    /// check where they live and what their resident slots hold).
    pub fn moe_experts(&self) -> impl Iterator<Item = &MoeExperts<B>> {
        let layers = self.layers.iter().filter_map(|l| match &l.ffn {
            Ffn::Moe(m) => m.experts.as_ref(),
            Ffn::Dense(_) | Ffn::Idle => None,
        });
        layers.chain(self.mtp.as_ref().and_then(|m| m.experts()))
    }

    /// Builds now the state the backend derives from the weights for a single-token step (expert
    /// tables), which their first use would build otherwise. Recording a step does this first (a
    /// recorder cannot build it); a server may call it after loading so that its first request
    /// does not wait for it. Built state is kept: later calls cost a check per MoE layer.
    pub fn prepare(&self) -> Result<()> {
        self.moe_experts().try_for_each(|e| self.backend.prepare_experts(e))?;
        self.peers.iter().try_for_each(Model::prepare)
    }

    /// Runs `ids` after what `state` holds and returns logits `[rows, vocab]` for all positions or
    /// the last. A failed call leaves `state` unusable for further decoding (start a new one).
    pub fn forward(&self, ids: &[u32], state: &mut SeqState<B>, which: Logits) -> Result<Tensor<B>> {
        Ok(self.run(&mut [StepSeq { ids, state, verify: false }], which, false)?.logits)
    }

    /// One step for many sequences: each runs its `ids` after what its state holds. Returns the
    /// logits of each sequence's last position, `[seqs.len(), vocab]`, in order.
    ///
    /// Every token of the batch goes through the projections, norms and experts together (the
    /// weights are read once per step); attention and the delta rule run per sequence over its own
    /// state. Each row equals what `forward` gives for that sequence alone. A failed call leaves
    /// every state in the batch unusable.
    pub fn forward_batch(&self, seqs: &mut [(&[u32], &mut SeqState<B>)]) -> Result<Tensor<B>> {
        let mut seqs: Vec<StepSeq<'_, B>> =
            seqs.iter_mut().map(|(ids, state)| StepSeq { ids, state: &mut **state, verify: false }).collect();
        Ok(self.run(&mut seqs, Logits::Last, false)?.logits)
    }
}
