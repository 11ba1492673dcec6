//! Gated DeltaNet (Qwen3.5-MoE's linear attention): its weights, their loading, and its forward
//! over a batched step.

use vt_core::backend::stack_rows;
use vt_core::{Backend, Error, GdnInputs, GdnMode, GdnState, GdnStep, Linear, Result, Tensor};

use super::layer::{linear_bytes, tensor_bytes};
use super::layout::{gather_rows, take_rows, Layout, Span};
use super::verify::Saved;
use crate::loader::Loader;
use crate::spec::GdnSpec;
use crate::split::{offset, scaled, Shard};

pub(super) struct DeltaNet<B: Backend> {
    pub(super) spec: GdnSpec,
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
    /// The `linear_attn` module under `p` (a layer's prefix) of a model of width `h`: `shard`'s
    /// value heads and the key heads they read (split.rs), as rows of every input projection and
    /// of the convolution (whose channels are q, k, v), columns of the output projection.
    pub(super) fn load(ld: &Loader<B>, s: &GdnSpec, p: &str, h: usize, shard: &Shard) -> Result<Self> {
        let a = format!("{p}.linear_attn");
        let (key_total, value_total) = (s.key_heads * s.key_dim, s.value_heads * s.value_dim);
        let heads = shard.heads(s.value_heads, s.key_heads, &a)?;
        let (keys, values) = (scaled(&heads.kv, s.key_dim), scaled(&heads.q, s.value_dim));
        let qkv = [keys.clone(), offset(&keys, key_total), offset(&values, 2 * key_total)];
        let rows =
            |name: &str, out: usize, r: &[std::ops::Range<usize>]| ld.linear_rows(&format!("{a}.{name}"), [out, h], r);
        let per_head =
            |name: &str| ld.float_rows(&format!("{a}.{name}"), &[s.value_heads], std::slice::from_ref(&heads.q));
        Ok(DeltaNet {
            spec: GdnSpec { key_heads: heads.kv.len(), value_heads: heads.q.len(), ..s.clone() },
            in_proj_qkv: rows("in_proj_qkv", 2 * key_total + value_total, &qkv)?,
            in_proj_z: rows("in_proj_z", value_total, std::slice::from_ref(&values))?,
            in_proj_b: rows("in_proj_b", s.value_heads, std::slice::from_ref(&heads.q))?,
            in_proj_a: rows("in_proj_a", s.value_heads, std::slice::from_ref(&heads.q))?,
            conv: ld.float_rows(&format!("{a}.conv1d.weight"), &[s.conv_channels(), s.conv_kernel], &qkv)?,
            a_log: per_head("A_log")?,
            dt_bias: per_head("dt_bias")?,
            norm: ld.float(&format!("{a}.norm.weight"), &[s.value_dim])?,
            out_proj: ld.linear_cols(&format!("{a}.out_proj"), [h, value_total], values)?,
        })
    }

    /// Bytes of weights one token reads.
    pub(super) fn weight_bytes(&self) -> usize {
        let (l, t) = (linear_bytes, tensor_bytes);
        l(&self.in_proj_qkv)
            + l(&self.in_proj_z)
            + l(&self.in_proj_b)
            + l(&self.in_proj_a)
            + l(&self.out_proj)
            + t(&self.conv)
            + t(&self.a_log)
            + t(&self.dt_bias)
            + t(&self.norm)
    }

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

    /// The mixer over `x` (the normed hidden states of a step's rows, laid out as `layout`), each
    /// sequence continuing from its own convolution and recurrent state in `states` (in the
    /// layout's order), and writing them after its first position where `firsts` (likewise) has
    /// somewhere (a verifying sequence; its steps are single-token waves). With `saved`, the
    /// projected inputs of the delta rule go there.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        b: &B,
        x: &Tensor<B>,
        layout: &Layout,
        states: &mut [GdnState<'_, B>],
        firsts: &mut [Option<GdnState<'_, B>>],
        eps: f32,
        saved: Option<&mut Saved<B>>,
    ) -> Result<Tensor<B>> {
        let s = &self.spec;
        let t = x.rows();
        let [qkv_in, z, a, beta_in]: [Tensor<B>; 4] = b
            .linear_many(x, &[&self.in_proj_qkv, &self.in_proj_z, &self.in_proj_a, &self.in_proj_b])?
            .try_into()
            .map_err(|_| Error::input("linear_many returned too few outputs"))?;
        // Single-token steps (the batch runner puts them first, in waves), of one sequence or
        // many: the recurrent form, one call for all the waves; prompt chunks a sequence at a
        // time, in the chunked form. (As transformers: the recurrent form for single-token steps,
        // the chunked form otherwise.)
        // (A single wave is one position a sequence: none has a position after its first.)
        let o = if layout.one_wave() {
            b.gated_delta_step(&self.step(&qkv_in, &a, &beta_in), states)?
        } else {
            let (stepwise, prompts) = states.split_at_mut(layout.stepwise());
            let mut parts = Vec::with_capacity(1 + layout.spans.len());
            let (waves, rows) = (layout.wave_sizes(), layout.wave_rows());
            if rows > 0 {
                let lead;
                let (qkv, a, beta) = if rows == t {
                    (&qkv_in, &a, &beta_in)
                } else {
                    let rows = |x: &Tensor<B>| b.slice_rows(x, 0, rows);
                    lead = [rows(&qkv_in)?, rows(&a)?, rows(&beta_in)?];
                    (&lead[0], &lead[1], &lead[2])
                };
                let firsts = firsts.get_mut(..stepwise.len()).unwrap_or_default();
                let o = b.gated_delta_waves(&self.step(qkv, a, beta), &waves, stepwise, firsts)?;
                parts.push(o.reshape(&[rows, s.value_heads * s.value_dim])?);
            }
            let mut inputs = [Some(qkv_in), Some(a), Some(beta_in)];
            parts.extend(self.chunks(b, &mut inputs, &layout.spans, prompts)?);
            if let (Some(saved), [Some(qkv), Some(a), Some(beta)]) = (saved, inputs) {
                saved.push([qkv, a, beta]);
            }
            stack_rows(b, parts)?
        };
        let o = o.reshape(&[t * s.value_heads, s.value_dim])?;
        let z = z.reshape(&[t * s.value_heads, s.value_dim])?;
        let o = b.rms_norm_gated(&o, &z, &self.norm, eps)?.reshape(&[t, s.value_heads * s.value_dim])?;
        b.linear(&o, &self.out_proj)
    }

    /// The delta rule of `spans` (rows of the step's tensors; prompt chunks), a sequence at a time
    /// in the chunked form -> each sequence's `[len, value_heads * value_dim]`.
    fn chunks(
        &self,
        b: &B,
        [qkv_in, a, beta_in]: &mut [Option<Tensor<B>>; 3],
        spans: &[Span],
        states: &mut [GdnState<'_, B>],
    ) -> Result<Vec<Tensor<B>>> {
        let s = &self.spec;
        let key_total = s.key_heads * s.key_dim;
        let mut parts = Vec::with_capacity(spans.len());
        for (sp, GdnState { conv, recurrent }) in spans.iter().zip(states.iter_mut()) {
            let n = sp.len;
            let (a, beta_in) = (take_rows(b, a, sp.row, sp.len)?, take_rows(b, beta_in, sp.row, sp.len)?);
            let qkv = b.causal_conv1d(&take_rows(b, qkv_in, sp.row, sp.len)?, &self.conv, conv)?;
            let q = b.narrow_cols(&qkv, 0, key_total)?.reshape(&[n, s.key_heads, s.key_dim])?;
            let k = b.narrow_cols(&qkv, key_total, key_total)?.reshape(&[n, s.key_heads, s.key_dim])?;
            let v = b.narrow_cols(&qkv, 2 * key_total, s.value_heads * s.value_dim)?.reshape(&[
                n,
                s.value_heads,
                s.value_dim,
            ])?;
            let inputs =
                GdnInputs { q: &q, k: &k, v: &v, a: &a, b: &beta_in, a_log: &self.a_log, dt_bias: &self.dt_bias };
            parts.push(
                b.gated_delta_rule(&inputs, recurrent, GdnMode::Chunked)?.reshape(&[n, s.value_heads * s.value_dim])?,
            );
        }
        Ok(parts)
    }

    /// Reruns the single-token steps of rows `rows` of a step's projected inputs (`saved`,
    /// `qkv`, `a`, `b`) over `states` in waves (`gated_delta_waves`: `rows` holds wave 0's row of
    /// each state, then wave 1's, ...); their output is not needed.
    pub(super) fn rerun(
        &self,
        b: &B,
        [qkv, a, beta]: &[Tensor<B>; 3],
        rows: &[usize],
        waves: &[usize],
        states: &mut [GdnState<'_, B>],
    ) -> Result<()> {
        let pick = |x: &Tensor<B>| gather_rows(b, x, rows);
        b.gated_delta_waves(&self.step(&pick(qkv)?, &pick(a)?, &pick(beta)?), waves, states, &mut []).map(drop)
    }
}
