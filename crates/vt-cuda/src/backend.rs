//! The Backend trait on `CudaBackend` (device.rs): each method hands the work to its op family
//! (ops/), choosing between a family's fast kernels and its general path where the family has
//! several (the convention of ops/mod.rs).

use cudarc::driver::result;
use half::bf16;
// vt-core's argument checks, as `args`: `check` here is crate::error's (this backend's own limits).
use vt_core::backend::check as args;
use vt_core::backend::prelude::*;
use vt_core::backend::{Pick, SampleRow, Sampled};
use vt_core::{
    AttentionParams, DType, GateAct, GdnInputs, GdnMode, GdnState, GdnStep, KvLayout, KvSeq, Linear, MemoryStats,
    MoeExperts, NormKind, ReplayInputs, Result, Rope, Router, SharedExpert, Tensor, TokenLogprobs,
};

use crate::alloc::CudaBuffer;
use crate::capture::Recording;
use crate::device::CudaBackend;
use crate::error::{check, driver_err};
use crate::kv::CudaKvPool;
use crate::ops::{attention, gdn, moe};
use crate::record::CudaStepGraph;

impl Device for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn instance_id(&self) -> u64 {
        self.id()
    }

    fn activation_dtype(&self) -> DType {
        DType::BF16
    }

    fn memory(&self) -> MemoryStats {
        self.alloc().stats()
    }

    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        CudaBackend::device_memory(self).map(Some)
    }

    fn buffer_addr(&self, buf: &CudaBuffer) -> usize {
        buf.ptr() as usize
    }

    fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<Self>> {
        args::upload(self, dtype, shape, bytes)?;
        Ok(Tensor::from_parts(self.upload_slice(bytes)?, dtype, shape.to_vec()))
    }

    fn nvfp4_parts(&self, codes: Tensor<Self>, scales: Tensor<Self>) -> Result<(Tensor<Self>, Tensor<Self>)> {
        crate::nvfp4::device_parts(self, codes, scales)
    }

    fn from_f32(&self, shape: &[usize], data: &[f32]) -> Result<Tensor<Self>> {
        args::from_f32(self, shape, data)?;
        let host: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok(Tensor::from_parts(self.upload_slice(&host)?, DType::BF16, shape.to_vec()))
    }

    fn zeros_f32(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        self.zeroed(DType::F32, shape)
    }

    fn zeros(&self, shape: &[usize]) -> Result<Tensor<Self>> {
        self.zeroed(DType::BF16, shape)
    }

    fn zero(&self, t: &mut Tensor<Self>) -> Result<()> {
        self.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: the block holds `len` bytes, which `t` owns (`&mut`); the memset is ordered on
        // our stream after every earlier use of them.
        unsafe { result::memset_d8_async(t.buffer().ptr(), 0, t.buffer().len(), self.stream().cu_stream()) }
            .map_err(|e| driver_err("memset", e))
    }

    fn copy_into(&self, src: &Tensor<Self>, dst: &mut Tensor<Self>) -> Result<()> {
        args::copy_into(self, src, dst)?;
        let bytes = src.dtype().bytes_for(src.numel()).unwrap_or(0);
        self.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: both blocks hold `bytes` (same dtype and shape, checked); `dst` is ours
        // (`&mut`) and distinct from `src`; the copy is ordered on our stream after every earlier
        // write of either.
        unsafe { result::memcpy_dtod_async(dst.buffer().ptr(), src.buffer().ptr(), bytes, self.stream().cu_stream()) }
            .map_err(|e| driver_err("copy_into", e))
    }

    fn copy_many(&self, pairs: &mut [(&Tensor<Self>, &mut Tensor<Self>)]) -> Result<()> {
        crate::ops::elementwise::copy_many(self, pairs)
    }

    fn to_f32(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        args::to_f32(self, t)?;
        let mut bytes = vec![0u8; t.dtype().bytes_for(t.numel()).unwrap_or(0)];
        self.copy_out(&mut bytes, t.buffer(), "to_f32")?;
        let mut out = vec![0.0; t.numel()];
        vt_core::dtype::decode_into(t.dtype(), &bytes, &mut out);
        Ok(out)
    }

    fn argmax_rows(&self, x: &Tensor<Self>, allowed: Option<&[u32]>) -> Result<Vec<Pick>> {
        crate::ops::argmax::argmax_rows(self, x, allowed)
    }

    fn top_logprobs_rows(&self, x: &Tensor<Self>, chosen: &[u32], k: usize) -> Result<Vec<TokenLogprobs>> {
        crate::ops::logprobs::top_logprobs_rows(self, x, chosen, k)
    }

    fn sample_rows(&self, x: &Tensor<Self>, picks: &[SampleRow<'_>], top_logprobs: Option<usize>) -> Result<Sampled> {
        crate::ops::sample::sample_rows(self, x, picks, top_logprobs)
    }

    fn random(&self, dtype: DType, shape: &[usize], seed: u64, scale: f32) -> Result<Tensor<Self>> {
        crate::ops::random::random(self, dtype, shape, seed, scale)
    }
}

impl Ops for CudaBackend {
    fn embedding(&self, table: &Tensor<Self>, ids: &[u32]) -> Result<Tensor<Self>> {
        crate::ops::elementwise::embedding(self, table, ids)
    }

    fn rms_norm(&self, x: &Tensor<Self>, w: &Tensor<Self>, eps: f32, kind: NormKind) -> Result<Tensor<Self>> {
        crate::ops::norm::rms_norm(self, x, w, eps, kind)
    }

    fn rms_norm_gated(&self, x: &Tensor<Self>, z: &Tensor<Self>, w: &Tensor<Self>, eps: f32) -> Result<Tensor<Self>> {
        crate::ops::norm::rms_norm_gated(self, x, z, w, eps)
    }

    fn linear(&self, x: &Tensor<Self>, w: &Linear<Self>) -> Result<Tensor<Self>> {
        crate::ops::linear::linear(self, x, w)
    }

    fn add(&self, a: &Tensor<Self>, b: &Tensor<Self>) -> Result<Tensor<Self>> {
        crate::ops::elementwise::add(self, a, b)
    }

    fn swiglu(&self, gate: &Tensor<Self>, up: &Tensor<Self>) -> Result<Tensor<Self>> {
        crate::ops::elementwise::swiglu(self, gate, up)
    }

    fn gate(&self, x: &Tensor<Self>, g: &Tensor<Self>, act_kind: GateAct) -> Result<Tensor<Self>> {
        crate::ops::elementwise::gate(self, x, g, act_kind)
    }

    fn narrow_cols(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        crate::ops::elementwise::narrow_cols(self, x, start, len)
    }

    fn slice_rows(&self, x: &Tensor<Self>, start: usize, len: usize) -> Result<Tensor<Self>> {
        crate::ops::elementwise::slice_rows(self, x, start, len)
    }

    fn concat_rows(&self, parts: &[&Tensor<Self>]) -> Result<Tensor<Self>> {
        crate::ops::elementwise::concat_rows(self, parts)
    }

    fn rope(&self, x: &Tensor<Self>, start: usize, rope: &Rope) -> Result<Tensor<Self>> {
        crate::ops::rope::rope(self, x, start, rope)
    }

    fn causal_conv1d(&self, x: &Tensor<Self>, w: &Tensor<Self>, state: &mut Tensor<Self>) -> Result<Tensor<Self>> {
        gdn::causal_conv1d(self, x, w, state)
    }

    fn gated_delta_rule(
        &self,
        inp: &GdnInputs<'_, Self>,
        state: &mut Tensor<Self>,
        mode: GdnMode,
    ) -> Result<Tensor<Self>> {
        gdn::gated_delta_rule(self, inp, state, mode)
    }

    fn moe(&self, x: &Tensor<Self>, router: &Router<Self>, experts: &MoeExperts<Self>) -> Result<Tensor<Self>> {
        args::moe(self, x, router, experts)?;
        args::whole_experts(self, experts, "moe")?;
        if moe::grouped::fits(x, router, experts) {
            return moe::grouped::moe(self, x, router, experts);
        }
        moe::general::moe(self, x, router, experts)
    }

    fn prepare_experts(&self, experts: &MoeExperts<Self>) -> Result<()> {
        moe::expert_table(self, experts).map(|_| ())
    }
}

impl KvOps for CudaBackend {
    type KvPool = CudaKvPool;

    fn kv_block_size(&self) -> usize {
        crate::limits::KV_BLOCK
    }

    fn new_kv_pool(&self, layers: &[KvLayout]) -> Result<CudaKvPool> {
        check(self.recording().is_none(), "new_kv_pool", || "a recorder does not make pools".into())?;
        CudaKvPool::new(self, layers)
    }

    fn copy_kv_block(&self, pool: &mut CudaKvPool, layer: usize, src: u32, dst: u32) -> Result<()> {
        pool.copy_block(self, layer, src, dst)
    }

    fn attention(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        pool: &mut CudaKvPool,
        seq: KvSeq<'_>,
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        attention::attention(self, q, k, v, pool, seq, params)
    }
}

impl FusedOps for CudaBackend {
    fn linear_many(&self, x: &Tensor<Self>, ws: &[&Linear<Self>]) -> Result<Vec<Tensor<Self>>> {
        crate::ops::linear::linear_many(self, x, ws)
    }

    fn add_rms_norm(
        &self,
        x: &Tensor<Self>,
        y: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        kind: NormKind,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        crate::ops::norm::add_rms_norm(self, x, y, w, eps, kind)
    }

    fn moe_block(
        &self,
        x: &Tensor<Self>,
        router: &Router<Self>,
        experts: &MoeExperts<Self>,
        shared: Option<&SharedExpert<'_, Self>>,
    ) -> Result<Tensor<Self>> {
        args::moe(self, x, router, experts)?;
        args::whole_experts(self, experts, "moe_block")?;
        if let Some(y) = moe::decode::fused(self, x, router, experts, shared)? {
            return Ok(y);
        }
        // A shared expert the fused kernels do not take with the routed experts (another width,
        // or a format they do not pair with the routed experts') runs through its own projections
        // beside them.
        if let Some(s) = shared {
            if let Some(routed) = moe::decode::fused(self, x, router, experts, None)? {
                return vt_core::backend::composed::add_shared_expert(self, x, &routed, s);
            }
        }
        vt_core::backend::composed::moe_block(self, x, router, experts, shared)
    }

    fn embed_argmax(&self, table: &Tensor<Self>, logits: &Tensor<Self>) -> Result<Tensor<Self>> {
        crate::ops::argmax::embed_argmax(self, table, logits)
    }

    fn gated_delta_step(&self, step: &GdnStep<'_, Self>, states: &mut [GdnState<'_, Self>]) -> Result<Tensor<Self>> {
        self.gated_delta_waves(step, &[states.len()], states, &mut [])
    }

    /// One call for all the waves, as a recording registers it and its replays give it: the
    /// fused kernels, or the composed ops over states the recording holds fixed.
    fn gated_delta_waves(
        &self,
        step: &GdnStep<'_, Self>,
        waves: &[usize],
        states: &mut [GdnState<'_, Self>],
        firsts: &mut [Option<GdnState<'_, Self>>],
    ) -> Result<Tensor<Self>> {
        let op = "gated_delta_step";
        args::gdn_waves(self, waves, states, firsts, step)?;
        if gdn::decode::fits(step, waves, states) {
            return gdn::decode::waves(self, step, waves, states, firsts);
        }
        if let Some(r) = self.recording() {
            // The composed ops address the states directly: replays must pass these ones.
            r.fixed_states(op, gdn::decode::addresses(states, firsts))?;
        }
        let composed = vt_core::backend::composed::gated_delta_step;
        vt_core::backend::composed::gated_delta_waves(self, step, waves, states, firsts, |s, st| composed(self, s, st))
    }

    fn attention_decode(
        &self,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        rope: &Rope,
        pool: &mut CudaKvPool,
        seqs: &[KvSeq<'_>],
        params: &AttentionParams,
    ) -> Result<Tensor<Self>> {
        let head_dim = q.shape().last().copied().unwrap_or(0);
        if attention::decode_fits(head_dim) {
            return attention::decode_step(self, q, k, v, rope, pool, seqs, params);
        }
        // The composed op makes an attention call per row, which a recording keeps as such (a
        // replay gives the rows' call to them in turn: record.rs, given_calls).
        vt_core::backend::composed::attention_decode(self, q, k, v, rope, pool, seqs, params)
    }
}

impl StepRecording for CudaBackend {
    type StepGraph = CudaStepGraph;

    fn records(&self) -> bool {
        true
    }

    fn recorder(&self, positions: &[usize]) -> Result<Option<Self>> {
        check(self.recording().is_none(), "recorder", || "a recorder cannot record".into())?;
        let recording = Recording::begin(self.alloc(), positions)?;
        Ok(Some(self.recorder_of(recording)))
    }

    fn is_recording(&self) -> bool {
        self.recording().is_some()
    }

    fn finish_recording(&self, recorder: Self) -> Result<CudaStepGraph> {
        crate::record::finish(self, recorder)
    }

    fn replay(
        &self,
        graph: &mut CudaStepGraph,
        pool: &mut CudaKvPool,
        inputs: &ReplayInputs<'_, Self>,
    ) -> Result<bool> {
        crate::record::replay(self, graph, pool, inputs)
    }
}
