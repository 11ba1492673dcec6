//! Attention over a sequence's KV cache (kv.rs): flash attention for prefill (flash.rs), the split
//! decode kernels for one query token (decode.rs), a warp per (token, head) for the rest
//! (kernels/attention.cu); and the batched decode step of many sequences at once.

pub(crate) mod decode;
pub(crate) mod flash;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::backend::check::AttentionDims;
use vt_core::{AttentionParams, DType, Result, Rope};

use self::decode::SeqCaches;
use crate::device::{CudaBackend, CudaTensor};
use crate::error::{check, err};
use crate::kv::CudaKvCache;
use crate::launch::{act, grid1, i32_of, launched, Overlapped};
use crate::limits::{ATT_MAX_D, SEQ_MAX};
use crate::ops::rope::rope_seqs;

/// Causal GQA attention of `q` over the cache and this call's `k`, `v`, then appends them.
pub(crate) fn attention(
    b: &CudaBackend,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    cache: &mut CudaKvCache,
    p: &AttentionParams,
) -> Result<CudaTensor> {
    let op = "attention";
    let AttentionDims { t, q_heads, kv_heads, head_dim } = vt_core::backend::check::attention(b, q, k, v, p)?;
    check(
        kv_heads == cache.kv_heads && head_dim == cache.head_dim && head_dim <= ATT_MAX_D && p.window == cache.window,
        op,
        || {
            format!(
                "q {:?}, k {:?}, v {:?} with a cache of {} heads x {} (window {:?}, asked {:?})",
                q.shape(),
                k.shape(),
                v.shape(),
                cache.kv_heads,
                cache.head_dim,
                cache.window,
                p.window
            )
        },
    )?;
    let (pq, pk, pv) = (act(q, op)?, act(k, op)?, act(v, op)?);
    let start = cache.len;
    // A recorded step runs the decode kernels at the position its replays give, over storage that
    // must not move under it.
    let recording = b.recording();
    if recording.is_some() {
        check(t == 1 && cache.fits(start + t), op, || {
            format!(
                "a recorded step needs one token over a reserved cache ({t} tokens, {} of {} rows)",
                start + t,
                cache.capacity
            )
        })?;
    }
    let start_at = recording.map(|r| r.pos_at(op, start)).transpose()?;
    let start_ptr = start_at.unwrap_or(0);
    let (kc, vc) = cache.reserve(t)?;
    let out = b.empty(DType::BF16, q.shape())?;
    let po = out.buffer().ptr();
    let window = i32_of(p.window.unwrap_or(0), "window")?;
    let (ti, hq, hkv, d, s) = (
        i32_of(t, "tokens")?,
        i32_of(q_heads, "heads")?,
        cache.kv_heads as i32,
        head_dim as i32,
        i32_of(start, "position")?,
    );
    // The decode split kernels append the step's row themselves; the others leave it to kv_append.
    let mut appended = false;
    if flash::fits(t, head_dim, b.k().max_shared) {
        let ops = flash::Operands { out: po, q: pq, k: pk, v: pv, kc, vc };
        flash::launch(b, &ops, ti, hq, hkv, head_dim, s, window, p.scale)?;
    } else if decode::fits(t, head_dim) {
        appended = true;
        let ops = decode::Operands { out: po, q: pq, k: pk, v: pv, kc, vc };
        let rec = start_at.map(|pos| decode::Recorded { pos, rows: cache.capacity });
        decode::launch(b, &ops, q_heads, cache.kv_heads, head_dim, start, p.window.unwrap_or(0), p.scale, rec)?;
    } else {
        let mut l = b.stream().launch_builder(&b.k().attention);
        l.arg(&po)
            .arg(&pq)
            .arg(&pk)
            .arg(&pv)
            .arg(&kc)
            .arg(&vc)
            .arg(&ti)
            .arg(&hq)
            .arg(&hkv)
            .arg(&d)
            .arg(&s)
            .arg(&start_ptr)
            .arg(&window)
            .arg(&p.scale);
        let cfg = LaunchConfig {
            grid_dim: ((t * q_heads).div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: attention(bf16* out, q, k, v, const bf16* kc, const bf16* vc, int t, int q_heads,
        // int kv_heads, int d, int start, const int* start_at, int window, float scale): one warp
        // per (token, head); q/out [t, q_heads, d], k/v [t, kv_heads, d] (checked); the cache holds
        // every position before `start` that a query can see (all of them, or the last window - 1
        // in the ring); start_at is 0 or a recording's position, one its replays check fits.
        launched(unsafe { l.launch(cfg) }, "attention")?;
    }
    if !appended {
        let row = i32_of(cache.kv_heads * head_dim, "cache row")?;
        let mut l = Overlapped::new(b, &b.k().kv_append);
        l.arg(&kc).arg(&vc).arg(&pk).arg(&pv).arg(&ti).arg(&row).arg(&s).arg(&start_ptr).arg(&window);
        // SAFETY: kv_append(bf16* kc, bf16* vc, const bf16* k, const bf16* v, int t, int row,
        // int start, const int* start_at, int window): writes rows start..start+t (mod window) of a
        // cache reserved for them (a recording's position is one its replays check fits); queued
        // after the attention kernel, which reads the rows it may overwrite; the kernel starts with
        // grid_dep_begin.
        unsafe { l.launch(grid1(t * cache.kv_heads * head_dim), "kv_append")? };
    }
    match (recording, cache.recorded()) {
        // The recorded step has not run: each replay advances the cache.
        (Some(r), Some(c)) => r.add_cache(c),
        _ => cache.len += t,
    }
    Ok(out)
}

/// Whether the batched decode kernels take these caches' head shape.
pub(crate) fn decode_fits(caches: &[&mut CudaKvCache]) -> bool {
    caches.first().is_some_and(|c| decode::fits(1, c.head_dim))
}

/// `Backend::attention_decode` with the batched decode kernels (rope, split attention and append
/// over every sequence at once, `SEQ_MAX` sequences a launch), for caches `decode_fits` took.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_step(
    b: &CudaBackend,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    rope: &Rope,
    positions: &[usize],
    caches: &mut [&mut CudaKvCache],
    p: &AttentionParams,
) -> Result<CudaTensor> {
    let op = "attention_decode";
    let n = caches.len();
    let (kv_heads, head_dim, window) = match caches.first() {
        Some(c) => (c.kv_heads, c.head_dim, c.window),
        None => return Err(err(format!("{op}: no sequences"))),
    };
    let q_heads = q.shape().get(1).copied().unwrap_or(0);
    check(
        q.shape() == [n, q_heads, head_dim]
            && k.shape() == [n, kv_heads, head_dim]
            && v.shape() == k.shape()
            && positions.len() == n
            && kv_heads > 0
            && q_heads % kv_heads == 0
            && p.window == window
            && caches.iter().all(|c| c.kv_heads == kv_heads && c.head_dim == head_dim && c.window == window),
        op,
        || {
            format!(
                "{n} caches of {kv_heads} heads x {head_dim} (window {window:?}, asked {:?}), {} positions, q {:?}, k {:?}, v {:?}",
                p.window,
                positions.len(),
                q.shape(),
                k.shape(),
                v.shape()
            )
        },
    )?;
    if let Some((i, (c, pos))) = caches.iter().zip(positions).enumerate().find(|(_, (c, &pos))| c.len != pos) {
        return Err(err(format!("{op}: sequence {i} at position {pos} with a cache of {} positions", c.len)));
    }
    // A recorded step reads one sequence's position from device memory; these are by value.
    check(b.recording().is_none(), op, || "a recorded step runs one sequence".into())?;
    check(decode_fits(caches), op, || format!("the decode kernels do not take head dim {head_dim}"))?;
    let (pq, pk, pv) = (act(q, op)?, act(k, op)?, act(v, op)?);
    let out = b.empty(DType::BF16, q.shape())?;
    let (qr, kr) = (b.empty(DType::BF16, q.shape())?, b.empty(DType::BF16, k.shape())?);
    let (q_row, kv_row) = ((q_heads * head_dim * 2) as u64, (kv_heads * head_dim * 2) as u64);
    let w = window.unwrap_or(0);
    for (c, chunk) in caches.chunks_mut(SEQ_MAX).enumerate() {
        let first = (c * SEQ_MAX) as u64;
        let mut kv = SeqCaches { keys: [0; SEQ_MAX], values: [0; SEQ_MAX], starts: [0; SEQ_MAX], len: chunk.len() };
        for (i, cache) in chunk.iter_mut().enumerate() {
            (kv.keys[i], kv.values[i]) = cache.reserve(1)?;
            kv.starts[i] = i32_of(cache.len, "position")?;
        }
        let ops = decode::Operands {
            out: out.buffer().ptr() + first * q_row,
            q: qr.buffer().ptr() + first * q_row,
            k: kr.buffer().ptr() + first * kv_row,
            v: pv + first * kv_row,
            kc: 0,
            vc: 0,
        };
        rope_seqs(b, ops.q, pq + first * q_row, kv.len, q_heads, head_dim, &kv.starts, rope)?;
        rope_seqs(b, ops.k, pk + first * kv_row, kv.len, kv_heads, head_dim, &kv.starts, rope)?;
        // The split kernel appends each sequence's row.
        decode::launch_seqs(b, &ops, &kv, q_heads, kv_heads, head_dim, w, p.scale)?;
        for cache in chunk.iter_mut() {
            cache.len += 1;
        }
    }
    Ok(out)
}
