//! The op-by-op parity tests, one body each, that every GPU backend runs against vt-cpu (its
//! tests/ops.rs instantiates them with `op_tests!`): each op on fresh random inputs, rounded to
//! bf16 first so that both backends see the same values and the difference is the device's
//! arithmetic alone. Shapes are chosen to take each path of the backends' kernels (vt-cuda's
//! tiles, splits and launch limits are named where they decide a shape); a backend with fewer
//! paths runs them all the same.
//!
//! Error measure: max |gpu - cpu| / max |cpu|, against a bound counted in the device's `u`
//! (`OnDevice`): one rounding of an op's output; composed ops that round intermediates on the way
//! take a multiple, said where it is used.

use vt_core::backend::prelude::*;
use vt_core::backend::Pick;
use vt_core::{
    AttentionParams, DType, GateAct, GdnInputs, GdnMode, GdnState, GdnStep, KvLayout, KvSeq, Linear, NormKind, Rope,
    Router, RouterKind, SharedExpert, Tensor,
};
use vt_cpu::CpuBackend;

use super::*;
use crate::on_both;

/// Sequences of one pool layer as an engine keeps them: block tables filled as positions arrive
/// from a shuffled list of the pool's blocks (a sequence's blocks are neither contiguous nor in
/// order, and blocks given back are taken again by others), and with a window each block wholly
/// behind every later query's window pointed at a poison block, whose keys and values are 50 times
/// the others': a kernel that read one would be far off.
struct Tables {
    block: usize,
    window: Option<usize>,
    free: Vec<u32>,
    poison: u32,
    tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
}

impl Tables {
    /// `seqs` empty sequences in a one-layer pool of `blocks` blocks of `b`, heads `(hkv, d)`, its
    /// poison block written.
    fn new<B: Backend>(
        b: &B,
        seqs: usize,
        (hkv, d): (usize, usize),
        blocks: usize,
        window: Option<usize>,
        r: &mut Rng,
    ) -> (Self, B::KvPool) {
        let block = b.kv_block_size();
        let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: hkv, head_dim: d, blocks }]).unwrap();
        let mut free = r.shuffled(blocks);
        let poison = free.pop().unwrap();
        let (kp, vp) = (r.vec(block * hkv * d, 100.0), r.vec(block * hkv * d, 100.0));
        let params = AttentionParams { scale: 1.0, window: None };
        let seq = KvSeq { layer: 0, table: &[poison], start: 0 };
        let zero = act(b, &[block, hkv, d], &vec![0.0; block * hkv * d]);
        let (kp, vp) = (act(b, &[block, hkv, d], &kp), act(b, &[block, hkv, d], &vp));
        b.attention(&zero, &kp, &vp, &mut pool, seq, &params).unwrap();
        (Tables { block, window, free, poison, tables: vec![Vec::new(); seqs], lens: vec![0; seqs] }, pool)
    }

    /// Blocks for sequence `i`'s next `t` positions.
    fn grow(&mut self, i: usize, t: usize) {
        while self.tables[i].len() * self.block < self.lens[i] + t {
            let b = self.free.pop().expect("the test's pool holds every sequence");
            self.tables[i].push(b);
        }
    }

    fn seq(&self, i: usize) -> KvSeq<'_> {
        KvSeq { layer: 0, table: &self.tables[i], start: self.lens[i] }
    }

    /// Each sequence's first `lens[i]` positions into `pool` with one attention call each, taking
    /// the rows in turn from `rows(at, t)` (q, k, v); returns the rows taken.
    fn prefill<B: Backend>(
        &mut self,
        b: &B,
        pool: &mut B::KvPool,
        lens: &[usize],
        rows: impl Fn(usize, usize) -> (Tensor<B>, Tensor<B>, Tensor<B>),
        params: &AttentionParams,
    ) -> usize {
        let mut at = 0;
        for (i, &len) in lens.iter().enumerate() {
            let (qt, kt, vt) = rows(at, len);
            self.grow(i, len);
            b.attention(&qt, &kt, &vt, pool, self.seq(i), params).unwrap();
            self.advance(i, len);
            at += len;
        }
        at
    }

    /// Sequence `i` has taken `t` more positions: blocks no later query sees are given back.
    fn advance(&mut self, i: usize, t: usize) {
        self.lens[i] += t;
        let Some(w) = self.window else { return };
        let seen_from = (self.lens[i] + 1).saturating_sub(w);
        for e in &mut self.tables[i][..seen_from / self.block] {
            if *e != self.poison {
                self.free.push(*e);
                *e = self.poison;
            }
        }
    }
}

/// Rows `at..at + t` of an attention test's q `[.., hq, d]`, k and v `[.., hkv, d]`, on `b`.
fn qkv_rows<B: Backend>(
    b: &B,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (hq, hkv, d): (usize, usize, usize),
    at: usize,
    t: usize,
) -> (Tensor<B>, Tensor<B>, Tensor<B>) {
    (
        act(b, &[t, hq, d], &q[at * hq * d..(at + t) * hq * d]),
        act(b, &[t, hkv, d], &k[at * hkv * d..(at + t) * hkv * d]),
        act(b, &[t, hkv, d], &v[at * hkv * d..(at + t) * hkv * d]),
    )
}

/// Attention with heads `(hq, hkv, d)` of `seqs` sequences taking `steps` tokens per call in
/// turn, into one pool layer, on both backends (`q`, `k`, `v` hold every call's rows in the order
/// of the calls): every call's output.
#[allow(clippy::too_many_arguments)]
fn attention_steps<G: Backend>(
    dev: &OnDevice<G>,
    op: &str,
    bound: f32,
    seqs: usize,
    steps: &[usize],
    (hq, hkv, d): (usize, usize, usize),
    window: Option<usize>,
    (q, k, v): (&[f32], &[f32], &[f32]),
) {
    let params = AttentionParams { scale: (d as f32).powf(-0.5), window };
    let len: usize = steps.iter().sum();
    on_both!(dev, &format!("{op} [{hq}, {hkv}, {d}] window {window:?}, {seqs} sequences"), bound, |b| {
        let blocks = seqs * (len.div_ceil(b.kv_block_size()) + 1) + 1;
        let (mut tables, mut pool) = Tables::new(b, seqs, (hkv, d), blocks, window, &mut Rng(7));
        let (mut s, mut all) = (0, Vec::new());
        for &n in steps {
            for i in 0..seqs {
                let qt = act(b, &[n, hq, d], &q[s * hq * d..(s + n) * hq * d]);
                let kt = act(b, &[n, hkv, d], &k[s * hkv * d..(s + n) * hkv * d]);
                let vt = act(b, &[n, hkv, d], &v[s * hkv * d..(s + n) * hkv * d]);
                tables.grow(i, n);
                all.extend(out(b, &b.attention(&qt, &kt, &vt, &mut pool, tables.seq(i), &params).unwrap()));
                tables.advance(i, n);
                s += n;
            }
        }
        all
    });
}

/// The form a model takes for a call of `n` tokens: chunked for a prompt, recurrent for one token.
fn by_length(n: usize) -> GdnMode {
    if n == 1 {
        GdnMode::Recurrent
    } else {
        GdnMode::Chunked
    }
}

/// The gated delta rule with heads `(kh, vh, dk, dv)` over `steps` tokens per call, each call in
/// the form `form` gives its length, from a zero state, on both backends: every call's output, then
/// the final state.
fn gated_delta_rule_steps<G: Backend>(
    dev: &OnDevice<G>,
    r: &mut Rng,
    op: &str,
    steps: &[usize],
    (kh, vh, dk, dv): (usize, usize, usize, usize),
    form: fn(usize) -> GdnMode,
) {
    let total: usize = steps.iter().sum();
    let (q, k, v) = (r.vec(total * kh * dk, 1.0), r.vec(total * kh * dk, 1.0), r.vec(total * vh * dv, 1.0));
    let (a, bb) = (r.vec(total * vh, 2.0), r.vec(total * vh, 2.0));
    let (a_log, dt_bias) = (r.vec(vh, 1.0), r.vec(vh, 1.0));
    on_both!(dev, &format!("{op} [{kh}, {vh}, {dk}, {dv}]"), dev.u, |b| {
        let mut state = b.zeros_f32(&[vh, dk, dv]).unwrap();
        let (al, dt) = (small(b, &a_log), small(b, &dt_bias));
        let (mut s, mut all) = (0, Vec::new());
        for &n in steps {
            let qt = act(b, &[n, kh, dk], &q[s * kh * dk..(s + n) * kh * dk]);
            let kt = act(b, &[n, kh, dk], &k[s * kh * dk..(s + n) * kh * dk]);
            let vt = act(b, &[n, vh, dv], &v[s * vh * dv..(s + n) * vh * dv]);
            let at = act(b, &[n, vh], &a[s * vh..(s + n) * vh]);
            let btt = act(b, &[n, vh], &bb[s * vh..(s + n) * vh]);
            let inputs = GdnInputs { q: &qt, k: &kt, v: &vt, a: &at, b: &btt, a_log: &al, dt_bias: &dt };
            all.extend(out(b, &b.gated_delta_rule(&inputs, &mut state, form(n)).unwrap()));
            s += n;
        }
        all.extend(out(b, &state));
        all
    });
}

/// `linear` of weight `hw` (`[n, k]`) on fresh inputs of each of `ts` rows, on both backends.
fn linear_rows<G: Backend>(
    dev: &OnDevice<G>,
    r: &mut Rng,
    op: &str,
    hw: &HostWeight,
    (n, k): (usize, usize),
    ts: &[usize],
) {
    for &t in ts {
        let x = r.vec(t * k, 2.0);
        on_both!(dev, &format!("{op} {} [{n}, {k}] t={t}", hw.name()), dev.u, |b| {
            let lin = Linear::new(b, hw.upload(b)).unwrap();
            out(b, &b.linear(&act(b, &[t, k], &x), &lin).unwrap())
        });
    }
}

/// A vocabulary-sized embedding and lm_head (1000 rows of 64, each format): on an adapter whose
/// storage bindings are smaller than the table (vt-wgpu's tests request such a device), a range
/// of rows at a time. Ids reach the first and last rows; few tokens, as a decode step's lm_head.
pub fn embedding_and_lm_head_of_a_large_vocabulary<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x70ca);
    let (vocab, d) = (1000, 64);
    let table = r.vec(vocab * d, 1.0);
    let ids = [999u32, 0, 511, 512, 3, 998, 640];
    on_both!(dev, "embedding bf16 of a large vocabulary", dev.u, |b| {
        out(b, &b.embedding(&b.upload(DType::BF16, &[vocab, d], &bf16_bytes(&table)).unwrap(), &ids).unwrap())
    });
    on_both!(dev, "embedding f32 of a large vocabulary", dev.u, |b| {
        out(b, &b.embedding(&b.upload(DType::F32, &[vocab, d], bytemuck_f32(&table)).unwrap(), &ids).unwrap())
    });
    let weights = [
        HostWeight::bf16(&mut r, vocab, d),
        HostWeight::f32(&mut r, vocab, d),
        HostWeight::nvfp4(&mut r, vocab, d),
        HostWeight::fp8(&mut r, vocab, d, [8, 16]),
    ];
    for hw in &weights {
        linear_rows(dev, &mut r, "lm_head", hw, (vocab, d), &[1, 3]);
    }
}

pub fn elementwise_and_norm_ops<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x1234_5678);
    let (t, d) = (37, 160);
    let (x, y, w) = (r.vec(t * d, 3.0), r.vec(t * d, 3.0), r.vec(d, 1.0));
    let table = r.vec(50 * d, 1.0);
    let ids = [3u32, 49, 0, 7, 7];
    on_both!(dev, "embedding", dev.u, |b| {
        out(b, &b.embedding(&b.upload(DType::BF16, &[50, d], &bf16_bytes(&table)).unwrap(), &ids).unwrap())
    });
    for kind in [NormKind::Plain, NormKind::UnitOffset] {
        on_both!(dev, &format!("rms_norm {kind:?}"), dev.u, |b| {
            out(b, &b.rms_norm(&act(b, &[t, d], &x), &small(b, &w), 1e-6, kind).unwrap())
        });
    }
    on_both!(dev, "rms_norm_gated", dev.u, |b| {
        out(b, &b.rms_norm_gated(&act(b, &[t, d], &x), &act(b, &[t, d], &y), &small(b, &w), 1e-6).unwrap())
    });
    on_both!(dev, "add", dev.u, |b| { out(b, &b.add(&act(b, &[t, d], &x), &act(b, &[t, d], &y)).unwrap()) });
    on_both!(dev, "swiglu", dev.u, |b| { out(b, &b.swiglu(&act(b, &[t, d], &x), &act(b, &[t, d], &y)).unwrap()) });
    on_both!(dev, "gate sigmoid per element", dev.u, |b| {
        out(b, &b.gate(&act(b, &[t, d], &x), &act(b, &[t, d], &y), GateAct::Sigmoid).unwrap())
    });
    on_both!(dev, "gate softplus per group", dev.u, |b| {
        out(b, &b.gate(&act(b, &[t, d], &x), &act(b, &[t, 5], &y[..t * 5]), GateAct::Softplus).unwrap())
    });
    on_both!(dev, "narrow_cols", 0.0, |b| { out(b, &b.narrow_cols(&act(b, &[t, d], &x), 17, 40).unwrap()) });
    on_both!(dev, "slice_rows", 0.0, |b| { out(b, &b.slice_rows(&act(b, &[t, d], &x), 5, 9).unwrap()) });
    on_both!(dev, "concat_rows", 0.0, |b| {
        let (p, q) = (act(b, &[3, d], &x[..3 * d]), act(b, &[t, d], &y));
        out(b, &b.concat_rows(&[&p, &q]).unwrap())
    });
    on_both!(dev, "copy_into activation", 0.0, |b| {
        let mut dst = b.zeros(&[t, d]).unwrap();
        b.copy_into(&act(b, &[t, d], &x), &mut dst).unwrap();
        out(b, &dst)
    });
    on_both!(dev, "copy_into f32", 0.0, |b| {
        let mut dst = b.zeros_f32(&[4, d]).unwrap();
        b.copy_into(&b.upload(DType::F32, &[4, d], bytemuck_f32(&y[..4 * d])).unwrap(), &mut dst).unwrap();
        out(b, &dst)
    });
    // An odd number of 2-byte values: a copy in 4-byte words must not spill past them.
    on_both!(dev, "copy_into bf16", 0.0, |b| {
        let mut dst = b.upload(DType::BF16, &[3], &bf16_bytes(&[0.0; 3])).unwrap();
        b.copy_into(&small(b, &w[..3]), &mut dst).unwrap();
        out(b, &dst)
    });
    // Many pairs at once (a step's snapshots): activations, f32 states, a tail of 6 bytes.
    on_both!(dev, "copy_many", 0.0, |b| {
        let (p, q, r) =
            (act(b, &[t, d], &x), b.upload(DType::F32, &[4, d], bytemuck_f32(&y[..4 * d])).unwrap(), small(b, &w[..3]));
        let mut dsts = [
            b.zeros(&[t, d]).unwrap(),
            b.zeros_f32(&[4, d]).unwrap(),
            b.upload(DType::BF16, &[3], &bf16_bytes(&[0.0; 3])).unwrap(),
        ];
        let [dp, dq, dr] = &mut dsts;
        b.copy_many(&mut [(&p, dp), (&q, dq), (&r, dr)]).unwrap();
        dsts.iter().flat_map(|t| out(b, t)).collect()
    });
    // Partial rotary (rotary dim 12 of head dim 16) with YaRN-style scaling, from position 1000.
    let rope = Rope { inv_freq: (0..6).map(|i| 10000f32.powf(-(i as f32) / 6.0)).collect(), attention_scaling: 1.15 };
    on_both!(dev, "rope", dev.u, |b| { out(b, &b.rope(&act(b, &[t, 10, 16], &x), 1000, &rope).unwrap()) });
}

pub fn linear_every_weight_format<G: Backend>(dev: &OnDevice<G>) {
    let gpu = &dev.backend;
    let mut r = Rng(0xfeed);
    // Aligned shapes go to cuBLASLt, the rest (n = 1, 6: per-head gates) to the simple kernel.
    // NVFP4 needs whole 16-input scale groups: Nvfp4::new refuses k = 72 (before a backend lays
    // the parts out).
    for (n, k) in [(96, 64), (307, 160), (24, 512), (1, 72), (6, 80)] {
        if k % 16 != 0 {
            let codes = gpu.upload(DType::F4x2, &[n, k], &r.bytes(n * k / 2)).unwrap();
            let scales = gpu.upload(DType::F8E4M3, &[n, k / 16], &r.bytes(n * (k / 16))).unwrap();
            let err = vt_core::Nvfp4::new(gpu, "w", codes, scales, 1.0).err().expect("NVFP4 k = 72 refused");
            assert!(err.to_string().contains("72"), "{err}");
        }
        let nvfp4 = (k % 16 == 0).then(|| HostWeight::nvfp4(&mut r, n, k));
        // FP8 in Qwen's 128 x 128 blocks (partial here) and in blocks that split every shape.
        let fp8 = [[128, 128], [16, 48]].map(|block| HostWeight::fp8(&mut r, n, k, block));
        let dense = [HostWeight::bf16(&mut r, n, k), HostWeight::f32(&mut r, n, k)];
        for hw in dense.into_iter().chain(nvfp4).chain(fp8) {
            // 520 rows: vt-cuda's NVFP4 prefill through a bf16 copy of the weight and cuBLASLt.
            linear_rows(dev, &mut r, "linear", &hw, (n, k), &[1, 37, 111, 520]);
        }
    }
}

pub fn attention_full_and_windowed_across_calls<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xa77e);
    // Head shapes of a generic GQA layer and of the qwen35moe fixtures.
    for (hq, hkv, d) in [(6, 2, 32), (4, 2, 40)] {
        // A prefill longer than the window, then two single-token steps and a short chunk.
        let steps = [70usize, 1, 1, 5];
        let total = 2 * steps.iter().sum::<usize>();
        let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
        for window in [None, Some(16)] {
            attention_steps(dev, "attention", dev.attention_bound(d), 2, &steps, (hq, hkv, d), window, (&q, &k, &v));
        }
    }
}

pub fn conv_and_gated_delta_rule_across_calls<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x6d4e);
    let (c, kern) = (48, 4);
    let steps = [19usize, 1, 2, 1];
    let total: usize = steps.iter().sum();
    let (x, w) = (r.vec(total * c, 2.0), r.vec(c * kern, 0.7));
    on_both!(dev, "causal_conv1d", dev.u, |b| {
        let wt = b.upload(DType::BF16, &[c, kern], &bf16_bytes(&w)).unwrap();
        let mut state = b.zeros(&[c, kern - 1]).unwrap();
        let (mut s, mut all) = (0, Vec::new());
        for &n in &steps {
            all.extend(out(b, &b.causal_conv1d(&act(b, &[n, c], &x[s * c..(s + n) * c]), &wt, &mut state).unwrap()));
            s += n;
        }
        all.extend(out(b, &state));
        all
    });
    // A generic head layout and those of the qwen35moe fixtures.
    for heads in [(2, 4, 32, 48), (2, 4, 24, 20), (2, 6, 20, 28)] {
        gated_delta_rule_steps(dev, &mut r, "gated_delta_rule", &[70, 1, 1, 3], heads, by_length);
    }
}

pub fn moe_every_router_and_expert_format<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x30e);
    let (t, h, inter, n_exp) = (29, 64, 32, 8);
    let kinds = [
        RouterKind::Softmax { top_k: 2, renormalize: true },
        RouterKind::Softmax { top_k: 3, renormalize: false },
        RouterKind::Sigmoid { top_k: 2, softcap: Some(3.0), renormalize: true, routed_scaling: 2.5 },
    ];
    let x = r.vec(t * h, 2.0);
    let router_w = HostWeight::bf16(&mut r, n_exp, h);
    let bias = r.vec(n_exp, 0.1);
    for format in ["bf16", "nvfp4", "fp8"] {
        let experts = host_experts(&mut r, format, n_exp, h, inter);
        // bf16 and NVFP4 take the grouped prefill path, which rounds the SwiGLU activations to
        // bf16; FP8 the general kernels (f32 activations).
        let bound = 2.0 * dev.u;
        for kind in &kinds {
            on_both!(dev, &format!("moe {format} {kind:?}"), bound, |b| {
                let moe = upload_experts(b, &experts, h, inter);
                let router = router(b, &router_w, kind, &bias);
                // Twice: the second call reads the resident expert table built by the first.
                let first = out(b, &b.moe(&act(b, &[t, h], &x), &router, &moe).unwrap());
                assert_eq!(first, out(b, &b.moe(&act(b, &[t, h], &x), &router, &moe).unwrap()));
                first
            });
        }
    }
}

pub fn every_routing_ranks_a_nan_choice_last<G: Backend>(dev: &OnDevice<G>) {
    // Expert 0's router row is NaN, so a sigmoid router's choice for it is NaN, which vt-cpu ranks
    // after every number (and a softmax would make every probability NaN). Each CUDA router kernel
    // (all three call kernels/route.cuh) must leave expert 0 out as vt-cpu does: the general path's
    // (one token, or 12 experts, which the grouped path does not take), the grouped prefill's (29
    // tokens over 8 experts) and the fused decode block's (3 tokens).
    let mut r = Rng(0x7a7);
    let (h, inter) = (64, 32);
    let kind = RouterKind::Sigmoid { top_k: 3, softcap: None, renormalize: true, routed_scaling: 1.0 };
    for (t, n_exp, decode) in [(1, 8, false), (5, 12, false), (29, 8, false), (3, 8, true)] {
        let x = r.vec(t * h, 2.0);
        let mut router_w = HostWeight::bf16(&mut r, n_exp, h);
        if let HostWeight::Bf16 { v, .. } = &mut router_w {
            v[..h].fill(f32::NAN);
        }
        let experts = host_experts(&mut r, "bf16", n_exp, h, inter);
        let path = if decode { "moe_block" } else { "moe" };
        // The grouped path rounds the SwiGLU activations to bf16 (moe_every_router_and_expert_format).
        on_both!(dev, &format!("{path} with a NaN router row, t={t}, {n_exp} experts"), 2.0 * dev.u, |b| {
            let moe = upload_experts(b, &experts, h, inter);
            let router = Router {
                weight: Linear::new(b, router_w.upload(b)).unwrap(),
                kind: kind.clone(),
                correction_bias: None,
            };
            let xt = act(b, &[t, h], &x);
            let y = if decode { b.moe_block(&xt, &router, &moe, None) } else { b.moe(&xt, &router, &moe) };
            out(b, &y.unwrap())
        });
    }
}

// ---- Prefill kernels (grouped MoE GEMMs, flash attention, chunked GDN) on the shapes they take ----

pub fn attention_flash_prefill<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xf1a5);
    // A prefill of several query tiles (longer than the window), a continuation over the pool,
    // a decode step and a short chunk, of three sequences in turn.
    let steps = [150usize, 70, 1, 3];
    let total = 3 * steps.iter().sum::<usize>();
    // Blocks take 1, 2, 4 or 8 heads of a KV group (qwen3.5's 16 / 2 at d = 256 takes 8); at
    // d = 128 a warp's two row tiles are 32 queries of one head (4 heads a block) or of 128.
    for (hq, hkv, d) in [(4, 2, 64), (4, 1, 128), (6, 2, 128), (2, 2, 256), (6, 2, 256), (16, 2, 256)] {
        let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
        for window in [None, Some(100)] {
            let bound = dev.attention_bound(d);
            attention_steps(dev, "attention flash", bound, 3, &steps, (hq, hkv, d), window, (&q, &k, &v));
        }
    }
    // A short chunk over a long cached context (a prefix-cache hit's rest of the prompt): too few
    // query blocks to fill a GPU, so vt-cuda splits the keys (12 and 18 key tiles: 3 and 4 splits,
    // the last shorter) and merges the splits' partials.
    for (steps, (hq, hkv, d)) in [([700usize, 16], (16, 2, 256)), ([1100, 20], (4, 1, 128))] {
        let total = 2 * steps.iter().sum::<usize>();
        let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
        for window in [None, Some(500)] {
            let bound = dev.attention_bound(d);
            attention_steps(dev, "attention flash, split keys", bound, 2, &steps, (hq, hkv, d), window, (&q, &k, &v));
        }
    }
}

pub fn gated_delta_rule_chunked_prefill<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xc4c4);
    // Three chunks (the last partial), a decode step, then a chunk from a non-zero state.
    for heads in [(2, 4, 128, 128), (1, 2, 128, 64)] {
        gated_delta_rule_steps(dev, &mut r, "gated_delta_rule chunked", &[150, 1, 70], heads, by_length);
    }
}

/// At Qwen3.5-35B-A3B's head dimensions (dk = dv = 128, two value heads a key head): the
/// token-by-token form over many tokens in one call, then over many one-token calls (decode),
/// and the chunked form over a prompt of five chunks. Each is longer than one invocation of a
/// kernel that walks through the tokens may take on lavapipe (llvmpipe ends a shader's loops
/// after 65535 iterations in all: ~100 tokens token by token, ~2 chunks of the state pass),
/// where vt-wgpu's outputs went to zero beyond that point.
pub fn gated_delta_rule_long_at_model_heads<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x7e5c);
    let heads = (2, 4, 128, 128);
    gated_delta_rule_steps(dev, &mut r, "gated_delta_rule recurrent", &[150], heads, |_| GdnMode::Recurrent);
    gated_delta_rule_steps(dev, &mut r, "gated_delta_rule decode steps", &[1; 150], heads, |_| GdnMode::Recurrent);
    gated_delta_rule_steps(dev, &mut r, "gated_delta_rule chunked", &[300, 40], heads, |_| GdnMode::Chunked);
}

// ---- Decode kernels (GEMV, fused MoE block, fused GDN step, split-KV attention, random fill) ----

pub fn linear_decode_gemv_few_tokens<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x6e3f);
    // Rows not a multiple of a block's rows, inputs of several 4-chunk batches and a tail; few
    // rows (each row's chunks split over 4 warps), more (over 2) and many (a warp per row pair);
    // lm_head-like rows, where one token takes the t <= 8 kernel. From 3 tokens bf16 rows take the
    // tensor-core kernels (one 16-row tile a block, two from 8192 rows; 12 and 16 tokens two
    // 8-token column tiles), except rows of 520 and 208 inputs (not whole 32-input chunks), which
    // stay on the CUDA cores (and past 8 tokens go to cuBLASLt). vt-cuda's NVFP4 takes its
    // tensor-core GEMV at every count (8-token column tiles, two past 8) in 16 x 64 tiles: rows
    // past a 16-row block, and inputs past a 64-input tile (96, 208, 4128: a last tile of 2, 1
    // and 2 k steps), are padding it must not count; a row block's tiles are split over 1 to 16
    // warps, and rows of 4128 inputs take a second round of tiles (kernels/gemv.cu). One token's
    // layers of up to GEMV_NV4S_MAX_PER row blocks an SM (9001 rows here: 5, the last block's
    // partial) take the kernel that holds a block's weights in shared memory, 33001 and 70001 rows
    // the block per row block.
    for (n, k) in
        [(37, 1024), (300, 96), (8, 4096), (24, 4128), (9001, 256), (33001, 64), (70001, 64), (45, 520), (21, 208)]
    {
        let mut weights = vec![HostWeight::bf16(&mut r, n, k)];
        if k % 16 == 0 {
            weights.push(HostWeight::nvfp4(&mut r, n, k));
        }
        for hw in weights {
            linear_rows(dev, &mut r, "linear gemv", &hw, (n, k), &[1, 2, 3, 8, 12, 16]);
        }
    }
}

pub fn linear_many_shares_one_pass_over_the_input<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x3a11);
    let k = 256;
    // A mixer's projections: outputs of different widths (one a single row, one a block tail) in
    // one launch; then a mixed-format group, formats interleaved (as an NVFP4 gated delta net's
    // projections and its bf16 gate rows), which vt-cuda runs a launch per format: each output
    // must still come back in its weight's place.
    let bf16 = [(512, k), (37, k), (1, k), (96, k)].map(|(n, k)| HostWeight::bf16(&mut r, n, k));
    let mixed = [
        HostWeight::nvfp4(&mut r, 64, k),
        HostWeight::bf16(&mut r, 40, k),
        HostWeight::nvfp4(&mut r, 48, k),
        HostWeight::bf16(&mut r, 1, k),
    ];
    for (group, ws) in [("bf16 x4", &bf16[..]), ("nvfp4 + bf16", &mixed[..])] {
        for t in [1, 5, 13] {
            let x = r.vec(t * k, 2.0);
            on_both!(dev, &format!("linear_many {group} t={t}"), dev.u, |b| {
                let lins: Vec<_> = ws.iter().map(|w| Linear::new(b, w.upload(b)).unwrap()).collect();
                let ys = b.linear_many(&act(b, &[t, k], &x), &lins.iter().collect::<Vec<_>>()).unwrap();
                assert_eq!(ys.len(), ws.len());
                ys.iter().flat_map(|y| out(b, y)).collect::<Vec<_>>()
            });
        }
    }
}

pub fn moe_block_decode_every_router_format_and_shared_expert<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xdec0);
    let kinds = [
        RouterKind::Softmax { top_k: 8, renormalize: true },
        RouterKind::Softmax { top_k: 3, renormalize: false },
        RouterKind::Sigmoid { top_k: 4, softcap: Some(3.0), renormalize: true, routed_scaling: 2.5 },
    ];
    let every_shared = [("none", 1), ("plain", 3), ("gated", 1), ("gated", 8)];
    // 40 experts, fewer than the routing block's 128 threads; 64 hidden, 32 intermediate: whole
    // NVFP4 chunks for every matrix. 300 experts: a routing block of 320 threads. Then a layer of
    // real proportions: 128 experts, rows of 1024 and 256 (several load rounds per lane, a down row
    // over many chunks), at 1, 8, 12 and 16 tokens (past 8, logits from the tensor-core GEMV).
    for (h, inter, n_exp, shared_cases) in [
        (64, 32, 40, &every_shared[..]),
        (64, 32, 300, &[("gated", 3)]),
        // Rows and inputs past whole 16 x 64 NVFP4 tiles (208 = 3 tiles and a step, 80 = 1 and 1).
        (208, 80, 24, &[("gated", 3)]),
        // vt-cuda's NVFP4 kernels in more than one round of tiles a warp: rows of 2112 inputs (33
        // tiles) for gate/up, and 9 slots of 528 (9 tiles each, the last partial) for down.
        (2112, 528, 24, &[("gated", 1), ("plain", 2)]),
        (1024, 256, 128, &[("gated", 1), ("gated", 8), ("plain", 12), ("gated", 16)]),
        // NVFP4 experts of more tokens than one fused call takes (vt-cuda: chunks of 16, the
        // last partial); the other formats' calls of 24 tokens take other paths, tested above.
        (1024, 256, 128, &[("gated", 24)]),
    ] {
        let router_w = HostWeight::bf16(&mut r, n_exp, h);
        let (bias, gate_w) = (r.vec(n_exp, 0.1), HostWeight::bf16(&mut r, 1, h));
        // FP8 experts take the composed ops (the general MoE and linear kernels), which store
        // in bf16 what the fused kernels keep in f32: the routed sum, the shared expert's gate,
        // up, SwiGLU and down outputs, its gated output and the final sum, seven roundings of u/2
        // on the way to an output: 4u. The fused bf16 kernels round once: u. vt-cuda's NVFP4 down
        // kernel also rounds the SwiGLU activations to bf16 for its tensor cores (its weights
        // enter them exactly): 2u, as the grouped prefill. NVFP4 experts beside a bf16 shared
        // expert (ModelOpt's Qwen3.5 exports): vt-cuda fuses the routed ones and composes the
        // shared one, the composed ops' roundings: 4u.
        for (format, shared_format) in [("bf16", "bf16"), ("nvfp4", "nvfp4"), ("fp8", "fp8"), ("nvfp4", "bf16")] {
            let bound = match (format, shared_format) {
                ("fp8", _) | ("nvfp4", "bf16") => 4.0 * dev.u,
                ("nvfp4", _) => 2.0 * dev.u,
                _ => dev.u,
            };
            let experts = host_experts(&mut r, format, n_exp, h, inter);
            let shared = host_experts(&mut r, shared_format, 1, h, inter).pop().expect("one expert");
            for kind in &kinds {
                for &(shared_kind, t) in shared_cases.iter().filter(|&&(_, t)| t <= 16 || format == "nvfp4") {
                    let x = r.vec(t * h, 2.0);
                    let op = format!(
                        "moe_block decode {format} [{h}, {inter}, {n_exp}] {kind:?} shared {shared_kind} \
                         {shared_format} t={t}"
                    );
                    on_both!(dev, &op, bound, |b| {
                        let moe = upload_experts(b, &experts, h, inter);
                        let sigmoid = matches!(kind, RouterKind::Sigmoid { .. });
                        let router = Router {
                            weight: Linear::new(b, router_w.upload(b)).unwrap(),
                            kind: kind.clone(),
                            correction_bias: sigmoid.then(|| small(b, &bias)),
                        };
                        let [sg, su, sd] = shared.each_ref().map(|w| Linear::new(b, w.upload(b)).unwrap());
                        let sgate = Linear::new(b, gate_w.upload(b)).unwrap();
                        let se = SharedExpert { gate: &sg, up: &su, down: &sd, gate_proj: Some(&sgate) };
                        let se = match shared_kind {
                            "none" => None,
                            "plain" => Some(SharedExpert { gate_proj: None, ..se }),
                            _ => Some(se),
                        };
                        let xt = act(b, &[t, h], &x);
                        let first = out(b, &b.moe_block(&xt, &router, &moe, se.as_ref()).unwrap());
                        assert_eq!(first, out(b, &b.moe_block(&xt, &router, &moe, se.as_ref()).unwrap()));
                        first
                    });
                }
            }
        }
    }
}

pub fn gated_delta_step_decode<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x9d57);
    let (dk, taps, steps) = (128, 4, 6);
    for (kh, vh) in [(2, 4), (1, 3)] {
        let channels = (2 * kh + vh) * dk;
        let qkv = r.vec(steps * channels, 2.0);
        let (a, bb) = (r.vec(steps * vh, 2.0), r.vec(steps * vh, 2.0));
        let (a_log, dt_bias, conv) = (r.vec(vh, 1.0), r.vec(vh, 1.0), r.vec(channels * taps, 0.7));
        on_both!(dev, &format!("gated_delta_step [{kh}, {vh}, {dk}, {dk}]"), dev.u, |b| {
            let mut state = b.zeros_f32(&[vh, dk, dk]).unwrap();
            let mut conv_state = b.zeros(&[channels, taps - 1]).unwrap();
            let (al, dt) = (small(b, &a_log), small(b, &dt_bias));
            let cw = b.upload(DType::BF16, &[channels, taps], &bf16_bytes(&conv)).unwrap();
            let mut all = Vec::new();
            for s in 0..steps {
                let x = act(b, &[1, channels], &qkv[s * channels..(s + 1) * channels]);
                let (at, btt) =
                    (act(b, &[1, vh], &a[s * vh..(s + 1) * vh]), act(b, &[1, vh], &bb[s * vh..(s + 1) * vh]));
                let step = GdnStep {
                    qkv: &x,
                    conv: &cw,
                    a: &at,
                    b: &btt,
                    a_log: &al,
                    dt_bias: &dt,
                    key_heads: kh,
                    key_dim: dk,
                    value_heads: vh,
                    value_dim: dk,
                };
                let mut seq = [GdnState { conv: &mut conv_state, recurrent: &mut state }];
                all.extend(out(b, &b.gated_delta_step(&step, &mut seq).unwrap()));
            }
            all.extend(out(b, &state));
            all.extend(out(b, &conv_state));
            all
        });
    }
}

/// Sequences as a batched decode step finds them: each at its own point (`solo[i]` single-token
/// steps of its own first), then `steps` steps of all of them together; more sequences than a
/// launch serves (SEQ_MAX = 64), so the batch splits.
pub fn gated_delta_step_batched_sequences<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xba7c);
    let (kh, vh, dk, taps, n, steps) = (1, 2, 128, 4, 67, 2);
    let channels = (2 * kh + vh) * dk;
    let solo: Vec<usize> = (0..n).map(|i| i % 3).collect();
    let solo_total: usize = solo.iter().sum();
    let (x_solo, x_all) = (r.vec(solo_total * channels, 2.0), r.vec(steps * n * channels, 2.0));
    let (ab_solo, ab_all) = (r.vec(2 * solo_total * vh, 2.0), r.vec(2 * steps * n * vh, 2.0));
    let (a_log, dt_bias, conv) = (r.vec(vh, 1.0), r.vec(vh, 1.0), r.vec(channels * taps, 0.7));
    on_both!(dev, &format!("gated_delta_step {n} sequences [{kh}, {vh}, {dk}, {dk}]"), dev.u, |b| {
        let (al, dt) = (small(b, &a_log), small(b, &dt_bias));
        let cw = b.upload(DType::BF16, &[channels, taps], &bf16_bytes(&conv)).unwrap();
        let mut states: Vec<_> =
            (0..n).map(|_| (b.zeros(&[channels, taps - 1]).unwrap(), b.zeros_f32(&[vh, dk, dk]).unwrap())).collect();
        // `rows` rows of inputs from `x` and `ab` (a then b) at row `at`, stepping `seqs`.
        let run = |seqs: &mut [GdnState<'_, _>], x: &[f32], ab: &[f32], at: usize| {
            let rows = seqs.len();
            let xt = act(b, &[rows, channels], &x[at * channels..(at + rows) * channels]);
            let ab = &ab[2 * at * vh..2 * (at + rows) * vh];
            let (at_, bt) = (act(b, &[rows, vh], &ab[..rows * vh]), act(b, &[rows, vh], &ab[rows * vh..]));
            let step = GdnStep {
                qkv: &xt,
                conv: &cw,
                a: &at_,
                b: &bt,
                a_log: &al,
                dt_bias: &dt,
                key_heads: kh,
                key_dim: dk,
                value_heads: vh,
                value_dim: dk,
            };
            out(b, &b.gated_delta_step(&step, seqs).unwrap())
        };
        let mut at = 0;
        for ((conv, recurrent), &k) in states.iter_mut().zip(&solo) {
            for _ in 0..k {
                run(&mut [GdnState { conv, recurrent }], &x_solo, &ab_solo, at);
                at += 1;
            }
        }
        let mut all = Vec::new();
        for s in 0..steps {
            let mut seqs: Vec<_> = states.iter_mut().map(|(conv, recurrent)| GdnState { conv, recurrent }).collect();
            all.extend(run(&mut seqs, &x_all, &ab_all, s * n));
        }
        for (conv, recurrent) in &states {
            all.extend(out(b, recurrent));
            all.extend(out(b, conv));
        }
        all
    });
}

/// A verification's delta rule: sequences stepping several positions in one call, in waves
/// (`gated_delta_waves`; more sequences than a launch serves, different lengths). Each backend's
/// waves must equal its own wave-by-wave `gated_delta_step` calls bit for bit (what makes a
/// verified position compute exactly what a decode step there computes), outputs and states, and
/// the states written after the first position (`firsts`, every other sequence) must equal the
/// states after the first wave's step, bit for bit. Key dim 128 takes CUDA's fused kernels (one
/// sequence of 4 positions, a batch-1 verification, their one launch), 32 its composed ops.
pub fn gated_delta_waves_equal_their_steps<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x3a7e);
    let taps = 4;
    let shapes = [(&[67, 66, 40, 3][..], (1, 2, 128)), (&[1, 1, 1, 1], (1, 2, 128)), (&[67, 66, 40, 3], (2, 2, 32))];
    for (waves, (kh, vh, dk)) in shapes {
        let (n, rows) = (waves[0], waves.iter().sum::<usize>());
        let channels = (2 * kh + vh) * dk;
        let x = r.vec(rows * channels, 2.0);
        let (a, bb) = (r.vec(rows * vh, 2.0), r.vec(rows * vh, 2.0));
        let (a_log, dt_bias, conv) = (r.vec(vh, 1.0), r.vec(vh, 1.0), r.vec(channels * taps, 0.7));
        on_both!(dev, &format!("gated_delta_waves {waves:?} [{kh}, {vh}, {dk}, {dk}]"), dev.u, |b| {
            let (al, dt) = (small(b, &a_log), small(b, &dt_bias));
            let cw = b.upload(DType::BF16, &[channels, taps], &bf16_bytes(&conv)).unwrap();
            let fresh = || -> Vec<_> {
                (0..n).map(|_| (b.zeros(&[channels, taps - 1]).unwrap(), b.zeros_f32(&[vh, dk, dk]).unwrap())).collect()
            };
            // Rows `at..at + len` of the inputs as a step.
            let inputs = |at: usize, len: usize| {
                let xt = act(b, &[len, channels], &x[at * channels..(at + len) * channels]);
                (
                    xt,
                    act(b, &[len, vh], &a[at * vh..(at + len) * vh]),
                    act(b, &[len, vh], &bb[at * vh..(at + len) * vh]),
                )
            };
            let full = inputs(0, rows);
            let step = GdnStep {
                qkv: &full.0,
                conv: &cw,
                a: &full.1,
                b: &full.2,
                a_log: &al,
                dt_bias: &dt,
                key_heads: kh,
                key_dim: dk,
                value_heads: vh,
                value_dim: dk,
            };
            // The states of every `every`-th sequence.
            let ends = |states: &[(_, _)], every: usize| -> Vec<f32> {
                (states.iter().step_by(every))
                    .flat_map(|(conv, recurrent)| [out(b, recurrent), out(b, conv)].concat())
                    .collect()
            };
            let (mut together, mut apart, mut at_first) = (fresh(), fresh(), fresh());
            let mut seqs: Vec<_> = together.iter_mut().map(|(conv, recurrent)| GdnState { conv, recurrent }).collect();
            let mut firsts: Vec<_> = (at_first.iter_mut().enumerate())
                .map(|(i, (conv, recurrent))| (i % 2 == 0).then_some(GdnState { conv, recurrent }))
                .collect();
            let mut all = out(b, &b.gated_delta_waves(&step, waves, &mut seqs, &mut firsts).unwrap());
            let (mut by_wave, mut after_first) = (Vec::new(), Vec::new());
            let mut at = 0;
            for &w in waves {
                let mut seqs: Vec<_> =
                    apart.iter_mut().take(w).map(|(conv, recurrent)| GdnState { conv, recurrent }).collect();
                let (qkv, a, beta) = inputs(at, w);
                let wave = GdnStep { qkv: &qkv, a: &a, b: &beta, ..step };
                by_wave.extend(out(b, &b.gated_delta_step(&wave, &mut seqs).unwrap()));
                if at == 0 {
                    after_first = ends(&apart, 2);
                }
                at += w;
            }
            drop((seqs, firsts));
            let end = ends(&together, 1);
            let firsts_end = ends(&at_first, 2);
            let same =
                |x: &[f32], y: &[f32]| x.len() == y.len() && x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same(&all, &by_wave) && same(&end, &ends(&apart, 1)), "waves differ from their steps");
            assert!(
                same(&firsts_end, &after_first),
                "the states after the first position differ from the first wave's"
            );
            all.extend(end);
            all.extend(firsts_end);
            all
        });
    }
}

/// Attention decode of many sequences in one call: sequences of different lengths (one position to
/// several splits, windows that released blocks or not) in shuffled blocks of one pool, q and k
/// rotated at each sequence's own position, more sequences than one launch of the old kernels took.
pub fn attention_decode_batched_sequences<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xa7b5);
    let (n, steps) = (67, 2);
    let lens: Vec<usize> = (0..n).map(|i| 1 + (i * 37) % 300).collect();
    let total: usize = lens.iter().sum::<usize>() + steps * n;
    for (hq, hkv, d) in [(16, 2, 256), (12, 2, 128), (8, 2, 96)] {
        let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
        // Partial rotary, as Qwen3.5's.
        let half = d / 8;
        let rope = Rope {
            inv_freq: (0..half).map(|i| 10000f32.powf(-(i as f32) / half as f32)).collect(),
            attention_scaling: 1.0,
        };
        for window in [None, Some(130)] {
            let params = AttentionParams { scale: (d as f32).powf(-0.5), window };
            let bound = dev.attention_bound(d);
            on_both!(
                dev,
                &format!("attention decode {n} sequences [{hq}, {hkv}, {d}] window {window:?}"),
                bound,
                |b| {
                    let rows = |at: usize, t: usize| qkv_rows(b, (&q, &k, &v), (hq, hkv, d), at, t);
                    let blocks = total.div_ceil(b.kv_block_size()) + 2 * n + 1;
                    let (mut tables, mut pool) = Tables::new(b, n, (hkv, d), blocks, window, &mut Rng(9));
                    let mut at = tables.prefill(b, &mut pool, &lens, rows, &params);
                    let mut all = Vec::new();
                    for _ in 0..steps {
                        let (qt, kt, vt) = rows(at, n);
                        for i in 0..n {
                            tables.grow(i, 1);
                        }
                        let seqs: Vec<KvSeq<'_>> = (0..n).map(|i| tables.seq(i)).collect();
                        all.extend(out(
                            b,
                            &b.attention_decode(&qt, &kt, &vt, &rope, &mut pool, &seqs, &params).unwrap(),
                        ));
                        for i in 0..n {
                            tables.advance(i, 1);
                        }
                        at += n;
                    }
                    all
                }
            );
        }
    }
}

/// A verification's rows in one `attention_decode` call: sequences at several consecutive
/// positions each (in waves: position j of every sequence that has one, then j + 1), each row
/// seeing the rows before it of its sequence, equal bit for bit to the waves as calls of their
/// own, and the pool as they leave it (a decode step after reads it). Short caches: every call
/// splits its positions alike, whatever its rows.
pub fn attention_decode_continues_rows<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xc047);
    // Cached positions and verified positions of each sequence.
    let (lens, verified) = ([5usize, 70, 130], [3usize, 1, 2]);
    let waves: Vec<Vec<usize>> = (0..3).map(|j| (0..3).filter(|&i| verified[i] > j).collect()).collect();
    let rows: usize = verified.iter().sum();
    let total = lens.iter().sum::<usize>() + rows + lens.len();
    for (hq, hkv, d) in [(16, 2, 256), (8, 2, 96)] {
        let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
        let half = d / 8;
        let rope = Rope {
            inv_freq: (0..half).map(|i| 10000f32.powf(-(i as f32) / half as f32)).collect(),
            attention_scaling: 1.0,
        };
        let params = AttentionParams { scale: (d as f32).powf(-0.5), window: None };
        on_both!(dev, &format!("attention decode, continued rows [{hq}, {hkv}, {d}]"), dev.attention_bound(d), |b| {
            let run = |together: bool| {
                let part = |at: usize, t: usize| qkv_rows(b, (&q, &k, &v), (hq, hkv, d), at, t);
                let blocks = total.div_ceil(b.kv_block_size()) + 8;
                let (mut tables, mut pool) = Tables::new(b, 3, (hkv, d), blocks, None, &mut Rng(5));
                let at = tables.prefill(b, &mut pool, &lens, part, &params);
                for (i, &n) in verified.iter().enumerate() {
                    tables.grow(i, n + 1);
                }
                let wave_seqs = |j: usize| -> Vec<KvSeq<'_>> {
                    waves[j].iter().map(|&i| KvSeq { start: tables.seq(i).start + j, ..tables.seq(i) }).collect()
                };
                let mut all = Vec::new();
                if together {
                    let seqs: Vec<KvSeq<'_>> = (0..waves.len()).flat_map(wave_seqs).collect();
                    let (qt, kt, vt) = part(at, rows);
                    all.extend(out(b, &b.attention_decode(&qt, &kt, &vt, &rope, &mut pool, &seqs, &params).unwrap()));
                } else {
                    let mut row = at;
                    for (j, wave) in waves.iter().enumerate() {
                        let (qt, kt, vt) = part(row, wave.len());
                        let o = b.attention_decode(&qt, &kt, &vt, &rope, &mut pool, &wave_seqs(j), &params).unwrap();
                        all.extend(out(b, &o));
                        row += wave.len();
                    }
                }
                for (i, &n) in verified.iter().enumerate() {
                    tables.advance(i, n);
                }
                // A decode step after the verification reads every row it wrote.
                let (qt, kt, vt) = part(at + rows, 3);
                let seqs: Vec<KvSeq<'_>> = (0..3).map(|i| tables.seq(i)).collect();
                all.extend(out(b, &b.attention_decode(&qt, &kt, &vt, &rope, &mut pool, &seqs, &params).unwrap()));
                all
            };
            let (together, by_wave) = (run(true), run(false));
            let same = together.len() == by_wave.len()
                && together.iter().zip(&by_wave).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "rows continued in one call differ from their waves");
            together
        });
    }
}

pub fn attention_decode_long_cache<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xa7de);
    // A prefill of several splits, then decode steps; windowed: the window spans splits and its
    // splits start inside blocks.
    let steps = [300usize, 1, 1, 1];
    let total = 2 * steps.iter().sum::<usize>();
    // Groups of 8, 1 and 6 (a block of the tensor-core kernels each: the MMA's 16 rows), 18 (a
    // block of 16 and one of 2), and a head dim those kernels do not take (the CUDA-core kernel:
    // 2 blocks of 4 heads per KV head).
    for (hq, hkv, d) in [(16, 2, 256), (4, 4, 64), (12, 2, 128), (36, 2, 64), (16, 2, 96)] {
        let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
        for window in [None, Some(130)] {
            let params = AttentionParams { scale: (d as f32).powf(-0.5), window };
            let bound = dev.attention_bound(d);
            on_both!(dev, &format!("attention decode [{hq}, {hkv}, {d}] window {window:?}"), bound, |b| {
                let blocks = total.div_ceil(b.kv_block_size()) + 5;
                let (mut tables, mut pool) = Tables::new(b, 2, (hkv, d), blocks, window, &mut Rng(11));
                let (mut s, mut all) = (0, Vec::new());
                for &n in &steps {
                    for i in 0..2 {
                        let qt = act(b, &[n, hq, d], &q[s * hq * d..(s + n) * hq * d]);
                        let kt = act(b, &[n, hkv, d], &k[s * hkv * d..(s + n) * hkv * d]);
                        let vt = act(b, &[n, hkv, d], &v[s * hkv * d..(s + n) * hkv * d]);
                        tables.grow(i, n);
                        let o = out(b, &b.attention(&qt, &kt, &vt, &mut pool, tables.seq(i), &params).unwrap());
                        tables.advance(i, n);
                        // The decode steps are what this test is about.
                        if n == 1 {
                            all.extend(o);
                        }
                        s += n;
                    }
                }
                all
            });
        }
    }
}

/// A context longer than one pass of a backend's kernel may read: vt-wgpu splits the keys over
/// dispatches within lavapipe's loop budget (1664 keys at head dimension 512; in one, lavapipe cut
/// the loops short from about 1900), so a prefill of 2000 positions has queries whose keys lie in
/// one dispatch and in two, then two decode steps; windowed (300), a decode step's keys all lie
/// past the first dispatch's.
pub fn attention_over_a_long_context<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0x10c7);
    let (hq, hkv, d, prompt) = (1, 1, 512, 2000);
    let total = prompt + 2;
    let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
    for window in [None, Some(300)] {
        let params = AttentionParams { scale: (d as f32).powf(-0.5), window };
        on_both!(dev, &format!("attention over {total} positions, window {window:?}"), dev.attention_bound(d), |b| {
            let blocks = total.div_ceil(b.kv_block_size()) + 2;
            let (mut tables, mut pool) = Tables::new(b, 1, (hkv, d), blocks, window, &mut Rng(12));
            let mut all = Vec::new();
            for (at, n) in [(0, prompt), (prompt, 1), (prompt + 1, 1)] {
                let (qt, kt, vt) = qkv_rows(b, (&q, &k, &v), (hq, hkv, d), at, n);
                tables.grow(0, n);
                all.extend(out(b, &b.attention(&qt, &kt, &vt, &mut pool, tables.seq(0), &params).unwrap()));
                tables.advance(0, n);
            }
            all
        });
    }
}

/// A fork as prefix sharing makes one: a second sequence shares the first's full blocks and takes
/// a copy of its partial last block (`copy_kv_block`), then both go on with tokens of their own;
/// the copy must hold exactly what the original held.
pub fn attention_continues_over_a_copied_block<G: Backend>(dev: &OnDevice<G>) {
    let mut r = Rng(0xc0b1);
    let (hq, hkv, d) = (8, 2, 128);
    let (prefix, steps) = (100, [1usize, 1, 20]);
    let total = prefix + 2 * steps.iter().sum::<usize>();
    let (q, k, v) = (r.vec(total * hq * d, 2.0), r.vec(total * hkv * d, 2.0), r.vec(total * hkv * d, 2.0));
    let params = AttentionParams { scale: (d as f32).powf(-0.5), window: None };
    on_both!(dev, &format!("attention over a copied block [{hq}, {hkv}, {d}]"), dev.attention_bound(d), |b| {
        let bs = b.kv_block_size();
        let rows = |at: usize, t: usize| qkv_rows(b, (&q, &k, &v), (hq, hkv, d), at, t);
        let blocks = 2 * total.div_ceil(bs) + 2;
        let mut pool = b.new_kv_pool(&[KvLayout { kv_heads: hkv, head_dim: d, blocks }]).unwrap();
        // Blocks from the top down: neither sequence's are in order of position.
        let mut free: Vec<u32> = (0..blocks as u32).collect();
        let mut a: Vec<u32> = (0..prefix.div_ceil(bs)).map(|_| free.remove(0)).collect();
        a.reverse();
        let (qt, kt, vt) = rows(0, prefix);
        let mut all =
            out(b, &b.attention(&qt, &kt, &vt, &mut pool, KvSeq { layer: 0, table: &a, start: 0 }, &params).unwrap());
        // The fork: the full blocks shared, the partial one copied.
        let mut fork = a.clone();
        let last = fork.len() - 1;
        fork[last] = free.pop().unwrap();
        b.copy_kv_block(&mut pool, 0, a[last], fork[last]).unwrap();
        let (mut at, mut len) = (prefix, prefix);
        for &n in &steps {
            for table in [&mut a, &mut fork] {
                while table.len() * bs < len + n {
                    table.push(free.pop().unwrap());
                }
                let (qt, kt, vt) = rows(at, n);
                let seq = KvSeq { layer: 0, table: table.as_slice(), start: len };
                all.extend(out(b, &b.attention(&qt, &kt, &vt, &mut pool, seq, &params).unwrap()));
                at += n;
            }
            len += n;
        }
        all
    });
}

pub fn random_fill_matches_the_host_definition<G: Backend>(dev: &OnDevice<G>) {
    for (dtype, scale) in [(DType::F32, 0.5), (DType::BF16, 3.0), (DType::F8E4M3, 1.0)] {
        on_both!(dev, &format!("random {dtype}"), 0.0, |b| {
            out(b, &b.random(dtype, &[37, 129], 42, scale).unwrap())
        });
    }
}

pub fn add_rms_norm_fused<G: Backend>(dev: &OnDevice<G>) {
    let gpu = &dev.backend;
    let mut r = Rng(0xadd0);
    let t = 5;
    // Widths and weight dtypes that take each path of kernels/norm.cu: 8 values per access
    // (bf16 weight, width % 8 == 0), 1 per access (odd width, or an f32 weight), and rows longer
    // than the part each thread keeps in registers (4096 values at 256 threads), read again.
    for (d, f32_weight) in [(2048, false), (5000, false), (163, false), (4100, true)] {
        let (x, y, w) = (r.vec(t * d, 3.0), r.vec(t * d, 3.0), r.vec(d, 1.0));
        for kind in [NormKind::Plain, NormKind::UnitOffset] {
            on_both!(dev, &format!("rms_norm {kind:?} width {d}"), dev.u, |b| {
                out(b, &b.rms_norm(&act(b, &[t, d], &x), &norm_weight(b, &w, f32_weight), 1e-6, kind).unwrap())
            });
            // 2u: the norm reads the sum rounded to bf16 (as add then rms_norm would).
            on_both!(dev, &format!("add_rms_norm {kind:?} width {d}"), 2.0 * dev.u, |b| {
                let (sum, normed) = b
                    .add_rms_norm(
                        &act(b, &[t, d], &x),
                        &act(b, &[t, d], &y),
                        &norm_weight(b, &w, f32_weight),
                        1e-6,
                        kind,
                    )
                    .unwrap();
                let mut all = out(b, &sum);
                all.extend(out(b, &normed));
                all
            });
            // One body: the fused norm is rms_norm of the sum it wrote, bit for bit.
            let b = gpu;
            let nw = norm_weight(b, &w, f32_weight);
            let (sum, normed) = b.add_rms_norm(&act(b, &[t, d], &x), &act(b, &[t, d], &y), &nw, 1e-6, kind).unwrap();
            assert_eq!(out(b, &normed), out(b, &b.rms_norm(&sum, &nw, 1e-6, kind).unwrap()), "width {d}");
        }
    }
}

/// Greedy picks on the device are vt_core::argmax of each row, exactly: ties, NaNs and infinities
/// included, over a vocabulary-sized row and short ones; under a grammar's masks they are
/// vt_core's masked_argmax; and a row with any NaN or infinity, even one NaN among 248k values or
/// one under a disallowed token, is flagged (`Pick::finite`) as vt-cpu flags it. The embedding of
/// the picks made on the device (`embed_argmax`) is the table's rows of those same picks.
pub fn argmax_rows_on_the_device_is_the_greedy_rule<G: Backend>(dev: &OnDevice<G>) {
    let gpu = &dev.backend;
    let cpu = CpuBackend::new();
    let mut r = Rng(0xa59a);
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    for n in [248_320, 1000, 33, 1] {
        // bf16 of values in [-4, 4): many exact ties at the maximum.
        let mut rows: Vec<Vec<f32>> = (0..7).map(|_| r.vec(n, 4.0)).collect();
        if n > 2 {
            rows[1][0] = nan;
            rows[2][n / 2] = nan;
            rows[2][n - 1] = inf;
            rows[3].iter_mut().for_each(|v| *v = -inf);
            rows[4].iter_mut().step_by(2).for_each(|v| *v = nan);
            rows[5][n - 2] = nan; // one NaN: the pick is a number, the row is broken
        }
        let flat: Vec<f32> = rows.concat();
        let words = vt_core::backend::mask_words(n);
        // Row masks: random bits, except row 0 (all allowed) and row 6 (one token allowed).
        let mut bits: Vec<u32> =
            r.bytes(4 * rows.len() * words).chunks(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
        bits[..words].fill(u32::MAX);
        bits[6 * words..7 * words].fill(0);
        bits[6 * words + (n - 1) / 32] = 1 << ((n - 1) % 32);
        let x = gpu.upload(DType::BF16, &[rows.len(), n], &bf16_bytes(&flat)).unwrap();
        let host = cpu.upload(DType::BF16, &[rows.len(), n], &bf16_bytes(&flat)).unwrap();
        for allowed in [None, Some(&bits[..])] {
            let want: Vec<Pick> = (rows.iter().enumerate())
                .map(|(i, row)| {
                    let id = match allowed {
                        None => vt_core::argmax(row),
                        Some(b) => vt_core::backend::composed::masked_argmax(row, &b[i * words..(i + 1) * words]),
                    };
                    Pick { id: id as u32, finite: row.iter().all(|v| v.is_finite()) }
                })
                .collect();
            let masked = allowed.is_some();
            assert_eq!(gpu.argmax_rows(&x, allowed).unwrap(), want, "width {n}, masked {masked}");
            assert_eq!(cpu.argmax_rows(&host, allowed).unwrap(), want, "width {n}, masked {masked}");
        }
        if n > 2 {
            assert!(!gpu.argmax_rows(&x, None).unwrap()[5].finite, "one NaN in {n}");
        }
        // A table whose rows differ in their first three (bf16-exact) values.
        let id_row = |i: usize| -> Vec<f32> {
            let digits = [i % 256, i / 256 % 256, i / 65536];
            (0..8).map(|j| digits.get(j).map_or(j as f32, |&d| d as f32)).collect()
        };
        let table_of = |vocab: usize| {
            let flat: Vec<f32> = (0..vocab).flat_map(id_row).collect();
            gpu.upload(DType::BF16, &[vocab, 8], &bf16_bytes(&flat)).unwrap()
        };
        let picked: Vec<f32> = rows.iter().flat_map(|row| id_row(vt_core::argmax(row))).collect();
        assert_eq!(out(gpu, &gpu.embed_argmax(&table_of(n + 3), &x).unwrap()), picked, "embedded picks, width {n}");
        if n > 1 {
            assert!(gpu.embed_argmax(&table_of(n - 1), &x).is_err(), "logits wider than the table are refused");
        }
        let short = &bits[..bits.len() - 1];
        assert!(gpu.argmax_rows(&x, Some(short)).is_err(), "a mask of the wrong size is refused");
    }
}

/// Logprobs on the device are vt-core's reference (`token_logprobs`) over the same bf16 rows: the
/// same top ids in the same order (ties: lower id first, NaNs skipped, -inf kept), values within
/// the rounding of the device's log-sum-exp: it adds 1024 per-thread parts in f32, a relative
/// error of at most 1024 * 2^-24 = 6e-5 in the sum and so in absolute terms in its log.
pub fn top_logprobs_on_the_device_match_the_reference<G: Backend>(dev: &OnDevice<G>) {
    let gpu = &dev.backend;
    let cpu = CpuBackend::new();
    let mut r = Rng(0x1095);
    for (n, k) in [(248_320, 20), (1000, 5), (33, 33), (3, 5)] {
        let mut rows: Vec<Vec<f32>> = (0..4).map(|_| r.vec(n, 8.0)).collect();
        if n > 2 {
            rows[1][n / 2] = f32::NAN;
            rows[2].iter_mut().step_by(3).for_each(|v| *v = -f32::INFINITY);
        }
        let flat: Vec<f32> = rows.concat();
        let chosen: Vec<u32> = (0..rows.len()).map(|i| ((i * 7919) % n) as u32).collect();
        let x = gpu.upload(DType::BF16, &[rows.len(), n], &bf16_bytes(&flat)).unwrap();
        let got = gpu.top_logprobs_rows(&x, &chosen, k).unwrap();
        let host = cpu.upload(DType::BF16, &[rows.len(), n], &bf16_bytes(&flat)).unwrap();
        assert_eq!(cpu.top_logprobs_rows(&host, &chosen, k).unwrap().len(), rows.len());
        for (i, row) in rows.iter().enumerate() {
            let want = vt_core::backend::token_logprobs(row, chosen[i], k);
            let ids = |t: &[(u32, f32)]| t.iter().map(|p| p.0).collect::<Vec<_>>();
            assert_eq!(ids(&got[i].top), ids(&want.top), "width {n}, row {i}");
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * (1.0 + b.abs()) || a == b;
            assert!(close(got[i].logprob, want.logprob), "width {n}, row {i}: {} vs {}", got[i].logprob, want.logprob);
            for (g, w) in got[i].top.iter().zip(&want.top) {
                assert!(close(g.1, w.1), "width {n}, row {i}: {} vs {}", g.1, w.1);
            }
        }
    }
}

/// Sampled picks on the device are vt-core's reference draws (`sample::sample_row`) over the same
/// bf16 rows, for every parameter: temperature alone, top-k (with ties at the cut, and past the
/// width), top-p, min-p, all of them together, a grammar's mask, the sparse adjustments (bias,
/// repetition, presence and frequency penalties), greedy with adjustments, several picks of one
/// row; the rows' finite flags are vt-cpu's, and the logprobs are `top_logprobs_rows`' (raw rows).
///
/// The device sums its weights in another order than the host and its expf may differ from the
/// host's by an ulp or two, so a draw whose uniform fell within ~1e-6 of a boundary between two
/// tokens' intervals could go either way; each uniform here is the middle of a kept token's
/// interval in the reference's walk, chosen among tokens holding at least 1e-5 of the kept
/// weight (the rows' largest weight is 1 and their totals below 2e4 at these temperatures, so
/// there are such tokens), so that the ids must agree exactly. Logprob values: as in
/// `top_logprobs_on_the_device_match_the_reference`.
pub fn sample_rows_on_the_device_draw_as_the_reference<G: Backend>(dev: &OnDevice<G>) {
    use vt_core::backend::sample::{candidates, prepared, sample_row, Filters};
    use vt_core::backend::{LogitAdjust, SampleRow};
    let gpu = &dev.backend;
    let cpu = CpuBackend::new();
    let mut r = Rng(0x5a3e);
    for n in [248_320, 1000, 33] {
        // Row 0 flat, row 1 peaked (a few tokens far above the rest), row 2 with ties at the top,
        // row 3 with one NaN (broken: its flag, not its id, is compared).
        let mut rows: Vec<Vec<f32>> = (0..4).map(|_| r.vec(n, 8.0)).collect();
        for j in 0..5.min(n) {
            rows[1][(j * 7919) % n] = 12.0 + j as f32;
        }
        for j in 0..4.min(n) {
            rows[2][(j * 104_729) % n] = 9.0;
        }
        rows[3][n / 2] = f32::NAN;
        let flat: Vec<f32> = rows.concat();
        let x = gpu.upload(DType::BF16, &[rows.len(), n], &bf16_bytes(&flat)).unwrap();
        let host = cpu.upload(DType::BF16, &[rows.len(), n], &bf16_bytes(&flat)).unwrap();
        let words = vt_core::backend::mask_words(n);
        let mask: Vec<u32> =
            r.bytes(4 * words).chunks(4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) | 1).collect();
        // Adjustments on a sorted, distinct tenth of the row (every token of a short one).
        let mut tokens: Vec<u32> = (0..n as u32).step_by(if n > 100 { 10 } else { 1 }).collect();
        tokens.truncate(3000);
        let adjust: Vec<LogitAdjust> = (tokens.iter().enumerate())
            .map(|(i, &token)| LogitAdjust {
                token,
                bias: if i % 3 == 0 { 4.0 * r.f32() } else { 0.0 },
                penalty: if i % 2 == 0 { 0.5 + r.f32() } else { 0.0 },
                repeated: (i % 5 < 2) as u32,
            })
            .collect();
        let base = SampleRow::plain(0, 1.0, 0.5);
        let params = [
            base,
            SampleRow { temperature: 0.7, top_p: 0.9, ..base },
            SampleRow { temperature: 1.2, top_k: 40, ..base },
            SampleRow { top_k: 2, ..base },
            SampleRow { top_k: n + 5, ..base },
            SampleRow { temperature: 0.9, min_p: 0.05, ..base },
            SampleRow { top_k: 50, top_p: 0.8, min_p: 0.01, ..base },
            SampleRow { temperature: 1.1, allowed: Some(&mask), ..base },
            SampleRow { adjust: &adjust, repetition_penalty: 1.3, top_p: 0.95, ..base },
            SampleRow { temperature: 0.0, adjust: &adjust, repetition_penalty: 1.3, allowed: Some(&mask), ..base },
            SampleRow {
                temperature: 0.8,
                top_k: 30,
                top_p: 0.9,
                min_p: 0.02,
                adjust: &adjust,
                repetition_penalty: 1.3,
                allowed: Some(&mask),
                ..base
            },
        ];
        let mut picks = Vec::new();
        for p in &params {
            for (row, values) in rows.iter().enumerate() {
                // Two picks of each row: a request's two choices.
                for _ in 0..2 {
                    let prep = prepared(values, p.allowed, p.adjust, p.repetition_penalty);
                    let f = Filters { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p };
                    let cands = if p.temperature == 0.0 { vec![(0, 1.0)] } else { candidates(&prep, &f) };
                    let total: f64 = cands.iter().map(|c| c.1).sum();
                    let wide: Vec<usize> = (0..cands.len()).filter(|&j| cands[j].1 >= 1e-5 * total).collect();
                    let j = wide[((r.f32() + 1.0) / 2.0 * wide.len() as f32) as usize % wide.len()];
                    let before: f64 = cands[..j].iter().map(|c| c.1).sum();
                    picks.push(SampleRow { row, uniform: (before + cands[j].1 / 2.0) / total, ..*p });
                }
            }
        }
        let k = 5;
        let got = gpu.sample_rows(&x, &picks, Some(k)).unwrap();
        let want = cpu.sample_rows(&host, &picks, Some(k)).unwrap();
        assert_eq!(gpu.sample_rows(&x, &picks, Some(k)).unwrap(), got, "width {n}: the same draws again");
        let (got_lp, want_lp) = (got.logprobs.unwrap(), want.logprobs.unwrap());
        for (i, s) in picks.iter().enumerate() {
            let finite = rows[s.row].iter().all(|v| v.is_finite());
            assert_eq!(got.picks[i].finite, finite, "width {n}, pick {i}");
            assert_eq!(want.picks[i].finite, finite, "width {n}, pick {i}");
            if !finite {
                continue;
            }
            let reference = sample_row(&rows[s.row], s);
            assert_eq!(want.picks[i].id, reference, "width {n}, pick {i}: vt-cpu");
            assert_eq!(got.picks[i].id, reference, "width {n}, pick {i} (row {}): {:?}", s.row, params[i / 8]);
            let lp = vt_core::backend::token_logprobs(&rows[s.row], reference, k);
            assert_eq!(want_lp[i], lp, "width {n}, pick {i}: vt-cpu's logprobs");
            let ids = |t: &[(u32, f32)]| t.iter().map(|p| p.0).collect::<Vec<_>>();
            assert_eq!(ids(&got_lp[i].top), ids(&lp.top), "width {n}, pick {i}");
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * (1.0 + b.abs()) || a == b;
            assert!(
                close(got_lp[i].logprob, lp.logprob),
                "width {n}, pick {i}: {} vs {}",
                got_lp[i].logprob,
                lp.logprob
            );
            for (g, w) in got_lp[i].top.iter().zip(&lp.top) {
                assert!(close(g.1, w.1), "width {n}, pick {i}: {} vs {}", g.1, w.1);
            }
        }
        let out_of_range = SampleRow { row: rows.len(), ..base };
        assert!(gpu.sample_rows(&x, &[out_of_range], None).is_err(), "a row past the logits is refused");
    }
}

fn norm_weight<B: Backend>(b: &B, w: &[f32], f32_weight: bool) -> Tensor<B> {
    if f32_weight {
        b.upload(DType::F32, &[w.len()], bytemuck_f32(w)).unwrap()
    } else {
        small(b, w)
    }
}
