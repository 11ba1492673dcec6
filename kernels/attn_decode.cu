// Attention decode: one query token of each of n sequences over its KV cache in the paged store
// (kv_blocks.cuh), split over positions ("flash decoding") so a long cache is read by many blocks
// at once instead of one warp per head walking it. The split kernels write each split's softmax
// max, sum and unnormalised output; attn_dec_combine merges the splits. Same windowing as
// attention.cu.
//
// Every split kernel's grid is (splits, head blocks, n): blockIdx.z is the sequence, whose query
// sits at position pos[z] (device memory: a recorded step's replays write it), with block table
// tables + z * width, its rows of q, k and v, and its q_heads * splits partials after the previous
// sequence's, so attn_dec_combine over n * q_heads "heads" merges them. Rows may continue one
// another (a verification's positions of one sequence, the same table at consecutive positions):
// attn_dec_append then writes every row into the store first, and the split kernels, told so by
// `appended`, read the earlier rows from there and write none.
#include "kv_blocks.cuh"

// Row i of k and v (n rows of `row` values, row % 8 == 0) into the store at pos[i] through table
// tables + i * width, before a split kernel whose rows continue one another reads them.
extern "C" __global__ void attn_dec_append(bf16* kc, bf16* vc, const bf16* k, const bf16* v, const int* tables, int width, const int* pos, int n,
                                           int row) {
    grid_dep_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, chunks = row / 8;
    if (i >= n * chunks) return;
    int r = (int)(i / chunks), c = (int)(i % chunks);
    long long at = kv_row_at(tables + (long long)r * width, pos[r], row) + 8 * c, from = (long long)r * row + 8 * c;
    *(uint4*)(kc + at) = *(const uint4*)(k + from);
    *(uint4*)(vc + at) = *(const uint4*)(v + from);
}

// The step's own k and v rows (KV head kvh) into the store at `start`, so that no kv_append launch
// follows: written by the one block of the KV head (its `lead` block) whose split [p0, p1) holds
// `start`. No block of the launch reads that row: the query's own key comes from k and v. Not when
// the launch's rows were `appended` before it.
__device__ __forceinline__ void append_own_row(bf16* kc, bf16* vc, const bf16* k, const bf16* v, const int* table, int kvh, int d,
                                               long long row, int start, int p0, int p1, bool lead) {
    if (!(lead && p0 <= start && p1 == start + 1)) return;
    long long at = kv_row_at(table, start, row) + kvh * d;
    for (int j = threadIdx.x; j < d / 8; j += blockDim.x) {
        *(uint4*)(kc + at + 8 * j) = *(const uint4*)(k + kvh * d + 8 * j);
        *(uint4*)(vc + at + 8 * j) = *(const uint4*)(v + kvh * d + 8 * j);
    }
}
// part[(h * splits + s) * (d + 2) + j]: j < d the split's output (sum of exp(score - m) * v),
// j = d its max m, j = d + 1 its sum of exp(score - m), split s covering `split` positions (a
// multiple of 16). Grid (splits, kv_heads * ceil(group / H), n), 128 threads (4 warps, each 4
// positions at a time with their K and V rows in flight): block y serves query heads
// h0 .. h0 + nh - 1 (nh <= H) of KV head y / ceil(group / H), and each K and V row it loads
// serves all of them, so a GQA group of G heads reads the cache G / H times, not G times.
// d % 8 == 0, d <= ATT_DEC_MAX_D; the query sits at position `start`, its own k/v in k, v. Splits
// past the visible positions write an empty partial (max -inf, sum 0), which the combine weighs 0:
// a batch's grid covers its longest sequence, a recorded step's the longest its replays may see.
template <int H>
__device__ __forceinline__ void attn_dec_split(float* part, const bf16* q, const bf16* k, const bf16* v, bf16* kc, bf16* vc,
                                               const int* table, int q_heads, int kv_heads, int d, int start, int window, float scale,
                                               int split, int splits, bool appended) {
    __shared__ float wm[4][H], wl[4][H], wacc[4][H][ATT_DEC_MAX_D];
    const float NEG_INF = __int_as_float(0xff800000);
    int group = q_heads / kv_heads, per_kv = (group + H - 1) / H;
    int s = blockIdx.x, kvh = blockIdx.y / per_kv, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int h0 = kvh * group + blockIdx.y % per_kv * H, nh = min(H, (kvh + 1) * group - h0), row = kv_heads * d;
    int lo = window > 0 ? max(0, start + 1 - window) : 0;
    int p0 = lo + s * split, p1 = min(p0 + split, start + 1);
    append_own_row(kc, vc, k, v, table, kvh, d, row, start, p0, p1, !appended && blockIdx.y % per_kv == 0);
    bool on = lane * 8 < d;
    float qf[H][8], acc[H][8], m[H], l[H];
#pragma unroll
    for (int i = 0; i < H; i++) {
        m[i] = NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) { qf[i][j] = 0.0f; acc[i][j] = 0.0f; }
        if (on && i < nh) load_x8(q + (long long)(h0 + i) * d + lane * 8, qf[i]);
    }
    for (int pb = p0 + warp * 4; pb < p1; pb += 16) {
        uint4 kr[4], vr[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int p = pb + j;
            if (p < p1 && on) {
                long long off = p >= start ? (long long)(p - start) * row : kv_row_at(table, p, row);
                const bf16* kb = p >= start ? k : kc;
                const bf16* vb = p >= start ? v : vc;
                kr[j] = *(const uint4*)(kb + off + kvh * d + lane * 8);
                vr[j] = *(const uint4*)(vb + off + kvh * d + lane * 8);
            } else {
                kr[j] = make_uint4(0, 0, 0, 0);
                vr[j] = kr[j];
            }
        }
        // sc[j][i]: position pb + j's score for head h0 + i, then its softmax weight.
        float sc[4][H];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float kf[8];
            bf16x2(kr[j].x, kf[0], kf[1]); bf16x2(kr[j].y, kf[2], kf[3]); bf16x2(kr[j].z, kf[4], kf[5]); bf16x2(kr[j].w, kf[6], kf[7]);
#pragma unroll
            for (int i = 0; i < H; i++) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) dot += qf[i][e] * kf[e];
                dot = warp_sum(dot) * scale;
                sc[j][i] = pb + j < p1 ? dot : NEG_INF;
            }
        }
#pragma unroll
        for (int i = 0; i < H; i++) {
            float mn = m[i];
#pragma unroll
            for (int j = 0; j < 4; j++) mn = fmaxf(mn, sc[j][i]);
            float corr = expf(m[i] - mn);
            l[i] *= corr;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[i][e] *= corr;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                sc[j][i] = expf(sc[j][i] - mn);
                l[i] += sc[j][i];
            }
            m[i] = mn;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float vf[8];
            bf16x2(vr[j].x, vf[0], vf[1]); bf16x2(vr[j].y, vf[2], vf[3]); bf16x2(vr[j].z, vf[4], vf[5]); bf16x2(vr[j].w, vf[6], vf[7]);
#pragma unroll
            for (int i = 0; i < H; i++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[i][e] += sc[j][i] * vf[e];
        }
    }
#pragma unroll
    for (int i = 0; i < H; i++) {
        if (lane == 0) { wm[warp][i] = m[i]; wl[warp][i] = l[i]; }
        if (on)
#pragma unroll
            for (int e = 0; e < 8; e++) wacc[warp][i][lane * 8 + e] = acc[i][e];
    }
    __syncthreads();
    for (int x = threadIdx.x; x < nh * d; x += blockDim.x) {
        int i = x / d, j = x % d;
        float M = fmaxf(fmaxf(wm[0][i], wm[1][i]), fmaxf(wm[2][i], wm[3][i])), a = 0.0f;
        for (int w = 0; w < 4; w++) a += wm[w][i] == NEG_INF ? 0.0f : wacc[w][i][j] * expf(wm[w][i] - M);
        part[((long long)(h0 + i) * splits + s) * (d + 2) + j] = a;
    }
    if ((int)threadIdx.x < nh) {
        int i = threadIdx.x;
        float M = fmaxf(fmaxf(wm[0][i], wm[1][i]), fmaxf(wm[2][i], wm[3][i])), L = 0.0f;
        for (int w = 0; w < 4; w++) L += wm[w][i] == NEG_INF ? 0.0f : wl[w][i] * expf(wm[w][i] - M);
        float* out = part + ((long long)(h0 + i) * splits + s) * (d + 2);
        out[d] = M;
        out[d + 1] = L;
    }
}

// The arguments every split kernel takes (the tensor-core ones ignore d).
#define ATT_DEC_ARGS                                                                                                              \
    float *part, const bf16 *q, const bf16 *k, const bf16 *v, bf16 *kc, bf16 *vc, const int *tables, int width, const int *pos,     \
        int q_heads, int kv_heads, int d, int window, float scale, int split, int splits, int appended
// Sequence blockIdx.z's part, q, k, v, kc, vc and table, as attn_dec_split and attn_dec_mma take them.
#define ATT_DEC_SEQ(D)                                                                                                            \
    part + (long long)blockIdx.z * q_heads * splits * ((D) + 2), q + (long long)blockIdx.z * q_heads * (D),                       \
        k + (long long)blockIdx.z * kv_heads * (D), v + (long long)blockIdx.z * kv_heads * (D), kc, vc,                           \
        tables + (long long)blockIdx.z * width

// H = 4 for head dims up to 128; H = 1 at d = 256, where four heads' accumulators cost more than
// the reads they save (docs/performance.md).
#define ATT_DEC_SPLIT_KERNEL(NAME, H)                                                                                             \
    extern "C" __global__ void NAME(ATT_DEC_ARGS) {                                                                               \
        grid_dep_begin();                                                                                                          \
        attn_dec_split<H>(ATT_DEC_SEQ(d), q_heads, kv_heads, d, pos[blockIdx.z], window, scale, split, splits, appended);         \
    }
ATT_DEC_SPLIT_KERNEL(attn_dec_split_h1, 1)
ATT_DEC_SPLIT_KERNEL(attn_dec_split_h4, 4)

// The same partials on bf16 tensor cores, for head dims D = 64, 128, 256 (flash decoding): a block
// of ATT_MMA_WARPS warps serves up to 16 query heads of one KV head, the rows of the MMAs (rows
// past the group's heads are zero), over `split` positions, the warps taking turns at 16 of them:
// each copies its 16 keys' K and V rows into tiles of its own, takes S = Q K^T, the online softmax
// in f32 and O += P V with P rounded to bf16 (as flash_attn.cu). The next K tile is copied during
// the softmax and P V, the next V tile during the next Q K^T. The CUDA-core kernel above takes a dot
// per position and head with a warp reduction each, which bound it on shuffles, not on the cache's
// bytes (half the time here, docs/performance.md).
// The warps' softmax states merge into the split's partial in shared memory (each warp's f32 O in
// place of its K and V tiles). Grid (splits, kv_heads * ceil(group / 16), n), 32 * ATT_MMA_WARPS
// threads, ATT_MMA_SHARED(D) bytes of dynamic shared memory; attn_dec_split's arguments but d.
#define ATT_MMA_WARPS 4
#define ATT_MMA_KEYS 16
#define ATT_MMA_SHARED(D) (16 * (D) * 2 + ATT_MMA_WARPS * 2 * ATT_MMA_KEYS * (D) * 2)
template <int D>
__device__ __forceinline__ void attn_dec_mma(float* part, const bf16* q, const bf16* k, const bf16* v, bf16* kc, bf16* vc, const int* table,
                                             int q_heads, int kv_heads, int start, int window, float scale, int split, int splits,
                                             bool appended) {
    constexpr int CH = D / 8, RPP = 32 / CH;         // 16-byte chunks per row; rows per pass of a warp's copies
    constexpr unsigned TILE = ATT_MMA_KEYS * D * 2;  // bytes of a warp's K (or V) tile
    static_assert(2 * TILE == 16 * D * 4, "a warp's f32 O [16][D] fits in place of its K and V tiles");
    extern __shared__ __align__(16) bf16 ad_sh[];
    __shared__ float wm[ATT_MMA_WARPS][16], wl[ATT_MMA_WARPS][16];
    const float NEG_INF = __int_as_float(0xff800000), sl2 = scale * 1.4426950408889634f;
    int group = q_heads / kv_heads, per_kv = (group + 15) / 16;
    int s = blockIdx.x, kvh = blockIdx.y / per_kv, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c2 = (lane & 3) * 2;
    int h0 = kvh * group + blockIdx.y % per_kv * 16, nh = min(16, (kvh + 1) * group - h0);
    long long row = (long long)kv_heads * D;
    int lo = window > 0 ? max(0, start + 1 - window) : 0;
    int b0 = lo + s * split, p1 = min(b0 + split, start + 1);
    const unsigned sq = smem_addr(ad_sh), sk = sq + 16 * D * 2 + warp * 2 * TILE, sv = sk + TILE;
    for (int i = tid; i < 16 * CH; i += blockDim.x) {
        int r = i / CH, c = i % CH;
        cp_async16(sq + fa_swz<D>(r, c), q + (r < nh ? (long long)(h0 + r) * D + c * 8 : 0), r < nh);
    }
    // Rows pt .. pt + 15 of K or V (zero at and past p1) into this warp's tile, as a copy group: the
    // step's own position from k / v, earlier ones from the store. The rows lie in at most two
    // blocks (a window's splits need not start at a block's start), both holding visible positions.
    auto load = [&](unsigned dst, const bf16* cur, const bf16* cache, int pt) {
        if (pt < p1) {
            int first = pt / KV_BLOCK, last = min(pt + ATT_MMA_KEYS, p1) - 1;
            long long ba = (long long)table[first] * KV_BLOCK, bb = (long long)table[last / KV_BLOCK] * KV_BLOCK;
#pragma unroll
            for (int i = 0; i < ATT_MMA_KEYS / RPP; i++) {
                int r = lane / CH + i * RPP, c = lane % CH, p = pt + r;
                bool ok = p < p1;
                long long at = p >= start ? (long long)(p - start) * row : ((p / KV_BLOCK == first ? ba : bb) + p % KV_BLOCK) * row;
                cp_async16(dst + fa_swz<D>(r, c), (p >= start ? cur : cache) + (ok ? at + kvh * D + c * 8 : 0), ok);
            }
        }
        cp_async_commit();
    };
    int pt = b0 + ATT_MMA_KEYS * warp;
    load(sk, k, kc, pt);
    load(sv, v, vc, pt);
    append_own_row(kc, vc, k, v, table, kvh, D, row, start, b0, p1, !appended && blockIdx.y % per_kv == 0);
    cp_async_wait<0>();
    __syncthreads();  // Q and this warp's first tiles are in

    // ldmatrix addresses as in flash_attn.cu: Q (A) rows lane % 16, K (B of Q K^T) rows lane % 8 +
    // 8 (lane / 16), V (transposed B of P V) rows lane % 8 + 8 (lane / 8 % 2).
    unsigned qa[4], kb[4], vb[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        qa[j] = sq + (lane & 15) * D * 2 + (((2 * j + (lane >> 4)) ^ (lane & 7)) << 4);
        kb[j] = sk + ((lane & 7) + ((lane >> 4) << 3)) * D * 2 + (((2 * j + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
        vb[j] = sv + ((lane & 7) + (((lane >> 3) & 1) << 3)) * D * 2 + (((2 * j + (lane >> 4)) ^ (lane & 7)) << 4);
    }
    float o[D / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int x = 0; x < 4; x++) o[j][x] = 0.0f;
    while (pt < p1) {
        // S: rows g (x < 2) and g + 8 of heads, keys pt + 8 j + c2 + x % 2.
        float sc[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            unsigned a[4], b[4];
            ldsm_x4(a, qa[ks & 3] + (ks >> 2) * 128);
            ldsm_x4(b, kb[ks & 3] + (ks >> 2) * 128);
            mma_bf16(sc[0], a, b[0], b[1]);
            mma_bf16(sc[1], a, b[2], b[3]);
        }
        int next = pt + ATT_MMA_KEYS * ATT_MMA_WARPS;
        __syncwarp();  // every lane is done with the K tile
        load(sk, k, kc, next);
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    float& val = sc[j][2 * hr + x];
                    if (pt + 8 * j + c2 + x >= p1) val = NEG_INF;
                    mx = fmaxf(mx, val);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // The tile's first key is visible, so mn is finite; the scale is positive, so it is
            // folded into the exponent.
            float mn = fmaxf(m[hr], mx), corr = exp2f((m[hr] - mn) * sl2);
            m[hr] = mn;
            l[hr] *= corr;
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                o[j][2 * hr] *= corr;
                o[j][2 * hr + 1] *= corr;
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    float e = exp2f((sc[j][2 * hr + x] - mn) * sl2);
                    sc[j][2 * hr + x] = e;
                    l[hr] += e;
                }
        }
        cp_async_wait<1>();  // this tile's V (the next K may still be in flight)
        __syncwarp();
        unsigned a[4] = {pack_bf16(sc[0][0], sc[0][1]), pack_bf16(sc[0][2], sc[0][3]), pack_bf16(sc[1][0], sc[1][1]), pack_bf16(sc[1][2], sc[1][3])};
#pragma unroll
        for (int db = 0; db < D / 16; db++) {
            unsigned b[4];
            ldsm_x4_trans(b, vb[db & 3] + (db >> 2) * 128);
            mma_bf16(o[2 * db], a, b[0], b[1]);
            mma_bf16(o[2 * db + 1], a, b[2], b[3]);
        }
        __syncwarp();  // every lane is done with the V tile
        load(sv, v, vc, next);
        cp_async_wait<1>();  // the next K (the next V may still be in flight)
        __syncwarp();
        pt = next;
    }
    cp_async_wait<0>();
    __syncwarp();
    // This warp's state: m and l per row (l summed over the row's four lanes), O over its tiles.
    float* wo = (float*)((char*)ad_sh + 16 * D * 2 + warp * 2 * TILE);
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
        if ((lane & 3) == 0) {
            wm[warp][g + 8 * hr] = m[hr];
            wl[warp][g + 8 * hr] = l[hr];
        }
#pragma unroll
        for (int j = 0; j < D / 8; j++) *(float2*)(wo + (g + 8 * hr) * D + 8 * j + c2) = make_float2(o[j][2 * hr], o[j][2 * hr + 1]);
    }
    __syncthreads();
    // The split's partial: the warps' states merged at their common max (scores scaled); wf holds
    // each warp's factor per row (0 for a warp that saw no key).
    __shared__ float wf[ATT_MMA_WARPS][16];
    if (tid < 16) {
        float M = NEG_INF, L = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_MMA_WARPS; w++) M = fmaxf(M, wm[w][tid]);
#pragma unroll
        for (int w = 0; w < ATT_MMA_WARPS; w++) {
            wf[w][tid] = wm[w][tid] == NEG_INF ? 0.0f : exp2f((wm[w][tid] - M) * sl2);
            L += wl[w][tid] * wf[w][tid];
        }
        if (tid < nh) {
            float* out = part + ((long long)(h0 + tid) * splits + s) * (D + 2);
            out[D] = M * scale;
            out[D + 1] = L;
        }
    }
    __syncthreads();
    const float* w0 = (const float*)((const char*)ad_sh + 16 * D * 2);
    for (int x = tid; x < nh * D; x += blockDim.x) {
        int i = x / D, j = x % D;
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_MMA_WARPS; w++) a += w0[w * (2 * TILE / 4) + i * D + j] * wf[w][i];
        part[((long long)(h0 + i) * splits + s) * (D + 2) + j] = a;
    }
}

#define ATT_DEC_MMA_KERNEL(NAME, D)                                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * ATT_MMA_WARPS) NAME(ATT_DEC_ARGS) {                                          \
        grid_dep_begin();                                                                                                          \
        attn_dec_mma<D>(ATT_DEC_SEQ(D), q_heads, kv_heads, pos[blockIdx.z], window, scale, split, splits, appended);              \
    }
ATT_DEC_MMA_KERNEL(attn_dec_mma_d64, 64)
ATT_DEC_MMA_KERNEL(attn_dec_mma_d128, 128)
ATT_DEC_MMA_KERNEL(attn_dec_mma_d256, 256)

// out[h, :] = the splits of head h merged. Grid: q_heads, d to ATT_DEC_COMBINE_THREADS threads
// (whole warps): the block finds the splits' max together, then blockDim / d groups of d threads
// take every (blockDim / d)-th split, ATT_DEC_COMBINE_UNROLL splits' loads in flight, and the
// groups' sums are added in group order (one thread per output walking all the splits was 1.5x
// slower at many splits).
#define ATT_DEC_COMBINE_UNROLL 4
extern "C" __global__ void attn_dec_combine(bf16* out, const float* part, int d, int splits) {
    __shared__ float red[32], sa[ATT_DEC_COMBINE_THREADS], sl[ATT_DEC_COMBINE_THREADS];
    grid_dep_begin();
    const float* ph = part + (long long)blockIdx.x * splits * (d + 2);
    float M = __int_as_float(0xff800000);
    for (int s = threadIdx.x; s < splits; s += blockDim.x) M = fmaxf(M, ph[(long long)s * (d + 2) + d]);
    M = block_reduce<true>(M, red);
    int groups = blockDim.x / d, g = threadIdx.x / d, j = threadIdx.x % d;
    float L = 0.0f, A = 0.0f;
    if (g < groups) {
#pragma unroll ATT_DEC_COMBINE_UNROLL
        for (int s = g; s < splits; s += groups) {
            const float* p = ph + (long long)s * (d + 2);
            float w = expf(p[d] - M);
            L += p[d + 1] * w;
            A += p[j] * w;
        }
    }
    sa[threadIdx.x] = A;
    sl[threadIdx.x] = L;
    __syncthreads();
    if ((int)threadIdx.x < d) {
        for (int h = 1; h < groups; h++) {
            A += sa[h * d + threadIdx.x];
            L += sl[h * d + threadIdx.x];
        }
        out[(long long)blockIdx.x * d + threadIdx.x] = f2bf(A / L);
    }
}
