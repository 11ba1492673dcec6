// Gated DeltaNet: the depthwise causal conv1d + SiLU in front of it, and the gated delta rule
// (f32 state), mirroring vt-cpu's ops/conv.rs and ops/gdn.rs.


// One thread per channel walks the t tokens; `state` [c, k-1] (bf16) holds the previous inputs
// and is updated to the last k-1 inputs. Weight [c, k] in its stored dtype.
extern "C" __global__ void causal_conv1d(bf16* out, const bf16* x, const void* w, int wdt, bf16* state, int t, int c, int k) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    float win[CONV_MAX_K], wt[CONV_MAX_K];
    for (int j = 0; j < k; j++) wt[j] = ld(w, wdt, (long long)ch * k + j);
    for (int j = 0; j < k - 1; j++) win[j] = bf2f(state[(long long)ch * (k - 1) + j]);
    for (int s = 0; s < t; s++) {
        win[k - 1] = bf2f(x[(long long)s * c + ch]);
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += wt[j] * win[j];
        out[(long long)s * c + ch] = f2bf(silu(acc));
        for (int j = 0; j + 1 < k; j++) win[j] = win[j + 1];
    }
    for (int j = 0; j < k - 1; j++) state[(long long)ch * (k - 1) + j] = f2bf(win[j]);
}

// Stages row `src` (dk values) into `dst` l2-normalised (x * rsqrt(sum x^2 + 1e-6)), times `mul`.
__device__ void load_l2(float* dst, const bf16* src, int dk, float mul) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) { float x = bf2f(src[i]); dst[i] = x; ss += x * x; }
    float inv = 1.0f / sqrtf(block_sum(ss) + 1e-6f);
    for (int i = threadIdx.x; i < dk; i += blockDim.x) dst[i] = dst[i] * inv * mul;
    __syncthreads();
}

// The gated delta rule, token by token. Grid: one block per value head; thread j owns column j
// of the head's state S [dk, dv] (f32, global). Dynamic shared memory: 2 * dk floats.
//   S *= exp(g);  delta = (v - S^T k) * beta;  S += k (x) delta;  o = S^T q
extern "C" __global__ void gdn_recurrent(bf16* out, const bf16* q, const bf16* k, const bf16* v, const bf16* a, const bf16* b,
                                         const void* a_log, int a_log_dt, const void* dt_bias, int dt_bias_dt, float* state,
                                         int t, int key_heads, int value_heads, int dk, int dv) {
    extern __shared__ float sh[];
    float *qs = sh, *ks = sh + dk;
    int h = blockIdx.x, j = threadIdx.x;
    int kh = h / (value_heads / key_heads);
    float* S = state + (long long)h * dk * dv;
    float neg_a = -expf(ld(a_log, a_log_dt, h)), bias = ld(dt_bias, dt_bias_dt, h);
    float qmul = 1.0f / sqrtf((float)dk);
    for (int s = 0; s < t; s++) {
        long long qk = ((long long)s * key_heads + kh) * dk;
        load_l2(qs, q + qk, dk, qmul);
        load_l2(ks, k + qk, dk, 1.0f);
        long long ab = (long long)s * value_heads + h;
        float beta = sigmoidf(bf2f(b[ab])), decay = expf(neg_a * softplusf(bf2f(a[ab]) + bias));
        if (j < dv) {
            float kv = 0.0f;
            for (int i = 0; i < dk; i++) { float x = S[(long long)i * dv + j] * decay; S[(long long)i * dv + j] = x; kv += x * ks[i]; }
            float delta = (bf2f(v[ab * dv + j]) - kv) * beta, o = 0.0f;
            for (int i = 0; i < dk; i++) { float x = S[(long long)i * dv + j] + ks[i] * delta; S[(long long)i * dv + j] = x; o += x * qs[i]; }
            out[ab * dv + j] = f2bf(o);
        }
        __syncthreads();
    }
}
