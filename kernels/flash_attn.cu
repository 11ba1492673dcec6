// Flash-style causal GQA attention for prefill (many queries per call): bf16 tensor cores for
// Q K^T and P V, online softmax in f32 (exp2 with the scale folded in), never materialising the
// score matrix. Same contract as `attention` (attention.cu): keys before `start` come from the
// paged store through the sequence's block table, this call's from k / v; kv_append runs
// afterwards. A query at position p sees keys p - window < j <= p (window 0: all).
#include "kv_blocks.cuh"
//
// Block: WARPS warps of 16 * MI query rows, ROWS = 16 * MI * WARPS rows in all, which are `hpb`
// heads of one KV group times ROWS / hpb consecutive queries (head-major), so that every K / V tile
// copied to shared memory serves ROWS rows while the block's queries stay few (a short causal
// diagonal). A warp of MI row tiles reuses each K / V fragment it loads MI times.
// Key tiles of FA_BN = KV_BLOCK positions: a tile is one block of the store. Shared memory holds the Q rows, one K and one V tile (bf16, rows XOR-swizzled
// in 16-byte chunks so ldmatrix is conflict-free): the V copy overlaps Q K^T and the next K copy
// overlaps P V.

// bq_log2: log2 of the block's queries (ROWS / hpb, at least 16 * MI).
template <int D, int WARPS, int MI>
__device__ __forceinline__ void flash_attn(bf16* out, const bf16* q, const bf16* k, const bf16* v, const bf16* kc, const bf16* vc,
                                           const int* table, int t, int q_heads, int kv_heads, int start, int window, float scale_log2,
                                           int bq_log2, float* part) {
    static_assert(FA_BN == KV_BLOCK, "a key tile is one block of the store");
    constexpr int CH = D / 8, WR = 16 * MI, ROWS = WR * WARPS, THREADS = 32 * WARPS;
    // Copies: thread tid moves chunk tid % CH of rows tid / CH + i * RSTEP; RSTEP is a multiple
    // of 8, so all its rows share one swizzle.
    constexpr int RSTEP = THREADS / CH;
    static_assert(RSTEP % 8 == 0, "a thread's copy rows must share their swizzle");
    extern __shared__ __align__(16) bf16 fa_sh[];
    // Shared addresses as 32-bit offsets (ldmatrix and cp.async take them), so that every
    // ldmatrix below is a per-lane base plus an immediate.
    const unsigned sq = smem_addr(fa_sh), sk = sq + ROWS * D * 2, sv = sk + FA_BN * D * 2;
    const int bq = 1 << bq_log2;
    // Longest (latest) query tiles first: they have the most keys.
    int q0 = (gridDim.x - 1 - blockIdx.x) * bq, h0 = blockIdx.y * (ROWS / bq), kvh = h0 / (q_heads / kv_heads);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c2 = (lane & 3) * 2;
    const int cr = tid / CH, cc = tid % CH;  // this thread's first copy row and its chunk
    const unsigned cdst = fa_swz<D>(cr, cc);
    long long kv_row = (long long)kv_heads * D;

#pragma unroll
    for (int i = 0; i < ROWS / RSTEP; i++) {
        int r = cr + i * RSTEP, tok = q0 + (r & (bq - 1));
        bool ok = tok < t;
        cp_async16(sq + cdst + i * RSTEP * D * 2, q + (ok ? ((long long)tok * q_heads + h0 + (r >> bq_log2)) * D + cc * 8 : 0), ok);
    }
    // Key positions this block can see.
    int hi = start + min(q0 + bq, t) - 1;
    int lo = window > 0 ? max(0, start + q0 - window + 1) : 0;
    auto load_kv = [&](unsigned dst, const bf16* cur, const bf16* cache, int p0) {
        dst += cdst;
        if (p0 >= start && p0 + FA_BN - 1 <= hi) {  // the whole tile from this call's rows
            const bf16* src = cur + (p0 - start + cr) * kv_row + kvh * D + cc * 8;
#pragma unroll
            for (int i = 0; i < FA_BN / RSTEP; i++) cp_async16(dst + i * RSTEP * D * 2, src + i * RSTEP * kv_row, true);
            return;
        }
        // The tile's block of the store, which holds a position some query of this block sees (the
        // first tile holds `lo`, later ones start past it); rows before `start` come from it.
        int moved = p0 < start ? table[p0 / KV_BLOCK] * KV_BLOCK - p0 : 0;  // its first row - p0
#pragma unroll
        for (int i = 0; i < FA_BN / RSTEP; i++) {
            int p = p0 + cr + i * RSTEP;
            const bf16* src = cur;
            // Rows before lo (the tile's first block may start before it) no query of the block
            // sees: zeros, not whatever the pool holds there (a P of 0 times a NaN is NaN).
            bool ok = p <= hi && p >= lo;
            if (ok) src = p >= start ? cur + (p - start) * kv_row : cache + (p + moved) * kv_row;
            cp_async16(dst + i * RSTEP * D * 2, src + (ok ? kvh * D + cc * 8 : 0), ok);
        }
    };
    // Split z of gridDim.z takes its share of the block's key tiles (none: it still writes its
    // empty partials, which the merge weighs at zero).
    int first = lo / FA_BN, tiles = hi / FA_BN - first + 1, per = (tiles + gridDim.z - 1) / gridDim.z;
    int p0 = (first + (int)blockIdx.z * per) * FA_BN, p_end = min(hi, p0 + per * FA_BN - 1);
    if (p0 <= p_end) load_kv(sk, k, kc, p0);
    cp_async_commit();

    // ldmatrix row addresses. Row r's chunk c sits at chunk c ^ (r & 7), and every row a lane
    // addresses has r & 7 == lane & 7, so chunk 2 * ks + b (b: 0 or 1 by lane) lands at
    // 8 * (ks / 4) + ((2 * (ks % 4) + b) ^ (lane & 7)): a per-lane offset for each ks % 4 plus an
    // immediate. Q (A operand) rows warp * WR + lane % 16 (+ 16 per row tile), chunk b = lane / 16; K (B operand of
    // Q K^T) rows lane % 8 + 8 * (lane / 16), b = lane / 8 % 2; V (transposed B operand of P V)
    // rows lane % 8 + 8 * (lane / 8 % 2), b = lane / 16.
    unsigned qa[4], kb[4], vb[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        qa[j] = sq + (warp * WR + (lane & 15)) * D * 2 + (((2 * j + (lane >> 4)) ^ (lane & 7)) << 4);
        kb[j] = sk + ((lane & 7) + ((lane >> 4) << 3)) * D * 2 + (((2 * j + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
        vb[j] = sv + ((lane & 7) + (((lane >> 3) & 1) << 3)) * D * 2 + (((2 * j + (lane >> 4)) ^ (lane & 7)) << 4);
    }

    float o[MI][D / 8][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int j = 0; j < D / 8; j++)
#pragma unroll
            for (int x = 0; x < 4; x++) o[mi][j][x] = 0.0f;
    const float neg_inf = __int_as_float(0xff800000);
    float m[MI][2], l[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) m[mi][hr] = neg_inf, l[mi][hr] = 0.0f;
    // This warp's WR rows: one head, queries qw .. qw + WR - 1.
    int hw = h0 + ((warp * WR) >> bq_log2), qw = q0 + ((warp * WR) & (bq - 1));

    for (; p0 <= p_end; p0 += FA_BN) {
        cp_async_wait<0>();
        __syncthreads();  // K (and Q) in; every warp is done with the previous V
        load_kv(sv, v, vc, p0);
        cp_async_commit();
        // A tile none of this warp's queries sees (beyond its diagonal, or behind its window)
        // changes nothing: skip its arithmetic.
        bool live = p0 <= start + qw + WR - 1 && (window == 0 || p0 + FA_BN - 1 > start + qw - window);
        float s[MI][FA_BN / 8][4];
        if (live) {
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int j = 0; j < FA_BN / 8; j++)
#pragma unroll
                    for (int x = 0; x < 4; x++) s[mi][j][x] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
                unsigned a[MI][4];
#pragma unroll
                for (int mi = 0; mi < MI; mi++) ldsm_x4(a[mi], qa[ks & 3] + mi * 16 * D * 2 + (ks >> 2) * 128);
#pragma unroll
                for (int nb = 0; nb < FA_BN / 16; nb++) {
                    unsigned b[4];
                    ldsm_x4(b, kb[ks & 3] + nb * 16 * D * 2 + (ks >> 2) * 128);
#pragma unroll
                    for (int mi = 0; mi < MI; mi++) {
                        mma_bf16(s[mi][2 * nb], a[mi], b[0], b[1]);
                        mma_bf16(s[mi][2 * nb + 1], a[mi], b[2], b[3]);
                    }
                }
            }
            // Mask (not needed when every key of the tile is visible to every query of the warp),
            // online softmax per row (rows g and g + 8 of each row tile; 4 lanes per row) on the
            // raw scores: the scale is positive, so it is folded into the exponent.
            bool interior = p0 + FA_BN - 1 <= start + qw && (window == 0 || p0 > start + qw + WR - 1 - window);
            // Row r's query position minus the position of this lane's first key (p0 + c2): key
            // j * 8 + x of the tile is visible to it iff j * 8 + x <= that (and > that - window).
            int rel = start + qw + g - p0 - c2;
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    float mx = neg_inf;
#pragma unroll
                    for (int j = 0; j < FA_BN / 8; j++)
#pragma unroll
                        for (int x = 0; x < 2; x++) {
                            float val = s[mi][j][2 * hr + x];
                            if (!interior) {
                                int lim = rel + mi * 16 + 8 * hr;
                                if ((j * 8 + x > lim) | ((window > 0) & (j * 8 + x <= lim - window))) val = neg_inf;
                            }
                            s[mi][j][2 * hr + x] = val;
                            mx = fmaxf(mx, val);
                        }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    float mn = fmaxf(m[mi][hr], mx);
                    // A row with nothing visible yet stays at zero.
                    float base = mn == neg_inf ? 0.0f : mn * scale_log2;
                    float corr = exp2f(m[mi][hr] * scale_log2 - base);
                    m[mi][hr] = mn;
                    l[mi][hr] *= corr;
#pragma unroll
                    for (int j = 0; j < D / 8; j++) {
                        o[mi][j][2 * hr] *= corr;
                        o[mi][j][2 * hr + 1] *= corr;
                    }
#pragma unroll
                    for (int j = 0; j < FA_BN / 8; j++)
#pragma unroll
                        for (int x = 0; x < 2; x++) {
                            float e = exp2f(fmaf(s[mi][j][2 * hr + x], scale_log2, -base));
                            s[mi][j][2 * hr + x] = e;
                            l[mi][hr] += e;
                        }
                }
        }
        cp_async_wait<0>();
        __syncthreads();  // V in; every warp is done with K
        if (p0 + FA_BN <= p_end) load_kv(sk, k, kc, p0 + FA_BN);
        cp_async_commit();
        if (!live) continue;
        // O += P V: the score accumulators are already the A fragments of the next product.
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; kk++) {
            unsigned a[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                a[mi][0] = pack_bf16(s[mi][2 * kk][0], s[mi][2 * kk][1]);
                a[mi][1] = pack_bf16(s[mi][2 * kk][2], s[mi][2 * kk][3]);
                a[mi][2] = pack_bf16(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
                a[mi][3] = pack_bf16(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
            }
#pragma unroll
            for (int db = 0; db < D / 16; db++) {
                unsigned b[4];
                ldsm_x4_trans(b, vb[db & 3] + kk * 16 * D * 2 + (db >> 2) * 128);
#pragma unroll
                for (int mi = 0; mi < MI; mi++) {
                    mma_bf16(o[mi][2 * db], a[mi], b[0], b[1]);
                    mma_bf16(o[mi][2 * db + 1], a[mi], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float sum = l[mi][hr];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            int tok = qw + mi * 16 + g + 8 * hr;
            if (tok >= t) continue;
            if (part) {
                // This split's share, unnormalised, as attn_dec_combine merges them: the values,
                // then the row's max score (natural units) and its sum of exponentials.
                float* dst = part + (((long long)tok * q_heads + hw) * gridDim.z + blockIdx.z) * (D + 2) + c2;
#pragma unroll
                for (int j = 0; j < D / 8; j++) *(float2*)(dst + 8 * j) = make_float2(o[mi][j][2 * hr], o[mi][j][2 * hr + 1]);
                if (c2 == 0) {
                    dst[D] = m[mi][hr] * scale_log2 * 0.69314718f;  // -inf where it saw no key
                    dst[D + 1] = sum;
                }
                continue;
            }
            float inv = 1.0f / sum;
            unsigned* dst = (unsigned*)(out + ((long long)tok * q_heads + hw) * D + c2);
#pragma unroll
            for (int j = 0; j < D / 8; j++) dst[j * 4] = pack_bf16(o[mi][j][2 * hr] * inv, o[mi][j][2 * hr + 1] * inv);
        }
}

// Grid: (ceil(t / bq), q_heads / hpb, splits) with bq = 16 * MI * WARPS / hpb = 1 << bq_log2; 32 *
// WARPS threads, (16 * MI * WARPS + 2 * 64) * D bf16 of dynamic shared memory. One split writes
// `out`; several (few queries over many keys: too few blocks otherwise) write their partials to
// `part` ([t * q_heads, splits, D + 2] floats) for attn_dec_combine, and `out` is not touched.
#define FA_KERNEL(NAME, D, WARPS, MI)                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                                                    \
        NAME(bf16* out, const bf16* q, const bf16* k, const bf16* v, const bf16* kc, const bf16* vc, const int* table, int t,        \
             int q_heads, int kv_heads, int start, int window, float scale_log2, int bq_log2, float* part) {                        \
        flash_attn<D, WARPS, MI>(out, q, k, v, kc, vc, table, t, q_heads, kv_heads, start, window, scale_log2, bq_log2, part);   \
    }
// d = 128 takes two row tiles per warp (255 registers, no spills: each K / V fragment serves twice
// the rows, docs/performance.md); d = 256 has no registers for a second.
FA_KERNEL(flash_attn_d64, 64, 4, 1)
FA_KERNEL(flash_attn_d128, 128, 4, 2)
FA_KERNEL(flash_attn_d256, 256, 8, 1)
