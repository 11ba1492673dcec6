//! Attention over the paged KV pool (kv.rs, kernels/kv_blocks.cuh): flash attention for prefill
//! (flash.rs), the split decode kernels for one query token of each of many sequences
//! (decode.rs), a warp per (token, head) for the rest (kernels/attention.cu). Every kernel reads
//! the positions before the call from the pool through the sequence's block table and the call's
//! own from k / v; the call's rows are then written to the pool (kv_append, or the decode kernel
//! itself).

pub(crate) mod decode;
pub(crate) mod flash;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::backend::check::{self as args, AttentionDims};
use vt_core::backend::RELEASED;
use vt_core::{AttentionParams, DType, KvSeq, Result, Rope};

use self::decode::Batch;
use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::kv::{CudaKvPool, KvStore};
use crate::launch::{act, grid1, i32_of, launched, Overlapped};
use crate::limits::{ATT_MAX_D, KV_BLOCK};
use crate::ops::rope::rope_seqs;

/// Device addresses of one attention call: out and q `[t, q_heads, d]`, k and v
/// `[t, kv_heads, d]`, the pool layer's keys and values.
pub(crate) struct Operands {
    pub out: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub kc: u64,
    pub vc: u64,
}

/// Causal GQA attention of `q` over `seq`'s positions in `pool` and this call's `k`, `v`, then
/// writes them at `seq.start..`.
pub(crate) fn attention(
    b: &CudaBackend,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    pool: &CudaKvPool,
    seq: KvSeq<'_>,
    p: &AttentionParams,
) -> Result<CudaTensor> {
    let op = "attention";
    let AttentionDims { t, q_heads, kv_heads, head_dim } = args::attention(b, q, k, v, p)?;
    let store = pool.layer(op, &seq)?;
    check_store(op, store, kv_heads, head_dim, q, k)?;
    args::kv_table(b, op, &seq, t, KV_BLOCK, store.layout.blocks, p.window)?;
    let (pq, pk, pv) = (act(q, op)?, act(k, op)?, act(v, op)?);
    let start = seq.start;
    let used = (start + t).div_ceil(KV_BLOCK);
    // A recorded step reads its position and table from buffers its replays fill; otherwise they
    // travel with the call: `[start, table...]`.
    let recording = b.recording();
    let upload;
    let (pos_at, table, width) = match recording {
        Some(r) => {
            check(t == 1, op, || format!("a recorded step takes one token a sequence, not {t}"))?;
            let table = r.table_at(op, &[seq], store, p.window)?;
            (r.pos_at(op, start)?, table, r.table_width())
        }
        None => {
            let mut host = Vec::with_capacity(1 + used);
            i32_of(start + t, "position")?;
            host.push(start as u32);
            host.extend_from_slice(&seq.table[..used]);
            upload = b.upload_slice(&host)?;
            (upload.ptr(), upload.ptr() + 4, used)
        }
    };
    let out = b.empty(DType::BF16, q.shape())?;
    let ops = Operands { out: out.buffer().ptr(), q: pq, k: pk, v: pv, kc: store.keys(), vc: store.values() };
    let window = p.window.unwrap_or(0);
    if flash::fits(t, head_dim, b.k().max_shared) {
        flash::launch(b, &ops, table, t, q_heads, kv_heads, head_dim, start, window, p.scale)?;
    } else if decode::fits(t, head_dim) {
        // A recording's grid covers every position its replays may reach.
        let last = if recording.is_some() { width * KV_BLOCK - 1 } else { start };
        let keys = decode::visible(last, window);
        let batch = Batch { n: 1, seqs: 1, positions: pos_at, tables: table, width, keys, appended: false };
        // The split kernel writes the step's row itself.
        return decode::launch(b, &ops, &batch, q_heads, kv_heads, head_dim, window, p.scale).map(|()| out);
    } else {
        let start_at = if recording.is_some() { pos_at } else { 0 };
        simple(b, &ops, table, t, q_heads, kv_heads, head_dim, start, start_at, window, p.scale)?;
    }
    append(b, &ops, table, t, kv_heads * head_dim, start, recording.map(|_| pos_at), window)?;
    Ok(out)
}

/// The layer's storage takes these heads: `head_dim` up to what the kernels take.
fn check_store(
    op: &str,
    store: &KvStore,
    kv_heads: usize,
    head_dim: usize,
    q: &CudaTensor,
    k: &CudaTensor,
) -> Result<()> {
    let l = store.layout;
    check(kv_heads == l.kv_heads && head_dim == l.head_dim && head_dim <= ATT_MAX_D, op, || {
        format!("q {:?}, k {:?} over a pool layer of {} heads x {}", q.shape(), k.shape(), l.kv_heads, l.head_dim)
    })
}

/// The one-warp-per-(token, head) kernel, for what the others do not take.
#[allow(clippy::too_many_arguments)]
fn simple(
    b: &CudaBackend,
    o: &Operands,
    table: u64,
    t: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    start: usize,
    start_at: u64,
    window: usize,
    scale: f32,
) -> Result<()> {
    let (ti, hq, hkv, d, s, w) = (
        i32_of(t, "tokens")?,
        i32_of(q_heads, "heads")?,
        i32_of(kv_heads, "kv heads")?,
        head_dim as i32,
        i32_of(start, "position")?,
        i32_of(window, "window")?,
    );
    let mut l = b.stream().launch_builder(&b.k().attention);
    l.arg(&o.out).arg(&o.q).arg(&o.k).arg(&o.v).arg(&o.kc).arg(&o.vc).arg(&table);
    l.arg(&ti).arg(&hq).arg(&hkv).arg(&d).arg(&s).arg(&start_at).arg(&w).arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: ((t * q_heads).div_ceil(4) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: attention(bf16* out, q, k, v, const bf16* kc, const bf16* vc, const int* table, int
    // t, int q_heads, int kv_heads, int d, int start, const int* start_at, int window, float
    // scale): one warp per (token, head); q/out [t, q_heads, d], k/v [t, kv_heads, d] (checked), d
    // <= ATT_MAX_D; the table names a block of the layer for every position before `start` a query
    // sees (kv_table checked it, or a replay does); start_at is 0 or a recording's position.
    launched(unsafe { l.launch(cfg) }, "attention")
}

/// Writes the call's `t` rows of `row` values at positions `start..` (`start_at`: a recording's
/// position) through `table`, after the attention kernel that read the pool.
#[allow(clippy::too_many_arguments)]
fn append(
    b: &CudaBackend,
    o: &Operands,
    table: u64,
    t: usize,
    row: usize,
    start: usize,
    start_at: Option<u64>,
    window: usize,
) -> Result<()> {
    let (ti, ri, si, wi) =
        (i32_of(t, "tokens")?, i32_of(row, "row")?, i32_of(start, "position")?, i32_of(window, "window")?);
    let start_at = start_at.unwrap_or(0);
    let mut l = Overlapped::new(b, &b.k().kv_append);
    l.arg(&o.kc).arg(&o.vc).arg(&o.k).arg(&o.v).arg(&table).arg(&ti).arg(&ri).arg(&si).arg(&start_at).arg(&wi);
    // SAFETY: kv_append(bf16* kc, bf16* vc, const bf16* k, const bf16* v, const int* table, int t,
    // int row, int start, const int* start_at, int window): k/v hold t rows of `row` values; the
    // table names a block of the layer for every position the kernel writes (kv_table checked it,
    // or a replay does); queued after the attention kernel, which reads the rows a window's
    // writes may replace; the kernel starts with grid_dep_begin.
    unsafe { l.launch(grid1(t * row), "kv_append") }
}

/// Whether the batched decode kernels take this head dimension.
pub(crate) fn decode_fits(head_dim: usize) -> bool {
    decode::fits(1, head_dim)
}

/// `Backend::attention_decode` with the batched decode kernels (rope, split attention and the
/// rows' writes over every sequence at once), for a head dimension `decode_fits` took.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_step(
    b: &CudaBackend,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    rope: &Rope,
    pool: &CudaKvPool,
    seqs: &[KvSeq<'_>],
    p: &AttentionParams,
) -> Result<CudaTensor> {
    let op = "attention_decode";
    let n = seqs.len();
    let first = seqs.first().ok_or_else(|| crate::error::err(format!("{op}: no sequences")))?;
    let store = pool.layer(op, first)?;
    let (kv_heads, head_dim) = (store.layout.kv_heads, store.layout.head_dim);
    let q_heads = q.shape().get(1).copied().unwrap_or(0);
    check(
        q.shape() == [n, q_heads, head_dim]
            && k.shape() == [n, kv_heads, head_dim]
            && v.shape() == k.shape()
            && kv_heads > 0
            && q_heads % kv_heads == 0
            && seqs.iter().all(|s| s.layer == first.layer),
        op,
        || {
            format!(
                "{n} sequences over a pool layer of {kv_heads} heads x {head_dim}, q {:?}, k {:?}, v {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            )
        },
    )?;
    args::window(b, op, p.window)?;
    for seq in seqs {
        args::kv_table(b, op, seq, 1, KV_BLOCK, store.layout.blocks, p.window)?;
    }
    check(decode_fits(head_dim), op, || format!("the decode kernels do not take head dim {head_dim}"))?;
    let sequences = sequences(op, seqs)?;
    let (pq, pk, pv) = (act(q, op)?, act(k, op)?, act(v, op)?);
    let window = p.window.unwrap_or(0);
    // A recorded step reads the positions and tables from buffers its replays fill, and its grid
    // covers every position they may reach; otherwise they travel with the call: `[positions: n,
    // tables: n x width]`, the tables padded with RELEASED (never read).
    let inputs;
    let batch = match b.recording() {
        Some(r) => {
            let starts: Vec<usize> = seqs.iter().map(|s| s.start).collect();
            let positions = r.positions_at(op, &starts)?;
            let tables = r.table_at(op, seqs, store, p.window)?;
            let width = r.table_width();
            let keys = decode::visible(width * KV_BLOCK - 1, window);
            Batch { n, seqs: sequences, positions, tables, width, keys, appended: sequences < n }
        }
        None => {
            let width = seqs.iter().map(|s| (s.start + 1).div_ceil(KV_BLOCK)).max().unwrap_or(1);
            let mut host = Vec::with_capacity(n * (1 + width));
            for s in seqs {
                host.push(i32_of(s.start, "position")? as u32);
            }
            for s in seqs {
                let used = (s.start + 1).div_ceil(KV_BLOCK);
                host.extend_from_slice(&s.table[..used]);
                host.extend(std::iter::repeat_n(RELEASED, width - used));
            }
            inputs = b.upload_slice(&host)?;
            let last = seqs.iter().map(|s| s.start).max().unwrap_or(0);
            let (positions, tables) = (inputs.ptr(), inputs.ptr() + 4 * n as u64);
            Batch {
                n,
                seqs: sequences,
                positions,
                tables,
                width,
                keys: decode::visible(last, window),
                appended: sequences < n,
            }
        }
    };
    let out = b.empty(DType::BF16, q.shape())?;
    let (qr, kr) = (b.empty(DType::BF16, q.shape())?, b.empty(DType::BF16, k.shape())?);
    let ops = Operands {
        out: out.buffer().ptr(),
        q: qr.buffer().ptr(),
        k: kr.buffer().ptr(),
        v: pv,
        kc: store.keys(),
        vc: store.values(),
    };
    rope_seqs(b, ops.q, pq, n, q_heads, head_dim, batch.positions, rope)?;
    rope_seqs(b, ops.k, pk, n, kv_heads, head_dim, batch.positions, rope)?;
    if batch.appended {
        decode::append(b, &ops, &batch, kv_heads * head_dim)?;
    }
    decode::launch(b, &ops, &batch, q_heads, kv_heads, head_dim, window, p.scale)?;
    Ok(out)
}

/// The sequences `seqs`' rows are of (rows with the same table are one sequence's positions),
/// once no two rows write one place of the pool: the kernels write every row, and two writes of
/// one place would race.
fn sequences(op: &str, seqs: &[KvSeq<'_>]) -> Result<usize> {
    let mut places: Vec<(u32, usize)> =
        seqs.iter().map(|s| (s.table[s.start / KV_BLOCK], s.start % KV_BLOCK)).collect();
    places.sort_unstable();
    if let Some(w) = places.windows(2).find(|w| w[0] == w[1]) {
        let (block, at) = w[0];
        return Err(crate::error::err(format!("{op}: two rows write position {at} of block {block}")));
    }
    let mut tables: Vec<*const u32> = seqs.iter().map(|s| s.table.as_ptr()).collect();
    tables.sort_unstable();
    tables.dedup();
    Ok(tables.len())
}
