// Log-probabilities of generated tokens where the logits are, so that only they are read back
// (vt_core's `token_logprobs` is the reference): per row r of x [rows, n] (bf16), the
// log-softmax value of chosen[r] and the k largest (most likely first, the lower id first on
// ties). NaNs never count. One block per row: a pass for the max, one for the sum of exponentials
// (each thread's part in double), then one pass per top entry, each taking the best value that
// comes after the previous pick in the order (value descending, index ascending), so no list of
// picked ids is needed and the result does not depend on the launch shape.

// The better of two candidates (value, index); index -1 is none.
__device__ __forceinline__ void lp_better(float& bv, int& bi, float ov, int oi) {
    if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
}

// Block r reads row rows[r] of x (row r where `rows` is null: several blocks may read one row).
// lp_out[r * (k + 1)]: chosen[r]'s log-probability, then the k top ones; id_out[r * k + j]: their
// ids, -1 past the row's values that are not NaN.
extern "C" __global__ void top_logprobs(float* lp_out, int* id_out, const bf16* x, const unsigned* chosen, const int* rows,
                                        int n, int k) {
    __shared__ float red[32];
    __shared__ float cv[32];
    __shared__ int ci[32];
    const bf16* row = x + (long long)(rows == nullptr ? (int)blockIdx.x : rows[blockIdx.x]) * n;
    float m = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = bf2f(row[i]);
        if (!isnan(v)) m = fmaxf(m, v);
    }
    m = block_reduce<true>(m, red);
    double part = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = bf2f(row[i]);
        if (!isnan(v)) part += exp((double)(v - m));
    }
    float lse = m + logf(block_reduce<false>((float)part, red));
    float* lp = lp_out + (long long)blockIdx.x * (k + 1);
    if (threadIdx.x == 0) {
        unsigned c = chosen[blockIdx.x];
        lp[0] = c < (unsigned)n ? bf2f(row[c]) - lse : __int_as_float(0xff800000);
    }
    float pv = __int_as_float(0x7f800000);
    int pi = -1;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int j = 0; j < k; j++) {
        float bv = __int_as_float(0xff800000);
        int bi = -1;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            float v = bf2f(row[i]);
            if (!isnan(v) && (v < pv || (v == pv && i > pi))) lp_better(bv, bi, v, i);
        }
        for (int o = 16; o > 0; o >>= 1) lp_better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
        __syncthreads();
        if (lane == 0) { cv[warp] = bv; ci[warp] = bi; }
        __syncthreads();
        bv = __int_as_float(0xff800000);
        bi = -1;
        if (lane < (int)(blockDim.x >> 5)) { bv = cv[lane]; bi = ci[lane]; }
        for (int o = 16; o > 0; o >>= 1) lp_better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
        if (threadIdx.x == 0) {
            lp[1 + j] = bi < 0 ? __int_as_float(0xff800000) : bv - lse;
            id_out[(long long)blockIdx.x * k + j] = bi;
        }
        pv = bv;
        pi = bi;
    }
}
