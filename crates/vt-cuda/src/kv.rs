//! One attention layer's bf16 keys and values for one sequence, in device memory.
//!
//! Full attention keeps position p in row p and grows by doubling; a sliding-window layer keeps a
//! ring of `window` rows (position p in row p % window), so it never grows past the window.

use std::sync::Arc;

use cudarc::driver::{result, LaunchConfig, PushKernelArg};
use vt_core::{AttentionParams, DType, Result, Rope, Tensor};

use crate::alloc::{Allocator, CudaBuffer};
use crate::attn_decode::SeqCaches;
use crate::capture::RecordedCache;
use crate::error::driver_err;
use crate::error::{check, err};
use crate::launch::{act, grid1, i32_of, launched, Overlapped};
use crate::limits::{ATT_MAX_D, SEQ_MAX};
use crate::rope::rope_seqs;
use crate::CudaBackend;

pub struct CudaKvCache {
    alloc: Arc<Allocator>,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: Option<usize>,
    k: Option<CudaBuffer>,
    v: Option<CudaBuffer>,
    /// Rows the buffers hold.
    capacity: usize,
    /// Positions seen so far.
    pub(crate) len: usize,
}

impl CudaKvCache {
    pub(crate) fn new(alloc: Arc<Allocator>, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Self {
        CudaKvCache { alloc, kv_heads, head_dim, window, k: None, v: None, capacity: 0, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows of device memory held (the window for a sliding layer, at most).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn row_bytes(&self) -> usize {
        self.kv_heads * self.head_dim * 2
    }

    /// Whether `positions` positions fit without moving the storage.
    fn fits(&self, positions: usize) -> bool {
        match self.window {
            Some(_) => self.k.is_some(),
            None => positions <= self.capacity,
        }
    }

    /// The storage as a recorded step sees it (`None` before any is allocated); a ring never
    /// moves, so any position fits it.
    pub(crate) fn recorded(&self) -> Option<RecordedCache> {
        let keys = self.k.as_ref()?.ptr();
        Some(RecordedCache { keys, capacity: if self.window.is_some() { usize::MAX } else { self.capacity } })
    }

    /// Makes room for `len + t` positions; returns the (keys, values) device addresses.
    pub(crate) fn reserve(&mut self, t: usize) -> Result<(u64, u64)> {
        self.reserve_total(self.len + t)?;
        let (k, v) = (self.k.as_ref().expect("reserved"), self.v.as_ref().expect("reserved"));
        Ok((k.ptr(), v.ptr()))
    }

    /// Moves the storage, if it must, so that it holds `rows` positions (at least twice what it
    /// held, so that a growing sequence moves it rarely).
    pub(crate) fn reserve_total(&mut self, rows: usize) -> Result<()> {
        if !self.fits(rows) {
            let cap = match self.window {
                Some(w) => w,
                None => rows.max(self.capacity * 2).max(16),
            };
            let k = CudaBuffer::new(&self.alloc, cap * self.row_bytes())?;
            let v = CudaBuffer::new(&self.alloc, cap * self.row_bytes())?;
            if let (Some(ok), Some(ov)) = (&self.k, &self.v) {
                let used = self.capacity * self.row_bytes();
                for (dst, src) in [(&k, ok), (&v, ov)] {
                    // SAFETY: both blocks hold at least `used` bytes; the copy is ordered on the
                    // backend's stream before the old block can be reused.
                    unsafe { result::memcpy_dtod_async(dst.ptr(), src.ptr(), used, self.alloc.stream().cu_stream()) }
                        .map_err(|e| driver_err("growing a KV cache", e))?;
                }
            }
            self.k = Some(k);
            self.v = Some(v);
            self.capacity = cap;
        }
        Ok(())
    }
}

/// Causal GQA attention of `q` over the cache and this call's `k`, `v`, then appends them.
pub(crate) fn attention(
    b: &CudaBackend,
    q: &Tensor<CudaBackend>,
    k: &Tensor<CudaBackend>,
    v: &Tensor<CudaBackend>,
    cache: &mut CudaKvCache,
    p: &AttentionParams,
) -> Result<Tensor<CudaBackend>> {
    let op = "attention";
    let [t, q_heads, head_dim] = *q.shape() else {
        return Err(err(format!("{op}: q must be [tokens, heads, dim], found {:?}", q.shape())));
    };
    check(
        k.shape() == [t, cache.kv_heads, cache.head_dim]
            && v.shape() == k.shape()
            && head_dim == cache.head_dim
            && head_dim <= ATT_MAX_D
            && cache.kv_heads > 0
            && q_heads % cache.kv_heads == 0
            && p.window == cache.window,
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
    if crate::flash::fits(t, head_dim, b.k().max_shared) {
        let ops = crate::flash::Operands { out: po, q: pq, k: pk, v: pv, kc, vc };
        crate::flash::launch(b, &ops, ti, hq, hkv, head_dim, s, window, p.scale)?;
    } else if crate::attn_decode::fits(t, head_dim) {
        appended = true;
        let ops = crate::attn_decode::Operands { out: po, q: pq, k: pk, v: pv, kc, vc };
        let rec = start_at.map(|pos| crate::attn_decode::Recorded { pos, rows: cache.capacity });
        crate::attn_decode::launch(
            b,
            &ops,
            q_heads,
            cache.kv_heads,
            head_dim,
            start,
            p.window.unwrap_or(0),
            p.scale,
            rec,
        )?;
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

/// `Backend::attention_decode` with the batched decode kernels (rope, split attention and append
/// over every sequence at once, `SEQ_MAX` sequences a launch); `None` where they do not take
/// the head shape (the caller composes).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_decode(
    b: &CudaBackend,
    q: &Tensor<CudaBackend>,
    k: &Tensor<CudaBackend>,
    v: &Tensor<CudaBackend>,
    rope: &Rope,
    positions: &[usize],
    caches: &mut [&mut CudaKvCache],
    p: &AttentionParams,
) -> Result<Option<Tensor<CudaBackend>>> {
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
    if !crate::attn_decode::fits(1, head_dim) {
        return Ok(None);
    }
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
        let ops = crate::attn_decode::Operands {
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
        crate::attn_decode::launch_seqs(b, &ops, &kv, q_heads, kv_heads, head_dim, w, p.scale)?;
        for cache in chunk.iter_mut() {
            cache.len += 1;
        }
    }
    Ok(Some(out))
}
