//! Attention over a sequence's rows of the KV pool (kv.rs): flash attention for prefill
//! (flash.rs), the split decode kernels for one query token (decode.rs), a warp per (token, head)
//! for the rest (kernels/attention.cu); and the batched decode step of many sequences at once.

pub(crate) mod decode;
pub(crate) mod flash;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::backend::check::AttentionDims;
use vt_core::{AttentionParams, DType, KvLayout, KvSeq, Result, Rope};

use self::decode::SeqCaches;
use crate::device::{CudaBackend, CudaTensor};
use crate::error::{check, err};
use crate::kv::{CudaKvPool, Rows};
use crate::launch::{act, grid1, i32_of, launched, Overlapped};
use crate::limits::{ATT_MAX_D, SEQ_MAX};
use crate::ops::rope::rope_seqs;

/// Causal GQA attention of `q` over `seq`'s earlier positions and this call's `k`, `v`, which it
/// writes at positions `seq.start..`.
pub(crate) fn attention(
    b: &CudaBackend,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    pool: &mut CudaKvPool,
    seq: KvSeq<'_>,
    p: &AttentionParams,
) -> Result<CudaTensor> {
    let op = "attention";
    let AttentionDims { t, q_heads, kv_heads, head_dim } = vt_core::backend::check::attention(b, q, k, v, p)?;
    let layout = pool.layout(seq.layer, op)?;
    check(kv_heads == layout.kv_heads && head_dim == layout.head_dim && head_dim <= ATT_MAX_D, op, || {
        format!(
            "q {:?}, k {:?}, v {:?} with a pool layer of {} heads x {}",
            q.shape(),
            k.shape(),
            v.shape(),
            layout.kv_heads,
            layout.head_dim
        )
    })?;
    let (pq, pk, pv) = (act(q, op)?, act(k, op)?, act(v, op)?);
    let start = seq.start;
    let rows = Rows::of(b, pool, &seq, t, p.window, op)?;
    // A recorded step runs the decode kernels at the position its replays give, over rows that
    // must stay where they are (in place, consecutive blocks) with room for it.
    let recording = b.recording();
    let recorded = rows.recorded();
    if recording.is_some() {
        check(t == 1 && recorded.is_some(), op, || {
            format!(
                "a recorded step needs one token over consecutive blocks of a full-attention layer \
                 ({t} tokens, window {:?}; INTERIM until the paged kernels read block tables)",
                p.window
            )
        })?;
    }
    let start_at = recording.map(|r| r.pos_at(op, start)).transpose()?;
    let start_ptr = start_at.unwrap_or(0);
    let (kc, vc) = (rows.k, rows.v);
    let out = b.empty(DType::BF16, q.shape())?;
    let po = out.buffer().ptr();
    let window = i32_of(p.window.unwrap_or(0), "window")?;
    let (ti, hq, hkv, d, s) =
        (i32_of(t, "tokens")?, i32_of(q_heads, "heads")?, kv_heads as i32, head_dim as i32, i32_of(start, "position")?);
    // The decode split kernels append the step's row themselves; the others leave it to kv_append.
    let mut appended = false;
    if flash::fits(t, head_dim, b.k().max_shared) {
        let ops = flash::Operands { out: po, q: pq, k: pk, v: pv, kc, vc };
        flash::launch(b, &ops, ti, hq, hkv, head_dim, s, window, p.scale)?;
    } else if decode::fits(t, head_dim) {
        appended = true;
        let ops = decode::Operands { out: po, q: pq, k: pk, v: pv, kc, vc };
        let rec = start_at.map(|pos| decode::Recorded { pos, rows: rows.capacity });
        decode::launch(b, &ops, q_heads, kv_heads, head_dim, start, p.window.unwrap_or(0), p.scale, rec)?;
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
        // per (token, head); q/out [t, q_heads, d], k/v [t, kv_heads, d] (checked); the rows hold
        // every position before `start` that a query can see (all of them, or the last window - 1
        // in the ring: Rows::of); start_at is 0 or a recording's position, one its replays check
        // fits.
        launched(unsafe { l.launch(cfg) }, "attention")?;
    }
    if !appended {
        let row = i32_of(kv_heads * head_dim, "cache row")?;
        let mut l = Overlapped::new(b, &b.k().kv_append);
        l.arg(&kc).arg(&vc).arg(&pk).arg(&pv).arg(&ti).arg(&row).arg(&s).arg(&start_ptr).arg(&window);
        // SAFETY: kv_append(bf16* kc, bf16* vc, const bf16* k, const bf16* v, int t, int row,
        // int start, const int* start_at, int window): writes rows start..start+t (mod window) of
        // rows that hold them (Rows::of: the table covers them; a recording's position is one its
        // replays check fits); queued after the attention kernel, which reads the rows it may
        // overwrite; the kernel starts with grid_dep_begin.
        unsafe { l.launch(grid1(t * kv_heads * head_dim), "kv_append")? };
    }
    rows.write_back(b, pool, &seq, t, pk, pv)?;
    if let (Some(r), Some(c)) = (recording, recorded) {
        r.add_cache(c);
    }
    Ok(out)
}

/// Whether the batched decode kernels take this pool layer's head shape.
pub(crate) fn decode_fits(pool: &CudaKvPool, seqs: &[KvSeq<'_>]) -> bool {
    seqs.first()
        .and_then(|s| pool.layout(s.layer, "attention_decode").ok())
        .is_some_and(|l| decode::fits(1, l.head_dim))
}

/// `Backend::attention_decode` with the batched decode kernels (rope, split attention and append
/// over every sequence at once, `SEQ_MAX` sequences a launch), for a layer `decode_fits` took.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_step(
    b: &CudaBackend,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    rope: &Rope,
    pool: &mut CudaKvPool,
    seqs: &[KvSeq<'_>],
    p: &AttentionParams,
) -> Result<CudaTensor> {
    let op = "attention_decode";
    let n = seqs.len();
    let layer = match seqs.first() {
        Some(s) => s.layer,
        None => return Err(err(format!("{op}: no sequences"))),
    };
    let KvLayout { kv_heads, head_dim, .. } = pool.layout(layer, op)?;
    let q_heads = q.shape().get(1).copied().unwrap_or(0);
    check(
        q.shape() == [n, q_heads, head_dim]
            && k.shape() == [n, kv_heads, head_dim]
            && v.shape() == k.shape()
            && kv_heads > 0
            && q_heads % kv_heads == 0
            && seqs.iter().all(|s| s.layer == layer),
        op,
        || {
            format!(
                "{n} sequences in a pool layer of {kv_heads} heads x {head_dim}, q {:?}, k {:?}, v {:?} (one layer)",
                q.shape(),
                k.shape(),
                v.shape()
            )
        },
    )?;
    // A recorded step reads one sequence's position from device memory; these are by value.
    check(b.recording().is_none(), op, || "a recorded step runs one sequence".into())?;
    check(decode::fits(1, head_dim), op, || format!("the decode kernels do not take head dim {head_dim}"))?;
    let (pq, pk, pv) = (act(q, op)?, act(k, op)?, act(v, op)?);
    let out = b.empty(DType::BF16, q.shape())?;
    let (qr, kr) = (b.empty(DType::BF16, q.shape())?, b.empty(DType::BF16, k.shape())?);
    let (q_row, kv_row) = ((q_heads * head_dim * 2) as u64, (kv_heads * head_dim * 2) as u64);
    let w = p.window.unwrap_or(0);
    for (c, chunk) in seqs.chunks(SEQ_MAX).enumerate() {
        let first = (c * SEQ_MAX) as u64;
        let mut kv = SeqCaches { keys: [0; SEQ_MAX], values: [0; SEQ_MAX], starts: [0; SEQ_MAX], len: chunk.len() };
        let rows = chunk.iter().map(|s| Rows::of(b, pool, s, 1, p.window, op)).collect::<Result<Vec<_>>>()?;
        for (i, (r, s)) in rows.iter().zip(chunk).enumerate() {
            (kv.keys[i], kv.values[i]) = (r.k, r.v);
            kv.starts[i] = i32_of(s.start, "position")?;
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
        // The split kernel appends each sequence's row (to gathered rows: written back here).
        decode::launch_seqs(b, &ops, &kv, q_heads, kv_heads, head_dim, w, p.scale)?;
        for (i, (r, s)) in rows.iter().zip(chunk).enumerate() {
            r.write_back(b, pool, s, 1, ops.k + i as u64 * kv_row, ops.v + i as u64 * kv_row)?;
        }
    }
    Ok(out)
}
