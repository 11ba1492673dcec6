// Greedy picks, out[r] = vt_core::argmax of row r of x [rows, n]: the index of the largest value,
// the first on ties; a NaN never wins, and a NaN first value is never displaced. With a grammar's
// masks (`allowed`, `words` per row, not null), a token whose bit is 0 reads as -inf
// (vt_core's masked_argmax). out[rows + r] is 1 where row r holds a NaN or an infinity, allowed
// or not (vt_core's Pick::finite, inverted), so broken logits never pass for a token. Two launches, so
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

// Whether token i is allowed by a row's mask words (every token without masks).
__device__ __forceinline__ bool argmax_allowed(const unsigned* allowed, int i) {
    return allowed == nullptr || (allowed[i >> 5] >> (i & 31)) & 1u;
}

// Grid (parts, rows): block (p, r) writes the candidate of slice p of row r's `parts` equal slices
// to cv/ci[r * parts + p], and to cbad whether the slice holds a value that is not finite. Each
// thread folds its values in index order, ARGMAX_LOADS in flight.
extern "C" __global__ void argmax_part(float* cv, int* ci, int* cbad, const bf16* x, const unsigned* allowed, int n, int words) {
    __shared__ float wv[32];
    __shared__ int wi[32];
    const bf16* row = x + (long long)blockIdx.y * n;
    const unsigned* mask = allowed == nullptr ? nullptr : allowed + (long long)blockIdx.y * words;
    int bad = 0;
    int lo = (int)((long long)blockIdx.x * n / gridDim.x), hi = (int)((long long)(blockIdx.x + 1) * n / gridDim.x);
    float bv = __int_as_float(0xff800000);
    int bi = ARGMAX_NONE;
    for (int i0 = lo + threadIdx.x; i0 < hi; i0 += blockDim.x * ARGMAX_LOADS) {
        float v[ARGMAX_LOADS];
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; u++) {
            int i = i0 + u * blockDim.x;
            v[u] = i < hi ? bf2f(row[i]) : __int_as_float(0x7fffffff);
            if (i < hi) {
                bad |= !isfinite(v[u]);
                if (!argmax_allowed(mask, i)) v[u] = __int_as_float(0xff800000);
            }
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; u++)
            if (v[u] > bv || (bi == ARGMAX_NONE && !isnan(v[u]))) { bv = v[u]; bi = i0 + u * blockDim.x; }
    }
    argmax_warp(bv, bi);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { wv[warp] = bv; wi[warp] = bi; }
    bad = __syncthreads_or(bad);
    if (warp != 0) return;
    bv = __int_as_float(0xff800000);
    bi = ARGMAX_NONE;
    if (lane < (int)(blockDim.x >> 5)) { bv = wv[lane]; bi = wi[lane]; }
    argmax_warp(bv, bi);
    if (lane == 0) {
        cv[blockIdx.y * gridDim.x + blockIdx.x] = bv;
        ci[blockIdx.y * gridDim.x + blockIdx.x] = bi;
        cbad[blockIdx.y * gridDim.x + blockIdx.x] = bad;
    }
}

// One warp per row (grid: rows) folds the row's `parts` candidates and not-finite flags.
extern "C" __global__ void argmax_rows(unsigned* out, const float* cv, const int* ci, const int* cbad, const bf16* x,
                                       const unsigned* allowed, int n, int words, int parts) {
    float bv = __int_as_float(0xff800000);
    int bi = ARGMAX_NONE, bad = 0;
    for (int p = threadIdx.x; p < parts; p += 32) {
        argmax_better(bv, bi, cv[blockIdx.x * parts + p], ci[blockIdx.x * parts + p]);
        bad |= cbad[blockIdx.x * parts + p];
    }
    argmax_warp(bv, bi);
    bad = __any_sync(0xffffffffu, bad);
    const unsigned* mask = allowed == nullptr ? nullptr : allowed + (long long)blockIdx.x * words;
    bool nan_first = isnan(bf2f(x[(long long)blockIdx.x * n])) && argmax_allowed(mask, 0);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = (bi == ARGMAX_NONE || nan_first) ? 0u : (unsigned)bi;
        out[gridDim.x + blockIdx.x] = bad ? 1u : 0u;
    }
}
