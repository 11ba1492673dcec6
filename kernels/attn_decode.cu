// Attention decode: one query token of one sequence over its KV cache, split over positions
// ("flash decoding") so a long cache is read by many blocks at once instead of one warp per head
// walking it. attn_dec_split writes each split's softmax max, sum and unnormalised output;
// attn_dec_combine merges the splits. Same cache layout and windowing as attention.cu.

// Positions per block (4 warps, each 4 positions at a time with their K and V rows in flight).
#define ATT_DEC_SPLIT 64
#define ATT_DEC_MAX_D 256
// part[(h * splits + s) * (d + 2) + j]: j < d the split's output (sum of exp(score - m) * v),
// j = d its max m, j = d + 1 its sum of exp(score - m). Grid (splits, kv_heads * ceil(group / H)),
// 128 threads: block y serves query heads h0 .. h0 + nh - 1 (nh <= H) of KV head
// y / ceil(group / H), and each K and V row it loads serves all of them, so a GQA group of G heads
// reads the cache G / H times, not G times. d % 8 == 0, d <= ATT_DEC_MAX_D; the query sits at
// position `start` (or `*start_at` when that is not null), its own k/v in k, v. Splits past the
// visible positions write an empty partial (max -inf, sum 0), which the combine weighs 0: a
// recorded step sizes its grid for the cache's capacity once.
template <int H>
__device__ __forceinline__ void attn_dec_split(float* part, const bf16* q, const bf16* k, const bf16* v, const bf16* kc, const bf16* vc,
                                               int q_heads, int kv_heads, int d, int start, const int* start_at, int window,
                                               float scale, int splits) {
    grid_dep_begin();
    if (start_at) start = *start_at;
    __shared__ float wm[4][H], wl[4][H], wacc[4][H][ATT_DEC_MAX_D];
    const float NEG_INF = __int_as_float(0xff800000);
    int group = q_heads / kv_heads, per_kv = (group + H - 1) / H;
    int s = blockIdx.x, kvh = blockIdx.y / per_kv, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int h0 = kvh * group + blockIdx.y % per_kv * H, nh = min(H, (kvh + 1) * group - h0), row = kv_heads * d;
    int lo = window > 0 ? max(0, start + 1 - window) : 0;
    int p0 = lo + s * ATT_DEC_SPLIT, p1 = min(p0 + ATT_DEC_SPLIT, start + 1);
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
                long long off = p >= start ? (long long)(p - start) * row : (long long)(window > 0 ? p % window : p) * row;
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

// H = 4 for head dims up to 128 (H200, 4000 cached keys: Laguna's 64 / 8 heads 49.7 -> 36.6 µs);
// H = 1 at d = 256, where four heads' accumulators cost more than the reads they save (Qwen3.5's
// 16 / 2 heads: 24.7 µs with H = 1, 33.4 with H = 4).
#define ATT_DEC_SPLIT_KERNEL(NAME, H)                                                                                             \
    extern "C" __global__ void NAME(float* part, const bf16* q, const bf16* k, const bf16* v, const bf16* kc, const bf16* vc,      \
                                    int q_heads, int kv_heads, int d, int start, const int* start_at, int window, float scale,     \
                                    int splits) {                                                                                  \
        attn_dec_split<H>(part, q, k, v, kc, vc, q_heads, kv_heads, d, start, start_at, window, scale, splits);                  \
    }
ATT_DEC_SPLIT_KERNEL(attn_dec_split_h1, 1)
ATT_DEC_SPLIT_KERNEL(attn_dec_split_h4, 4)

// One token of each of up to SEQ_MAX sequences, blockIdx.z the sequence: its rows of q, k and v,
// its cache (kc.p, vc.p), its position start.v; part holds each sequence's q_heads * splits
// partials in turn, so attn_dec_combine over seqs * q_heads "heads" merges them.
#define ATT_DEC_SPLIT_SEQS_KERNEL(NAME, H)                                                                                        \
    extern "C" __global__ void NAME(float* part, const bf16* q, const bf16* k, const bf16* v, SeqPtrs kc, SeqPtrs vc, SeqInts start, \
                                    int q_heads, int kv_heads, int d, int window, float scale, int splits) {                       \
        int seq = blockIdx.z;                                                                                                      \
        attn_dec_split<H>(part + (long long)seq * q_heads * splits * (d + 2), q + (long long)seq * q_heads * d,                    \
                          k + (long long)seq * kv_heads * d, v + (long long)seq * kv_heads * d, (const bf16*)kc.p[seq],           \
                          (const bf16*)vc.p[seq], q_heads, kv_heads, d, start.v[seq], nullptr, window, scale, splits);            \
    }
ATT_DEC_SPLIT_SEQS_KERNEL(attn_dec_split_seqs_h1, 1)
ATT_DEC_SPLIT_SEQS_KERNEL(attn_dec_split_seqs_h4, 4)

// out[h, :] = the splits of head h merged. Grid: q_heads, d to ATT_DEC_COMBINE_THREADS threads
// (whole warps): the block finds the splits' max together, then blockDim / d groups of d threads
// take every (blockDim / d)-th split, ATT_DEC_COMBINE_UNROLL splits' loads in flight, and the
// groups' sums are added in group order. (One thread per output walking all the splits took
// 15 us of ncu time at 63 splits of d = 256; this takes 10.)
#define ATT_DEC_COMBINE_THREADS 1024
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
