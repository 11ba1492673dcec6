//! Argument checks of the layer traits' methods, written once: a backend calls the one for its op
//! and gets the op's dimensions back, or an `Error` that names the backend, the op and the shapes.
//! What they check is the trait's contract; a backend checks only its own limits on top (a
//! kernel's largest head dimension, its cache's layout).

use super::{AttentionParams, Device, GdnDims, GdnInputs, GdnState, GdnStep, KvSeq, Rope, RELEASED};
use crate::tensor::Tensor;
use crate::weights::{Linear, MoeExperts, Router, RouterKind};
use crate::{DType, Error, Result};

/// The backend's error `"{op}: {what}"`.
pub fn error<B: Device>(b: &B, op: &str, what: impl std::fmt::Display) -> Error {
    Error::backend(b.name(), format!("{op}: {what}"))
}

/// `Ok` where `ok`, else `error(b, op, what())`.
pub fn ensure<B: Device>(b: &B, ok: bool, op: &str, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(error(b, op, what()))
    }
}

/// `Device::upload`: `bytes` hold exactly `dtype` `shape`.
pub fn upload<B: Device>(b: &B, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<()> {
    let numel: usize = shape.iter().product();
    ensure(b, dtype.bytes_for(numel) == Some(bytes.len()), "upload", || {
        format!("{} bytes do not hold {dtype} {shape:?}", bytes.len())
    })
}

/// `Device::from_f32`: one value per element of `shape`.
pub fn from_f32<B: Device>(b: &B, shape: &[usize], data: &[f32]) -> Result<()> {
    ensure(b, shape.iter().product::<usize>() == data.len(), "from_f32", || {
        format!("{} values for shape {shape:?}", data.len())
    })
}

/// `Device::to_f32`: a float tensor.
pub fn to_f32<B: Device>(b: &B, t: &Tensor<B>) -> Result<()> {
    ensure(b, t.dtype().is_float(), "to_f32", || format!("expected a float tensor, found {}", t.dtype()))
}

/// `Device::copy_into`: two tensors of one dtype and shape.
pub fn copy_into<B: Device>(b: &B, src: &Tensor<B>, dst: &Tensor<B>) -> Result<()> {
    ensure(b, src.dtype() == dst.dtype() && src.shape() == dst.shape(), "copy_into", || {
        format!("{} {:?} into {} {:?}", src.dtype(), src.shape(), dst.dtype(), dst.shape())
    })
}

/// `Ops::embedding`: a float table `[vocab, hidden]` and ids inside the vocabulary; returns
/// `(vocab, hidden)`.
pub fn embedding<B: Device>(b: &B, table: &Tensor<B>, ids: &[u32]) -> Result<(usize, usize)> {
    let op = "embedding";
    let &[vocab, hidden] = table.shape() else {
        return Err(error(b, op, format_args!("table must be 2-D, found {:?}", table.shape())));
    };
    ensure(b, table.dtype().is_float(), op, || format!("table dtype {}", table.dtype()))?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(error(b, op, format_args!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    Ok((vocab, hidden))
}

/// `FusedOps::embed_argmax`: an `embedding` table and 2-D logits no wider than its vocabulary
/// (so every pick is a row of it), at least one column; returns `(vocab, hidden)`.
pub fn embed_argmax<B: Device>(b: &B, table: &Tensor<B>, logits: &Tensor<B>) -> Result<(usize, usize)> {
    let (vocab, hidden) = embedding(b, table, &[])?;
    let &[_, n] = logits.shape() else {
        return Err(error(b, "embed_argmax", format_args!("logits must be 2-D, found {:?}", logits.shape())));
    };
    ensure(b, (1..=vocab).contains(&n), "embed_argmax", || format!("{n} logits a row for a vocabulary of {vocab}"))?;
    Ok((vocab, hidden))
}

/// `Ops::rms_norm`: a weight of `x`'s last dimension, which it returns.
pub fn rms_norm<B: Device>(b: &B, x: &Tensor<B>, w: &Tensor<B>) -> Result<usize> {
    let d = x.last_dim();
    ensure(b, w.numel() == d, "rms_norm", || format!("input {:?} vs weight {:?}", x.shape(), w.shape()))?;
    Ok(d)
}

/// `Ops::rms_norm_gated`: a gate of `x`'s size and a weight of its last dimension (returned).
pub fn rms_norm_gated<B: Device>(b: &B, x: &Tensor<B>, z: &Tensor<B>, w: &Tensor<B>) -> Result<usize> {
    let d = x.last_dim();
    ensure(b, w.numel() == d && z.numel() == x.numel(), "rms_norm_gated", || {
        format!("input {:?}, gate {:?}, weight {:?}", x.shape(), z.shape(), w.shape())
    })?;
    Ok(d)
}

/// `FusedOps::add_rms_norm`: two inputs of one shape and a weight of their last dimension
/// (returned).
pub fn add_rms_norm<B: Device>(b: &B, x: &Tensor<B>, y: &Tensor<B>, w: &Tensor<B>) -> Result<usize> {
    let d = x.last_dim();
    ensure(b, x.shape() == y.shape() && w.numel() == d, "add_rms_norm", || {
        format!("inputs {:?} and {:?}, weight {:?}", x.shape(), y.shape(), w.shape())
    })?;
    Ok(d)
}

/// `Ops::linear`: `x`'s last dimension is the weight's input width; returns the weight's
/// `(out, in)`.
pub fn linear<B: Device>(b: &B, x: &Tensor<B>, w: &Linear<B>) -> Result<(usize, usize)> {
    let (n, k) = w.weight.dims();
    ensure(b, x.last_dim() == k, "linear", || format!("input {:?} vs weight [{n}, {k}]", x.shape()))?;
    Ok((n, k))
}

/// `Ops::add`, `Ops::swiglu`: two tensors of one shape.
pub fn same_shape<B: Device>(b: &B, op: &str, x: &Tensor<B>, y: &Tensor<B>) -> Result<()> {
    ensure(b, x.shape() == y.shape(), op, || format!("{:?} vs {:?}", x.shape(), y.shape()))
}

/// `Ops::gate`: a gate per element or per group of consecutive features; returns the features
/// one gate value scales.
pub fn gate<B: Device>(b: &B, x: &Tensor<B>, g: &Tensor<B>) -> Result<usize> {
    let (rows, width) = (x.rows(), x.last_dim());
    let groups = g.numel() / rows.max(1);
    ensure(b, g.numel() == rows * groups && groups > 0 && width % groups == 0, "gate", || {
        format!("gate {:?} does not fit input {:?}", g.shape(), x.shape())
    })?;
    Ok(width / groups)
}

/// `Ops::narrow_cols`: columns `start..start + len` lie inside `x`'s rows.
pub fn narrow_cols<B: Device>(b: &B, x: &Tensor<B>, start: usize, len: usize) -> Result<()> {
    ensure(b, start.checked_add(len).is_some_and(|end| end <= x.last_dim()), "narrow_cols", || {
        format!("columns {start}..{} of {:?}", start.saturating_add(len), x.shape())
    })
}

/// `Ops::slice_rows`: rows `start..start + len` lie inside `x`.
pub fn slice_rows<B: Device>(b: &B, x: &Tensor<B>, start: usize, len: usize) -> Result<()> {
    ensure(b, start.checked_add(len).is_some_and(|end| end <= x.rows()), "slice_rows", || {
        format!("rows {start}..{} of {:?}", start.saturating_add(len), x.shape())
    })
}

/// `Ops::concat_rows`: parts of one width; returns `(rows, width)` of the result.
pub fn concat_rows<B: Device>(b: &B, parts: &[&Tensor<B>]) -> Result<(usize, usize)> {
    let width = parts.first().map_or(0, |p| p.last_dim());
    if let Some(p) = parts.iter().find(|p| p.last_dim() != width) {
        return Err(error(b, "concat_rows", format_args!("width {} differs from {width}", p.last_dim())));
    }
    Ok((parts.iter().map(|p| p.rows()).sum(), width))
}

/// `Ops::rope`: `x` `[tokens, heads, dim]` (returned) with a rotary dimension inside the head.
pub fn rope<B: Device>(b: &B, x: &Tensor<B>, rope: &Rope) -> Result<(usize, usize, usize)> {
    let (t, heads, dim) = x.dims3(b.name(), "rope")?;
    ensure(b, rope.rotary_dim() <= dim, "rope", || format!("rotary dim {} exceeds head dim {dim}", rope.rotary_dim()))?;
    Ok((t, heads, dim))
}

/// `Ops::causal_conv1d`: weight `[channels, kernel]`, input `[.., channels]`, state
/// `[channels, kernel - 1]` in `activation_dtype`; returns `(channels, kernel)`.
pub fn causal_conv1d<B: Device>(b: &B, x: &Tensor<B>, w: &Tensor<B>, state: &Tensor<B>) -> Result<(usize, usize)> {
    let op = "causal_conv1d";
    let &[channels, kernel] = w.shape() else {
        return Err(error(b, op, format_args!("weight must be [channels, kernel], found {:?}", w.shape())));
    };
    ensure(
        b,
        x.last_dim() == channels
            && kernel >= 1
            && state.shape() == [channels, kernel - 1]
            && state.dtype() == b.activation_dtype(),
        op,
        || format!("input {:?}, weight {:?}, state {} {:?}", x.shape(), w.shape(), state.dtype(), state.shape()),
    )?;
    Ok((channels, kernel))
}

/// `FusedOps::gated_delta_waves`: `waves` non-empty, non-increasing, none empty, the first one
/// every sequence, as many rows in `step`'s per-row inputs as the waves hold, and `firsts` none
/// or one per sequence, each of its sequence's shapes and dtypes; returns the rows.
pub fn gdn_waves<B: Device>(
    b: &B,
    waves: &[usize],
    states: &[GdnState<'_, B>],
    firsts: &[Option<GdnState<'_, B>>],
    step: &GdnStep<'_, B>,
) -> Result<usize> {
    let seqs = states.len();
    let like = |t: &Tensor<B>, u: &Tensor<B>| t.shape() == u.shape() && t.dtype() == u.dtype();
    let fit = firsts.is_empty()
        || firsts.len() == seqs
            && (states.iter().zip(firsts))
                .all(|(s, f)| f.as_ref().is_none_or(|f| like(s.conv, f.conv) && like(s.recurrent, f.recurrent)));
    ensure(b, fit, "gated_delta_waves", || {
        format!("{} first-position states for {seqs} sequences, each of its sequence's shapes", firsts.len())
    })?;
    let rows: usize = waves.iter().sum();
    let ordered = waves.first() == Some(&seqs) && waves.windows(2).all(|w| w[1] <= w[0]) && !waves.contains(&0);
    ensure(b, ordered, "gated_delta_waves", || format!("waves {waves:?} for {seqs} sequences"))?;
    let per_row = [step.qkv, step.a, step.b].iter().all(|t| t.shape().first() == Some(&rows));
    ensure(b, per_row, "gated_delta_waves", || {
        format!(
            "{rows} rows of waves {waves:?} with qkv {:?}, a {:?}, b {:?}",
            step.qkv.shape(),
            step.a.shape(),
            step.b.shape()
        )
    })?;
    Ok(rows)
}

/// `KvOps::attention`: a sliding window holds at least one position.
pub fn window<B: Device>(b: &B, op: &str, window: Option<usize>) -> Result<()> {
    ensure(b, window != Some(0), op, || "a sliding window of 0 positions".into())
}

/// A call writing `t` positions through `seq` into a pool layer of `blocks` blocks of `block`
/// positions: the table covers positions `..seq.start + t`, and every block a query of the call
/// can see (from the first query's window on) is one of the layer's.
pub fn kv_table<B: Device>(
    b: &B,
    op: &str,
    seq: &KvSeq<'_>,
    t: usize,
    block: usize,
    blocks: usize,
    window: Option<usize>,
) -> Result<()> {
    let end = seq.start + t;
    ensure(b, block > 0 && seq.table.len() * block >= end, op, || {
        format!("a table of {} blocks of {block} positions for positions up to {end}", seq.table.len())
    })?;
    let first = window.map_or(0, |w| (seq.start + 1).saturating_sub(w));
    let seen = &seq.table[first / block..end.div_ceil(block)];
    match seen.iter().find(|&&id| id as usize >= blocks) {
        Some(&bad) if bad == RELEASED => {
            Err(error(b, op, format!("positions {first}..{end} are visible but a block of theirs was released")))
        }
        Some(&bad) => Err(error(b, op, format!("block {bad} in a table of a pool layer of {blocks} blocks"))),
        None => Ok(()),
    }
}

/// Shapes of one `KvOps::attention` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub t: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `KvOps::attention`: q `[t, q_heads, d]`, k and v `[t, kv_heads, d]`, `q_heads` a multiple of
/// `kv_heads`, a window of at least one position. (Whether they fit the pool layer is the
/// backend's: the pool is its type; `kv_table` checks the table against it.)
pub fn attention<B: Device>(
    b: &B,
    q: &Tensor<B>,
    k: &Tensor<B>,
    v: &Tensor<B>,
    params: &AttentionParams,
) -> Result<AttentionDims> {
    let op = "attention";
    let (t, q_heads, head_dim) = q.dims3(b.name(), op)?;
    let kv_heads = k.shape().get(1).copied().unwrap_or(0);
    ensure(
        b,
        k.shape() == [t, kv_heads, head_dim] && v.shape() == k.shape() && kv_heads > 0 && q_heads % kv_heads == 0,
        op,
        || format!("q {:?}, k {:?}, v {:?}", q.shape(), k.shape(), v.shape()),
    )?;
    window(b, op, params.window)?;
    Ok(AttentionDims { t, q_heads, kv_heads, head_dim })
}

/// Shapes of one `Ops::moe` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
}

/// `Ops::moe`: input `[.., hidden]`, a router `[experts, hidden]`, top-k in `1..=experts`, a
/// correction bias of one value per expert and a positive softcap where the router has them.
pub fn moe<B: Device>(b: &B, x: &Tensor<B>, router: &Router<B>, experts: &MoeExperts<B>) -> Result<MoeDims> {
    let op = "moe";
    let (hidden, n_exp) = (experts.hidden, experts.routed);
    ensure(b, experts.first + experts.experts.len() <= n_exp, op, || {
        format!("experts {}..{} of a layer of {n_exp}", experts.first, experts.first + experts.experts.len())
    })?;
    let (out, inp) = router.weight.weight.dims();
    ensure(b, x.last_dim() == hidden && out == n_exp && inp == hidden, op, || {
        format!("input {:?}, router [{out}, {inp}], {n_exp} experts of hidden {hidden}", x.shape())
    })?;
    let top_k = router.kind.top_k();
    ensure(b, (1..=n_exp).contains(&top_k), op, || format!("top-k {top_k} with {n_exp} experts"))?;
    if let RouterKind::Sigmoid { softcap: Some(cap), .. } = router.kind {
        ensure(b, cap > 0.0, op, || format!("router softcap {cap} must be positive"))?;
    }
    if let Some(c) = &router.correction_bias {
        ensure(b, c.numel() == n_exp && c.dtype().is_float(), op, || {
            format!("correction bias {} {:?} for {n_exp} experts", c.dtype(), c.shape())
        })?;
    }
    Ok(MoeDims { hidden, intermediate: experts.intermediate, experts: n_exp, top_k })
}

/// A backend whose MoE kernels index every expert of a layer: an error for one rank's part
/// (expert parallelism), naming the op.
pub fn whole_experts<B: Device>(b: &B, experts: &MoeExperts<B>, op: &str) -> Result<()> {
    ensure(b, experts.is_whole(), op, || {
        format!(
            "experts {}..{} of {} (expert parallelism) are not supported by this backend yet",
            experts.first,
            experts.first + experts.experts.len(),
            experts.routed
        )
    })
}

impl<B: Device> GdnInputs<'_, B> {
    /// `Ops::gated_delta_rule`: the call's shapes, after checking every input against each other
    /// and against `state` (f32 `[value_heads, key_dim, value_dim]`); the error names every shape.
    pub fn dims(&self, b: &B, state: &Tensor<B>) -> Result<GdnDims> {
        let shapes = || {
            format!(
                "q {:?}, k {:?}, v {:?}, a {:?}, b {:?}, a_log {:?}, dt_bias {:?}, state {} {:?}",
                self.q.shape(),
                self.k.shape(),
                self.v.shape(),
                self.a.shape(),
                self.b.shape(),
                self.a_log.shape(),
                self.dt_bias.shape(),
                state.dtype(),
                state.shape()
            )
        };
        let op = "gated_delta_rule";
        let (&[t, key_heads, key_dim], &[tv, value_heads, value_dim]) = (self.q.shape(), self.v.shape()) else {
            return Err(error(b, op, shapes()));
        };
        let ok = self.k.shape() == self.q.shape()
            && tv == t
            && key_heads > 0
            && value_heads % key_heads == 0
            && self.a.numel() == t * value_heads
            && self.b.numel() == t * value_heads
            && self.a_log.numel() == value_heads
            && self.dt_bias.numel() == value_heads
            && state.shape() == [value_heads, key_dim, value_dim]
            && state.dtype() == DType::F32;
        ensure(b, ok, op, shapes)?;
        Ok(GdnDims { t, key_heads, value_heads, key_dim, value_dim })
    }
}
