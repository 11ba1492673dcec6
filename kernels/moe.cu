// The routed-experts block on the device: router logits and top-k in f32, then SwiGLU experts
// read through the layer's expert table (resident state: one WeightDesc each for the gate, up and
// down projections of every expert, at 3e, 3e + 1, 3e + 2), combined in ascending expert order as
// vt-cpu does.

#include "route.cuh"

// One block per token (256 threads): the router's logits (a warp per expert row), then warp 0
// routes them (route_warp, n_exp <= ROUTE_MAX_EXP); ids / weights [t, top_k] in rank order.
// Dynamic shared memory: (hidden + n_exp) floats.
extern "C" __global__ void moe_route(int* ids, float* weights, const bf16* x, WeightDesc router, RouteArgs ra) {
    extern __shared__ float sh[];
    int n_exp = ra.n_exp, top_k = ra.top_k, hidden = router.k;
    float *xs = sh, *logits = sh + hidden;
    long long tok = blockIdx.x;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) xs[j] = bf2f(x[tok * hidden + j]);
    __syncthreads();
    for (int e = threadIdx.x >> 5; e < n_exp; e += blockDim.x >> 5) {
        float l = warp_row_dot(router, e, xs);
        if ((threadIdx.x & 31) == 0) logits[e] = l;
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    Choice c = route_warp([&](int e) { return logits[e]; }, ra);
    if ((int)threadIdx.x < top_k) {
        ids[tok * top_k + threadIdx.x] = c.id;
        weights[tok * top_k + threadIdx.x] = c.w;
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
