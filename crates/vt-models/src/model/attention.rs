//! Gated attention (Qwen3.5-MoE's sigmoid gate from `q_proj`, Laguna's softplus `g_proj`, or none
//! as Qwen3-MoE): its weights, their loading, and its forward over a batched step.

use vt_core::backend::stack_rows;
use vt_core::{AttentionParams, Backend, Error, GateAct, KvSeq, Linear, Result, Tensor};

use super::layer::{linear_bytes, tensor_bytes};
use super::layout::{take_rows, Layout};
use crate::loader::Loader;
use crate::spec::{AttnGate, AttnSpec};
use crate::split::{scaled, Shard};

pub(super) struct Attention<B: Backend> {
    pub(super) spec: AttnSpec,
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    q_norm: Tensor<B>,
    k_norm: Tensor<B>,
    /// Laguna's `g_proj`.
    g_proj: Option<Linear<B>>,
}

impl<B: Backend> Attention<B> {
    /// The `self_attn` module under `p` (a layer's prefix) of a model of width `h`: `shard`'s
    /// heads (split.rs), its projections' rows and the output projection's columns.
    pub(super) fn load(ld: &Loader<B>, s: &AttnSpec, p: &str, h: usize, shard: &Shard) -> Result<Self> {
        let a = format!("{p}.self_attn");
        let d = s.head_dim;
        let heads = shard.heads(s.q_heads, s.kv_heads, &a)?;
        let q_per = d * if s.gate == AttnGate::SigmoidFromQProj { 2 } else { 1 };
        let g_proj = match s.gate {
            AttnGate::Softplus { per_head } => {
                let per = if per_head { 1 } else { d };
                Some(ld.linear_rows(&format!("{a}.g_proj"), [s.q_heads * per, h], &[scaled(&heads.q, per)])?)
            }
            _ => None,
        };
        let kv = |name: &str| ld.linear_rows(&format!("{a}.{name}"), [s.kv_heads * d, h], &[scaled(&heads.kv, d)]);
        Ok(Attention {
            spec: AttnSpec { q_heads: heads.q.len(), kv_heads: heads.kv.len(), ..s.clone() },
            q_proj: ld.linear_rows(&format!("{a}.q_proj"), [s.q_heads * q_per, h], &[scaled(&heads.q, q_per)])?,
            k_proj: kv("k_proj")?,
            v_proj: kv("v_proj")?,
            o_proj: ld.linear_cols(&format!("{a}.o_proj"), [h, s.q_heads * d], scaled(&heads.q, d))?,
            q_norm: ld.float(&format!("{a}.q_norm.weight"), &[s.head_dim])?,
            k_norm: ld.float(&format!("{a}.k_norm.weight"), &[s.head_dim])?,
            g_proj,
        })
    }

    /// Bytes of weights one token reads.
    pub(super) fn weight_bytes(&self) -> usize {
        let l = linear_bytes;
        l(&self.q_proj)
            + l(&self.k_proj)
            + l(&self.v_proj)
            + l(&self.o_proj)
            + tensor_bytes(&self.q_norm)
            + tensor_bytes(&self.k_norm)
            + self.g_proj.as_ref().map_or(0, l)
    }

    /// The mixer over `x` (the normed hidden states of a step's rows, laid out as `layout`), each
    /// sequence attending through its block table (`tables`, in the layout's order) in layer
    /// `layer` of `pool`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        b: &B,
        x: &Tensor<B>,
        layout: &Layout,
        pool: &mut B::KvPool,
        layer: usize,
        tables: &[&[u32]],
        eps: f32,
    ) -> Result<Tensor<B>> {
        let s = &self.spec;
        let t = x.rows();
        let width = s.q_heads * s.head_dim;
        // One pass over `x` for every projection that reads it (Laguna's softplus gate included).
        let mut ws = vec![&self.q_proj, &self.k_proj, &self.v_proj];
        ws.extend(&self.g_proj);
        let mut projs = b.linear_many(x, &ws)?.into_iter();
        let mut next = || projs.next().ok_or_else(|| Error::input("linear_many returned too few outputs"));
        let (q, k, v) = (next()?, next()?, next()?);
        let g_proj = self.g_proj.as_ref().map(|_| next()).transpose()?;
        let (q, gate) = match s.gate {
            AttnGate::SigmoidFromQProj => {
                let qg = q.reshape(&[t * s.q_heads, 2 * s.head_dim])?;
                let q = b.narrow_cols(&qg, 0, s.head_dim)?;
                let g = b.narrow_cols(&qg, s.head_dim, s.head_dim)?.reshape(&[t, width])?;
                (q, Some(g))
            }
            _ => (q, None),
        };
        let q = b.rms_norm(&q.reshape(&[t, s.q_heads, s.head_dim])?, &self.q_norm, eps, s.qk_norm)?;
        let k = b.rms_norm(&k.reshape(&[t, s.kv_heads, s.head_dim])?, &self.k_norm, eps, s.qk_norm)?;
        let params = AttentionParams { scale: (s.head_dim as f32).powf(-0.5), window: s.window };
        // The single-token rows (the batch runner puts them first, in waves: a verification's
        // positions of a sequence in successive waves) in one batched call, each row attending
        // to the rows before it of its sequence. One sequence's one row keeps the per-sequence
        // ops, which a recorded step records.
        let kv = |k: usize, pos: usize| KvSeq { layer, table: tables[k], start: layout.starts[k] + pos };
        let single = layout.wave_rows();
        let (mut q, mut k, mut v) =
            (Some(q.reshape(&[t, width])?), Some(k.reshape(&[t, s.kv_heads * s.head_dim])?), Some(v));
        let mut parts = Vec::with_capacity(1 + layout.spans.len());
        if single > 0 {
            let rows = |m: &mut Option<Tensor<B>>, heads: usize| {
                take_rows(b, m, 0, single)?.reshape(&[single, heads, s.head_dim])
            };
            let (qs, ks, vs) = (rows(&mut q, s.q_heads)?, rows(&mut k, s.kv_heads)?, rows(&mut v, s.kv_heads)?);
            let o = if single == 1 {
                let (qs, ks) = (b.rope(&qs, kv(0, 0).start, &s.rope)?, b.rope(&ks, kv(0, 0).start, &s.rope)?);
                b.attention(&qs, &ks, &vs, pool, kv(0, 0), &params)?
            } else {
                let seqs: Vec<KvSeq<'_>> =
                    (layout.waves.iter().enumerate()).flat_map(|(j, w)| (0..w.seqs).map(move |k| kv(k, j))).collect();
                b.attention_decode(&qs, &ks, &vs, &s.rope, pool, &seqs, &params)?
            };
            parts.push(o.reshape(&[single, width])?);
        }
        for (i, sp) in layout.spans.iter().enumerate() {
            let seq = KvSeq { layer, table: tables[layout.stepwise() + i], start: sp.start };
            let rows = |m: &mut Option<Tensor<B>>, heads: usize| {
                take_rows(b, m, sp.row, sp.len)?.reshape(&[sp.len, heads, s.head_dim])
            };
            let q = b.rope(&rows(&mut q, s.q_heads)?, sp.start, &s.rope)?;
            let k = b.rope(&rows(&mut k, s.kv_heads)?, sp.start, &s.rope)?;
            parts.push(b.attention(&q, &k, &rows(&mut v, s.kv_heads)?, pool, seq, &params)?.reshape(&[sp.len, width])?);
        }
        self.out(b, stack_rows(b, parts)?, gate, g_proj)
    }

    /// The attention output `o` `[t, q_heads * head_dim]` gated as the model gates it, projected.
    fn out(&self, b: &B, o: Tensor<B>, gate: Option<Tensor<B>>, g_proj: Option<Tensor<B>>) -> Result<Tensor<B>> {
        let o = match (self.spec.gate, gate, g_proj) {
            (AttnGate::SigmoidFromQProj, Some(g), _) => b.gate(&o, &g, GateAct::Sigmoid)?,
            (AttnGate::Softplus { .. }, _, Some(g)) => b.gate(&o, &g, GateAct::Softplus)?,
            _ => o,
        };
        b.linear(&o, &self.o_proj)
    }
}
