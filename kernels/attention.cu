// Causal (optionally sliding-window) GQA attention over the paged KV store (kv_blocks.cuh).
//
// The attention kernels read positions before `start` from the store through the sequence's block
// table and this call's own keys from `k`/`v`; kv_append then writes this call's rows, on the same
// stream.
#include "kv_blocks.cuh"

// Writes this call's last min(t, window) positions (all t without a window: earlier ones no later
// query sees) through `table`; `start_at`, when not null, holds the start position instead of
// `start`.
extern "C" __global__ void kv_append(bf16* kc, bf16* vc, const bf16* k, const bf16* v, const int* table, int t, int row, int start,
                                     const int* start_at, int window) {
    grid_dep_begin();
    if (start_at) start = *start_at;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * row) return;
    int tok = (int)(i / row), c = (int)(i % row);
    if (window > 0 && tok < t - window) return;
    long long at = kv_row_at(table, start + tok, row) + c;
    kc[at] = k[i];
    vc[at] = v[i];
}

// One warp per (query token, query head), online softmax in f32. Block: 128 threads (4 warps);
// grid covers t * q_heads warps. window 0 = none. d <= ATT_MAX_D.
// `start_at`, when not null, holds the start position instead of `start`.
extern "C" __global__ void attention(bf16* out, const bf16* q, const bf16* k, const bf16* v, const bf16* kc, const bf16* vc,
                                     const int* table, int t, int q_heads, int kv_heads, int d, int start, const int* start_at, int window,
                                     float scale) {
    if (start_at) start = *start_at;
    int w = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (w >= t * q_heads) return;
    int tok = w / q_heads, h = w % q_heads, kvh = h / (q_heads / kv_heads);
    int row = kv_heads * d, per = (d + 31) / 32;
    float qv[ATT_MAX_D / 32], acc[ATT_MAX_D / 32];
    for (int m = 0; m < per; m++) {
        int j = lane + 32 * m;
        qv[m] = j < d ? bf2f(q[((long long)tok * q_heads + h) * d + j]) : 0.0f;
        acc[m] = 0.0f;
    }
    int pos = start + tok;
    int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    float mx = __int_as_float(0xff800000), l = 0.0f;
    for (int p = lo; p <= pos; p++) {
        const bf16 *kr, *vr;
        if (p >= start) {
            long long off = (long long)(p - start) * row + kvh * d;
            kr = k + off; vr = v + off;
        } else {
            long long off = kv_row_at(table, p, row) + kvh * d;
            kr = kc + off; vr = vc + off;
        }
        float s = 0.0f;
        for (int m = 0; m < per; m++) { int j = lane + 32 * m; if (j < d) s += qv[m] * bf2f(kr[j]); }
        s = warp_sum(s) * scale;
        float mn = fmaxf(mx, s), corr = expf(mx - mn), e = expf(s - mn);
        l = l * corr + e;
        for (int m = 0; m < per; m++) { int j = lane + 32 * m; acc[m] = acc[m] * corr + (j < d ? e * bf2f(vr[j]) : 0.0f); }
        mx = mn;
    }
    for (int m = 0; m < per; m++) {
        int j = lane + 32 * m;
        if (j < d) out[((long long)tok * q_heads + h) * d + j] = f2bf(acc[m] / l);
    }
}
