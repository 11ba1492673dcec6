// Sampled picks where the logits are (vt_core::backend::sample is the reference, `sample_row`):
// one block of SAMPLE_THREADS threads per pick draws a token from row args[p].row of x [rows, n]
// (bf16) and writes it to out[p], and to out[picks + p] 1 where that row holds a NaN or an
// infinity (its id is then no token to send). The block first writes the row, masked (a
// disallowed token, or a NaN, reads as -inf) and adjusted (`LogitAdjust`), to its f32 scratch
// row; every later pass reads that.
//
// The draw: at temperature 0, or with no finite maximum, the argmax (first index of the largest).
// Otherwise weights w = expf((v - max) / temperature) (f32, as the reference), sums in double. The
// ranking (value descending, lower id first on ties) is cut where top-k and top-p cut it without
// sorting: a cut is a key K (the value as an order-preserving integer) and a count of ties, the
// rank set being the tokens of key > K and the first `ties` tokens of key K in id order. Each K is
// found by bisection over the 32-bit keys with a block reduction (a count for top-k, a weight sum
// for top-p) per step. min_p is a threshold on w. The kept tokens are walked in id order: each
// thread owns a contiguous segment, a block scan gives each its running sum before it, and the
// first kept token whose running sum exceeds uniform times the total is the pick. Reductions and
// scans go in a fixed order, so a pick depends only on its inputs.

// Mirrors vt_core::backend::LogitAdjust (#[repr(C)]).
struct LogitAdjust {
    unsigned token;
    float bias;
    float penalty;
    unsigned repeated;
};

// Mirrors vt-cuda's SampleArgs (#[repr(C)], ops/sample.rs): one pick.
struct SampleArgs {
    double uniform;
    int row;
    float temperature;
    // 0: no top-k cut (also where it keeps the whole row).
    int top_k;
    float top_p;
    float min_p;
    float repetition_penalty;
    // This pick's adjustments: adjust[adjust_at .. adjust_at + adjust_len].
    int adjust_at;
    int adjust_len;
    // Word offset of its mask in `allowed`; -1: every token allowed.
    int mask_at;
    int pad;
};

#define SAMPLE_NONE 0x7fffffff

// Larger float, larger key (NaNs are never stored in the scratch row).
__device__ __forceinline__ unsigned sample_key(float v) {
    unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float sample_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// vt_core's `adjusted`, step for step.
// Rounded at each step (no contraction into a fused multiply-add), as the host rounds them.
__device__ __forceinline__ float sample_adjusted(float l, const LogitAdjust& a, float repetition_penalty) {
    l = __fadd_rn(l, a.bias);
    if (a.repeated != 0u) l = l > 0.0f ? __fdiv_rn(l, repetition_penalty) : __fmul_rn(l, repetition_penalty);
    return __fsub_rn(l, a.penalty);
}

// Block sums (every thread gets the total): a butterfly per warp, then over the warps' sums in
// order. Every lane of a butterfly adds the same pairs (addition commutes), so all agree.
template <typename T> __device__ T sample_sum(T v, T* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Exclusive prefix over the threads in thread order (and the block's total in `total`).
template <typename T> __device__ T sample_scan(T v, T* red, T& total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    T inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        T up = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += up;
    }
    __syncthreads();
    if (lane == 31) red[warp] = inc;
    __syncthreads();
    T before = 0;
    total = 0;
    for (int w = 0; w < warps; w++) {
        if (w < warp) before += red[w];
        total += red[w];
    }
    return before + inc - v;
}

// Tokens of key >= t (or > t where `strict`).
__device__ int sample_count(const float* s, int n, unsigned t, bool strict, int* red) {
    int c = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned k = sample_key(s[i]);
        c += strict ? k > t : k >= t;
    }
    return sample_sum(c, red);
}

// Tokens of key exactly t.
__device__ int sample_count_eq(const float* s, int n, unsigned t, int* red) {
    int c = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) c += sample_key(s[i]) == t;
    return sample_sum(c, red);
}

// Weight of the tokens of key >= t (or > t where `strict`).
__device__ double sample_mass(const float* s, int n, unsigned t, bool strict, float m, float temp, double* red) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = s[i];
        unsigned k = sample_key(v);
        if (strict ? k > t : k >= t) acc += (double)expf((v - m) / temp);
    }
    return sample_sum(acc, red);
}

extern "C" __global__ void sample_rows(unsigned* out, float* scratch, const bf16* x, const SampleArgs* args,
                                       const LogitAdjust* adjust, const unsigned* allowed, int n, int picks) {
    __shared__ double dred[32];
    __shared__ int ired[32];
    __shared__ float fv[32];
    __shared__ int fi[32];
    const SampleArgs a = args[blockIdx.x];
    const bf16* raw = x + (long long)a.row * n;
    float* s = scratch + (long long)blockIdx.x * n;
    const unsigned* mask = a.mask_at < 0 ? nullptr : allowed + a.mask_at;
    const float ninf = __int_as_float(0xff800000);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // The masked row, and whether the raw row is broken.
    int bad = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = bf2f(raw[i]);
        bad |= !isfinite(v);
        bool ok = mask == nullptr || ((mask[i >> 5] >> (i & 31)) & 1u);
        s[i] = (ok && !isnan(v)) ? v : ninf;
    }
    bad = __syncthreads_or(bad);
    // Adjustments: one per token, so no two threads write one value.
    for (int j = threadIdx.x; j < a.adjust_len; j += blockDim.x) {
        LogitAdjust d = adjust[a.adjust_at + j];
        if (d.token < (unsigned)n) s[d.token] = sample_adjusted(s[d.token], d, a.repetition_penalty);
    }
    __syncthreads();

    // The maximum and its first index (SAMPLE_NONE: every value -inf, then 0 as vt_core::argmax).
    float bv = ninf;
    int bi = SAMPLE_NONE;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (s[i] > bv) { bv = s[i]; bi = i; }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    __syncthreads();
    if (lane == 0) { fv[warp] = bv; fi[warp] = bi; }
    __syncthreads();
    bv = ninf;
    bi = SAMPLE_NONE;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        if (fv[w] > bv || (fv[w] == bv && fi[w] < bi)) { bv = fv[w]; bi = fi[w]; }
    const float m = bv;
    const int top = bi == SAMPLE_NONE ? 0 : bi;
    if (a.temperature == 0.0f || !isfinite(m)) {
        if (threadIdx.x == 0) { out[blockIdx.x] = (unsigned)top; out[picks + blockIdx.x] = bad ? 1u : 0u; }
        return;
    }
    const float t = a.temperature;

    // Top-k: K the largest key with at least k tokens at or above it; ties kept to make k.
    unsigned kkey = 0u;
    int kties = 0x7fffffff;
    if (a.top_k > 0) {
        unsigned lo = 0u, hi = sample_key(m);
        while (lo < hi) {
            unsigned mid = (unsigned)(((unsigned long long)lo + hi + 1ull) >> 1);
            if (sample_count(s, n, mid, false, ired) >= a.top_k) lo = mid; else hi = mid - 1u;
        }
        kkey = lo;
        kties = a.top_k - sample_count(s, n, kkey, true, ired);
    }
    // Top-p over what top-k kept: the largest key whose prefix of the ranking weighs at least
    // top_p of it, and the ties at that key it takes to get there.
    unsigned pkey = kkey;
    int pties = kties;
    if (a.top_p < 1.0f) {
        double gt = sample_mass(s, n, kkey, true, m, t, dred);
        int keq = min(kties, sample_count_eq(s, n, kkey, ired));
        // Without a top-k cut, kkey is no value's key (keq is 0): its weight must not enter.
        double total = keq > 0 ? gt + (double)keq * (double)expf((sample_value(kkey) - m) / t) : gt;
        double target = (double)a.top_p * total;
        unsigned lo = kkey, hi = sample_key(m);
        while (lo < hi) {
            unsigned mid = (unsigned)(((unsigned long long)lo + hi + 1ull) >> 1);
            if (sample_mass(s, n, mid, false, m, t, dred) >= target) lo = mid; else hi = mid - 1u;
        }
        pkey = lo;
        double pgt = pkey == kkey ? gt : sample_mass(s, n, pkey, true, m, t, dred);
        int avail = pkey == kkey ? keq : sample_count_eq(s, n, pkey, ired);
        double wp = (double)expf((sample_value(pkey) - m) / t);
        double need = wp > 0.0 ? ceil((target - pgt) / wp) : (double)avail;
        pties = need >= (double)avail ? avail : max(1, (int)need);
    }
    const double min_w = (double)a.min_p;

    // The walk in id order over contiguous segments: ties at pkey before each segment, then
    // the kept weight before each segment, then the segment that crosses the target.
    int seg = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    int lo = min(n, (int)threadIdx.x * seg), hi = min(n, lo + seg);
    int ties = 0;
    for (int i = lo; i < hi; i++) ties += sample_key(s[i]) == pkey;
    int all_ties;
    int tie_base = sample_scan<int>(ties, ired, all_ties);
    double kept = 0.0;
    int last = -1;
    int tr = tie_base;
    for (int i = lo; i < hi; i++) {
        float v = s[i];
        unsigned k = sample_key(v);
        bool ranked = k > pkey || (k == pkey && tr < pties);
        tr += k == pkey;
        double w = (double)expf((v - m) / t);
        if (ranked && w > 0.0 && w >= min_w) { kept += w; last = i; }
    }
    double total;
    double base = sample_scan<double>(kept, dred, total);
    const double target = a.uniform * total;
    // The first crossing: each thread's own, then the least over the block.
    int found = SAMPLE_NONE;
    if (kept > 0.0 && base + kept > target) {
        double acc = base;
        tr = tie_base;
        for (int i = lo; i < hi; i++) {
            float v = s[i];
            unsigned k = sample_key(v);
            bool ranked = k > pkey || (k == pkey && tr < pties);
            tr += k == pkey;
            double w = (double)expf((v - m) / t);
            if (ranked && w > 0.0 && w >= min_w) {
                acc += w;
                if (acc > target) { found = i; break; }
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        found = min(found, __shfl_xor_sync(0xffffffffu, found, o));
        last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    }
    __syncthreads();
    if (lane == 0) { fi[warp] = found; ired[warp] = last; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) { found = min(found, fi[w]); last = max(last, ired[w]); }
        // Rounding may leave no crossing: the last kept token; none kept (cannot happen, the
        // maximum weighs 1): the argmax.
        out[blockIdx.x] = (unsigned)(found != SAMPLE_NONE ? found : last >= 0 ? last : top);
        out[picks + blockIdx.x] = bad ? 1u : 0u;
    }
}
