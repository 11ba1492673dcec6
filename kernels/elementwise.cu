// Row-wise and elementwise ops on bf16 activations (f32 arithmetic): embedding, gated RMSNorm,
// add, SwiGLU, gates, column narrowing, rotary embedding and greedy argmax (plain RMSNorm:
// add_norm.cu).

// out[i, :] = table[ids[i], :]. Grid: one block per token.
extern "C" __global__ void embedding(bf16* out, const void* table, int dt, const unsigned* ids, int hidden) {
    grid_dep_begin();
    long long row = ids[blockIdx.x], base = (long long)blockIdx.x * hidden;
    float kept[NORM_KEEP];
#pragma unroll
    for (int i = 0; i < NORM_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        kept[i] = j < hidden ? ld(table, dt, row * hidden + j) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < NORM_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < hidden) out[base + j] = f2bf(kept[i]);
    }
    for (int j = threadIdx.x + NORM_KEEP * blockDim.x; j < hidden; j += blockDim.x)
        out[base + j] = f2bf(ld(table, dt, row * hidden + j));
}

// w * (x / rms(x)) * silu(z). Grid: one block per row.
extern "C" __global__ void rms_norm_gated(bf16* out, const bf16* x, const bf16* z, const void* w, int wdt, int d, float eps) {
    grid_dep_begin();
    long long base = (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) { float v = bf2f(x[base + j]); ss += v * v; }
    float r = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        out[base + j] = f2bf(ld(w, wdt, j) * (bf2f(x[base + j]) * r) * silu(bf2f(z[base + j])));
}

extern "C" __global__ void add(bf16* out, const bf16* a, const bf16* b, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
}

extern "C" __global__ void swiglu(bf16* out, const bf16* g, const bf16* u, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(silu(bf2f(g[i])) * bf2f(u[i]));
}

// out[i] = x[i] * act(g[i / per]); act 0 = sigmoid, 1 = softplus.
extern "C" __global__ void gate(bf16* out, const bf16* x, const bf16* g, long long n, int per, int act) {
    grid_dep_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = bf2f(g[i / per]);
    out[i] = f2bf(bf2f(x[i]) * (act == 0 ? sigmoidf(gv) : softplusf(gv)));
}

// Columns start..start+len of x [rows, width]. Grid covers rows * len elements.
extern "C" __global__ void narrow_cols(bf16* out, const bf16* x, long long rows, int width, int start, int len) {
    grid_dep_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * len) return;
    long long r = i / len;
    out[i] = x[r * width + start + (int)(i % len)];
}

// NeoX rotary embedding over the first 2 * half features of each head; the rest copied.
struct RopeFreqs { float f[ROPE_MAX_FREQS]; };

// Element i of x [t, heads, d] rotated at position pos.
__device__ __forceinline__ void rope_one(bf16* out, const bf16* x, long long i, int heads, int d, int pos, int half, const RopeFreqs& inv,
                                         float scaling) {
    int j = (int)(i % d);
    long long head = i - j;
    if (j >= 2 * half) { out[i] = x[i]; return; }
    int f = j < half ? j : j - half;
    // As transformers: the angle is an f32 product, cos/sin in f32, times the scaling.
    float a = (float)pos * inv.f[f];
    float c = cosf(a) * scaling, s = sinf(a) * scaling;
    float x1 = bf2f(x[head + f]), x2 = bf2f(x[head + f + half]);
    out[i] = f2bf(j < half ? x1 * c - x2 * s : x2 * c + x1 * s);
}

// Tokens at positions start.. (`start_at`, when not null, holds the start position instead of
// `start`: a recorded decode step reads its position from device memory).
extern "C" __global__ void rope(bf16* out, const bf16* x, int t, int heads, int d, int start, const int* start_at, int half, RopeFreqs inv,
                               float scaling) {
    grid_dep_begin();
    if (start_at) start = *start_at;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * heads * d) return;
    rope_one(out, x, i, heads, d, start + (int)(i / ((long long)heads * d)), half, inv, scaling);
}

// One token of each of t <= SEQ_MAX sequences, token r at position pos.v[r].
extern "C" __global__ void rope_seqs(bf16* out, const bf16* x, int t, int heads, int d, SeqInts pos, int half, RopeFreqs inv,
                                    float scaling) {
    grid_dep_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * heads * d) return;
    rope_one(out, x, i, heads, d, pos.v[i / ((long long)heads * d)], half, inv, scaling);
}

// Greedy picks, out[r] = vt_core::argmax of row r of x [rows, n]: the index of the largest value,
// the first on ties; a NaN never wins, and a NaN first value is never displaced. Two launches, so
// that a vocabulary-wide row is read by many SMs: argmax_part folds slices of the rows into
// candidates, argmax_rows folds each row's candidates. A candidate is (value, index) with index
// ARGMAX_NONE where its slice holds only NaNs; of two, the larger value or on a tie the lower
// index wins, an order-free rule, so the result does not depend on how the slices are cut.
#define ARGMAX_NONE 0x7fffffff

__device__ __forceinline__ void argmax_better(float& bv, int& bi, float ov, int oi) {
    if (oi != ARGMAX_NONE && (bi == ARGMAX_NONE || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
}

// The warp's best candidate, in every lane.
__device__ __forceinline__ void argmax_warp(float& bv, int& bi) {
    for (int o = 16; o > 0; o >>= 1) argmax_better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
}

// Grid (parts, rows): block (p, r) writes the candidate of slice p of row r's `parts` equal slices
// to cv/ci[r * parts + p]. Each thread folds its values in index order, ARGMAX_LOADS in flight.
extern "C" __global__ void argmax_part(float* cv, int* ci, const bf16* x, int n) {
    __shared__ float wv[32];
    __shared__ int wi[32];
    const bf16* row = x + (long long)blockIdx.y * n;
    int lo = (int)((long long)blockIdx.x * n / gridDim.x), hi = (int)((long long)(blockIdx.x + 1) * n / gridDim.x);
    float bv = __int_as_float(0xff800000);
    int bi = ARGMAX_NONE;
    for (int i0 = lo + threadIdx.x; i0 < hi; i0 += blockDim.x * ARGMAX_LOADS) {
        float v[ARGMAX_LOADS];
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; u++) {
            int i = i0 + u * blockDim.x;
            v[u] = i < hi ? bf2f(row[i]) : __int_as_float(0x7fffffff);
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; u++)
            if (v[u] > bv || (bi == ARGMAX_NONE && !isnan(v[u]))) { bv = v[u]; bi = i0 + u * blockDim.x; }
    }
    argmax_warp(bv, bi);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { wv[warp] = bv; wi[warp] = bi; }
    __syncthreads();
    if (warp != 0) return;
    bv = __int_as_float(0xff800000);
    bi = ARGMAX_NONE;
    if (lane < (int)(blockDim.x >> 5)) { bv = wv[lane]; bi = wi[lane]; }
    argmax_warp(bv, bi);
    if (lane == 0) {
        cv[blockIdx.y * gridDim.x + blockIdx.x] = bv;
        ci[blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

// One warp per row (grid: rows) folds the row's `parts` candidates.
extern "C" __global__ void argmax_rows(unsigned* out, const float* cv, const int* ci, const bf16* x, int n, int parts) {
    float bv = __int_as_float(0xff800000);
    int bi = ARGMAX_NONE;
    for (int p = threadIdx.x; p < parts; p += 32) argmax_better(bv, bi, cv[blockIdx.x * parts + p], ci[blockIdx.x * parts + p]);
    argmax_warp(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = (bi == ARGMAX_NONE || isnan(bf2f(x[(long long)blockIdx.x * n]))) ? 0u : (unsigned)bi;
}
