// The routed-experts block on the device: router logits and top-k in f32, then SwiGLU experts
// read through the layer's expert table (resident state: one WeightDesc each for the gate, up and
// down projections of every expert, at 3e, 3e + 1, 3e + 2), combined in ascending expert order as
// vt-cpu does.

// Index of the largest v[i] not yet taken (lowest index among equals), marked taken. No NaN in v:
// one would win whenever it came first, as no value compares greater.
__device__ int take_max(const float* v, unsigned char* taken, int n) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    taken[best] = 1;
    return best;
}

// One block per token (256 threads), any number of experts: the choices of the warp and block
// routings (moe_prefill.cu, gemv.cu) that the faster paths take for up to 512, a NaN choice ranking
// as -inf (after every number, by index). Dynamic shared memory: (hidden + 2 * n_exp) floats +
// n_exp bytes.
extern "C" __global__ void moe_route(int* ids, float* weights, const bf16* x, WeightDesc router, RouteArgs ra) {
    extern __shared__ float sh[];
    int n_exp = ra.n_exp, top_k = ra.top_k, kind = ra.kind;
    float softcap = ra.softcap;
    const void* bias = (const void*)ra.bias;
    int hidden = router.k;
    float *xs = sh, *score = sh + hidden, *choice = score + n_exp;
    unsigned char* taken = (unsigned char*)(choice + n_exp);
    long long tok = blockIdx.x;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) xs[j] = bf2f(x[tok * hidden + j]);
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x) taken[e] = 0;
    __syncthreads();
    for (int e = threadIdx.x >> 5; e < n_exp; e += blockDim.x >> 5) {
        float l = warp_row_dot(router, e, xs);
        if ((threadIdx.x & 31) == 0) score[e] = l;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (kind == 0) {
        float mx = score[0], sum = 0.0f;
        for (int e = 1; e < n_exp; e++) mx = fmaxf(mx, score[e]);
        for (int e = 0; e < n_exp; e++) { choice[e] = expf(score[e] - mx); sum += choice[e]; }
        for (int e = 0; e < n_exp; e++) choice[e] = choice[e] / sum;
        for (int e = 0; e < n_exp; e++) score[e] = choice[e];
    } else {
        for (int e = 0; e < n_exp; e++) {
            float l = softcap > 0.0f ? softcap * tanhf(score[e] / softcap) : score[e];
            score[e] = sigmoidf(l);
            choice[e] = score[e] + (bias ? ld(bias, ra.bias_dt, e) : 0.0f);
        }
    }
    for (int e = 0; e < n_exp; e++)
        if (isnan(choice[e])) choice[e] = __int_as_float(0xff800000);
    int chosen[ROUTE_MAX_K];
    float norm = 0.0f;
    for (int s = 0; s < top_k; s++) { chosen[s] = take_max(choice, taken, n_exp); norm += score[chosen[s]]; }
    if (!ra.renorm) norm = 1.0f;
    float mul = kind == 0 ? 1.0f : ra.scaling;
    for (int s = 0; s < top_k; s++) {
        ids[tok * top_k + s] = chosen[s];
        weights[tok * top_k + s] = score[chosen[s]] / norm * mul;
    }
}

// act[slot, u] = silu(gate_u . x) * (up_u . x) for every (token, choice) slot, f32.
// Grid: (t * top_k, ceil(inter / 8)), 256 threads; dynamic shared: hidden floats.
extern "C" __global__ void moe_gate_up(float* act, const bf16* x, const int* ids, const WeightDesc* table, int top_k, int inter) {
    extern __shared__ float xs[];
    long long slot = blockIdx.x, tok = slot / top_k;
    const WeightDesc* gu = table + 3 * ids[slot];
    for (int j = threadIdx.x; j < gu[0].k; j += blockDim.x) xs[j] = bf2f(x[tok * gu[0].k + j]);
    __syncthreads();
    int u = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (u >= inter) return;
    float g = warp_row_dot(gu[0], u, xs), up = warp_row_dot(gu[1], u, xs);
    if ((threadIdx.x & 31) == 0) act[slot * inter + u] = silu(g) * up;
}

// y[slot, r] = down_r . act[slot] (f32). Grid: (t * top_k, ceil(hidden / 8)), 256 threads;
// dynamic shared: inter floats.
extern "C" __global__ void moe_down(float* y, const float* act, const int* ids, const WeightDesc* table, int hidden) {
    extern __shared__ float as[];
    long long slot = blockIdx.x;
    const WeightDesc& dn = table[3 * ids[slot] + 2];
    for (int j = threadIdx.x; j < dn.k; j += blockDim.x) as[j] = act[slot * dn.k + j];
    __syncthreads();
    int r = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (r >= hidden) return;
    float acc = warp_row_dot(dn, r, as);
    if ((threadIdx.x & 31) == 0) y[slot * hidden + r] = acc;
}

// out[tok] = sum over its choices, in ascending expert order, of weight * y. Grid: one block per
// token; threads over hidden.
extern "C" __global__ void moe_combine(bf16* out, const float* y, const int* ids, const float* weights, int top_k, int hidden) {
    long long tok = blockIdx.x;
    const int* id = ids + tok * top_k;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float acc = 0.0f;
        int prev = -1;
        for (int n = 0; n < top_k; n++) {
            int s = -1;
            for (int i = 0; i < top_k; i++)
                if (id[i] > prev && (s < 0 || id[i] < id[s])) s = i;
            prev = id[s];
            acc += weights[tok * top_k + s] * y[(tok * top_k + s) * hidden + c];
        }
        out[tok * hidden + c] = f2bf(acc);
    }
}
