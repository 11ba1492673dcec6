// Attention decode: one query token of one sequence over its KV cache, split over positions
// ("flash decoding") so a long cache is read by many blocks at once instead of one warp per head
// walking it. attn_dec_split writes each split's softmax max, sum and unnormalised output;
// attn_dec_combine merges the splits. Same cache layout and windowing as attention.cu.

// Positions per block (4 warps, each 4 positions at a time with their K and V rows in flight).
#define ATT_DEC_SPLIT 64
#define ATT_DEC_MAX_D 256

// part[(h * splits + s) * (d + 2) + j]: j < d the split's output (sum of exp(score - m) * v),
// j = d its max m, j = d + 1 its sum of exp(score - m). Grid (splits, q_heads), 128 threads.
// d % 8 == 0, d <= ATT_DEC_MAX_D; the query sits at position `start` (or `*start_at` when that is
// not null), its own k/v in k, v. Splits past the visible positions write an empty partial
// (max -inf, sum 0), which the combine weighs 0: a recorded step sizes its grid for the cache's
// capacity once.
extern "C" __global__ void attn_dec_split(float* part, const bf16* q, const bf16* k, const bf16* v, const bf16* kc, const bf16* vc,
                                          int q_heads, int kv_heads, int d, int start, const int* start_at, int window, float scale,
                                          int splits) {
    grid_dep_begin();
    if (start_at) start = *start_at;
    __shared__ float wm[4], wl[4], wacc[4][ATT_DEC_MAX_D];
    const float NEG_INF = __int_as_float(0xff800000);
    int s = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kvh = h / (q_heads / kv_heads), row = kv_heads * d;
    int lo = window > 0 ? max(0, start + 1 - window) : 0;
    int p0 = lo + s * ATT_DEC_SPLIT, p1 = min(p0 + ATT_DEC_SPLIT, start + 1);
    bool on = lane * 8 < d;
    float qf[8], acc[8], m = NEG_INF, l = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) { qf[j] = 0.0f; acc[j] = 0.0f; }
    if (on) load_x8(q + (long long)h * d + lane * 8, qf);
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
        float sc[4], mn = m;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float kf[8];
            bf16x2(kr[j].x, kf[0], kf[1]); bf16x2(kr[j].y, kf[2], kf[3]); bf16x2(kr[j].z, kf[4], kf[5]); bf16x2(kr[j].w, kf[6], kf[7]);
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) dot += qf[e] * kf[e];
            dot = warp_sum(dot) * scale;
            sc[j] = pb + j < p1 ? dot : NEG_INF;
            mn = fmaxf(mn, sc[j]);
        }
        float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= corr;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float w = expf(sc[j] - mn), vf[8];
            bf16x2(vr[j].x, vf[0], vf[1]); bf16x2(vr[j].y, vf[2], vf[3]); bf16x2(vr[j].z, vf[4], vf[5]); bf16x2(vr[j].w, vf[6], vf[7]);
            l += w;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] += w * vf[e];
        }
        m = mn;
    }
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
    if (on)
#pragma unroll
        for (int e = 0; e < 8; e++) wacc[warp][lane * 8 + e] = acc[e];
    __syncthreads();
    float M = fmaxf(fmaxf(wm[0], wm[1]), fmaxf(wm[2], wm[3]));
    float* out = part + ((long long)h * splits + s) * (d + 2);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < 4; w++) a += wm[w] == NEG_INF ? 0.0f : wacc[w][j] * expf(wm[w] - M);
        out[j] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < 4; w++) L += wm[w] == NEG_INF ? 0.0f : wl[w] * expf(wm[w] - M);
        out[d] = M;
        out[d + 1] = L;
    }
}

// out[h, :] = the splits of head h merged. Grid: q_heads, 256 threads.
extern "C" __global__ void attn_dec_combine(bf16* out, const float* part, int d, int splits) {
    grid_dep_begin();
    const float* ph = part + (long long)blockIdx.x * splits * (d + 2);
    float M = __int_as_float(0xff800000);
    for (int s = 0; s < splits; s++) M = fmaxf(M, ph[(long long)s * (d + 2) + d]);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float L = 0.0f, A = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float* p = ph + (long long)s * (d + 2);
            float w = expf(p[d] - M);
            L += p[d + 1] * w;
            A += p[j] * w;
        }
        out[(long long)blockIdx.x * d + j] = f2bf(A / L);
    }
}
