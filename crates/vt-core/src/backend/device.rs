//! The bottom layer: a backend's identity, its memory and the transfers in and out of it. Every
//! other layer builds on this one, and `Tensor<B>` needs only it.

use super::composed::{Pick, Sampled, TokenLogprobs};
use super::sample::SampleRow;
use crate::tensor::Tensor;
use crate::{DType, Expert, Result};

/// Memory a backend instance has handed out and not yet been given back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub bytes_live: usize,
    pub blocks_live: usize,
    pub peak_bytes: usize,
}

pub trait Device: Clone + Send + Sync + Sized + 'static {
    type Buffer: Send + Sync + 'static;

    fn name(&self) -> &'static str;
    /// Distinct for every backend instance in the process.
    fn instance_id(&self) -> u64;
    fn activation_dtype(&self) -> DType;
    fn memory(&self) -> MemoryStats;
    /// The device's free and total memory in bytes, where it has a fixed amount (a GPU): an
    /// engine sizes its KV pool from it. `None` (the default): host memory, sized by the caller.
    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        Ok(None)
    }
    /// Address of a buffer's first byte (device address on a GPU).
    fn buffer_addr(&self, buf: &Self::Buffer) -> usize;

    /// Copies stored bytes in as they are (weights keep their dtype).
    fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<Self>>;
    /// An NVFP4 matrix's codes and scales (`Nvfp4`'s fields, uploaded in the checkpoint's
    /// layout, shapes checked) as this backend keeps them: a backend whose kernels read another
    /// layout rearranges them here, once, and keeps only that form (the checkpoint's bytes are
    /// given back). The default keeps them as they are.
    fn nvfp4_parts(&self, codes: Tensor<Self>, scales: Tensor<Self>) -> Result<(Tensor<Self>, Tensor<Self>)> {
        Ok((codes, scales))
    }
    /// One MoE layer's routed experts (as uploaded, shapes checked) as this backend keeps them
    /// (`MoeExperts::new` calls it): a backend whose kernels read the experts in another
    /// arrangement (stacked, so one dispatch reaches them all) moves them into it here, once, and
    /// returns experts over that storage, so that they are held once. The default keeps them as
    /// they are.
    fn expert_parts(&self, experts: Vec<Expert<Self>>) -> Result<Vec<Expert<Self>>> {
        Ok(experts)
    }
    /// An activation tensor (of `activation_dtype`) from f32 values.
    #[allow(clippy::wrong_self_convention)] // the backend makes it: `self` is where it lives
    fn from_f32(&self, shape: &[usize], data: &[f32]) -> Result<Tensor<Self>>;
    /// An f32 tensor of zeros (recurrent state).
    fn zeros_f32(&self, shape: &[usize]) -> Result<Tensor<Self>>;
    /// Zeros in `activation_dtype` (convolution state).
    fn zeros(&self, shape: &[usize]) -> Result<Tensor<Self>>;
    /// Sets every element of `t` to zero where it is (a sequence state emptied for reuse keeps
    /// its storage, and so what was recorded over it).
    fn zero(&self, t: &mut Tensor<Self>) -> Result<()>;
    /// Copies `src` into `dst` where it is (same dtype and shape): a snapshot of a sequence's
    /// linear-attention state taken into, or restored from, storage that a recorded step may
    /// have baked in.
    fn copy_into(&self, src: &Tensor<Self>, dst: &mut Tensor<Self>) -> Result<()>;
    /// `copy_into` for each `(src, dst)` pair: the linear-attention states of many sequences
    /// (every layer's) snapshot or restored at once. A backend may copy them all in one launch;
    /// the default copies pair by pair.
    fn copy_many(&self, pairs: &mut [(&Tensor<Self>, &mut Tensor<Self>)]) -> Result<()> {
        pairs.iter_mut().try_for_each(|(src, dst)| self.copy_into(src, dst))
    }
    fn to_f32(&self, t: &Tensor<Self>) -> Result<Vec<f32>>;
    /// `argmax` of each row of `x` (greedy decoding's token per row), and whether the row is
    /// all finite: a read-back, like `to_f32`, of only what the host needs. `allowed`: a grammar's
    /// masks, `composed::mask_words` per row; a token whose bit is 0 counts as -inf
    /// (`composed::masked_argmax`), though its value still counts for `Pick::finite`. A backend
    /// may pick on the device and read back only the picks; the default reads the rows back.
    fn argmax_rows(&self, x: &Tensor<Self>, allowed: Option<&[u32]>) -> Result<Vec<Pick>> {
        super::composed::argmax_rows(self, x, allowed)
    }

    /// For each row r of logits `x`: the log-softmax value of `chosen[r]` and the `k` largest
    /// (`composed::token_logprobs`, the API's logprobs). A backend may compute them where the
    /// logits are and read back only those; the default reads the rows back.
    fn top_logprobs_rows(&self, x: &Tensor<Self>, chosen: &[u32], k: usize) -> Result<Vec<TokenLogprobs>> {
        super::composed::top_logprobs_rows(self, x, chosen, k)
    }

    /// For each of `picks`: a token drawn from its row of logits `x` as `sample::sample_row` (the
    /// reference) draws it, with the row's `Pick::finite`; with `top_logprobs: Some(k)`, the
    /// pick's logprobs as `top_logprobs_rows` gives them (of the raw row: before the pick's mask
    /// and adjustments). Several picks may draw from one row (a request's choices). A backend
    /// may draw where the logits are and read back only the picks; the default reads the rows
    /// back.
    fn sample_rows(&self, x: &Tensor<Self>, picks: &[SampleRow<'_>], top_logprobs: Option<usize>) -> Result<Sampled> {
        super::composed::sample_rows(self, x, picks, top_logprobs)
    }

    /// Random contents at `shape` (dummy weights for benchmarks); values as `random::random_bytes`
    /// gives them. It sits with the transfers, not the ops, because it is another way to fill
    /// fresh memory (the dummy-weight loader's `upload`), never a step of a model's graph; a
    /// backend generates on the device so that a large dummy model is not staged through the
    /// host. The default generates on the host and uploads.
    fn random(&self, dtype: DType, shape: &[usize], seed: u64, scale: f32) -> Result<Tensor<Self>> {
        let bytes = crate::random::random_bytes(dtype, shape.iter().product(), seed, scale)?;
        self.upload(dtype, shape, &bytes)
    }
}
