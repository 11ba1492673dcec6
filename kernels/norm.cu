// RMSNorm of rows: alone (`rms_norm`), after the residual update (`add_rms_norm`, one launch
// instead of add + rms_norm). With the update, v = x + y rounded to bf16, exactly as `add` writes
// the residual stream, and `sum` gets v; then out = bf16(v * r * (offset + w)), r = 1 / sqrt(mean(v^2)
// + eps), sums in f32. Both kernels run one body, so add_rms_norm's out is bit for bit rms_norm's of
// its sum. `rms_norm_gated` (the gated delta net's output norm) scales by silu of a gate row.
//
// Grid: one block per row, 256 threads. A row of a multiple of 8 values, with a bf16 weight and
// 16-byte aligned addresses, moves 8 values per access (one 16-byte load or store); others move 1.
// One-row decode launches are latency-bound, and 8x fewer accesses per thread shorten them.

// V values of a bf16 row from p, as f32; and back.
template <int V> __device__ __forceinline__ void ld_vals(const bf16* p, float* f) {
    if constexpr (V == 8) load_x8(p, f);
    else f[0] = bf2f(p[0]);
}
template <int V> __device__ __forceinline__ void st_vals(bf16* p, const float* f) {
    if constexpr (V == 8) *(uint4*)p = make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
    else p[0] = f2bf(f[0]);
}
// offset + w[j ..j + V) (V == 8 only for bf16 weights).
template <int V> __device__ __forceinline__ void ld_scale(const void* w, int wdt, int j, float offset, float* f) {
    if constexpr (V == 8) {
        load_x8((const bf16*)w + j, f);
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] += offset;
    } else {
        f[0] = offset + ld(w, wdt, j);
    }
}

// Thread t owns accesses t, t + blockDim.x, ... of its block's row; the first NORM_KEEP / V stay
// in registers between the two passes, later ones are read again. y and sum are null for rms_norm.
template <int V>
__device__ void norm_row(bf16* sum, bf16* out, const bf16* x, const bf16* y, const void* w, int wdt, int d, float eps, float offset) {
    constexpr int KEEP = NORM_KEEP / V;
    long long base = (long long)blockIdx.x * d;
    int n = d / V;
    auto value = [&](int c, float* v) {
        ld_vals<V>(x + base + c * V, v);
        if (y) {
            float b[V];
            ld_vals<V>(y + base + c * V, b);
#pragma unroll
            for (int e = 0; e < V; e++) v[e] = bf2f(f2bf(v[e] + b[e]));
        }
    };
    float kept[KEEP][V], wk[KEEP][V], ss = 0.0f;
#pragma unroll
    for (int i = 0; i < KEEP; i++) {
        int c = threadIdx.x + i * blockDim.x;
        if (c < n) {
            value(c, kept[i]);
            ld_scale<V>(w, wdt, c * V, offset, wk[i]);
        }
    }
    // Every load of the kept part is issued before any store (see NORM_KEEP).
#pragma unroll
    for (int i = 0; i < KEEP; i++) {
        int c = threadIdx.x + i * blockDim.x;
        if (c < n) {
            if (sum) st_vals<V>(sum + base + c * V, kept[i]);
#pragma unroll
            for (int e = 0; e < V; e++) ss += kept[i][e] * kept[i][e];
        }
    }
    for (int c = threadIdx.x + KEEP * blockDim.x; c < n; c += blockDim.x) {
        float v[V];
        value(c, v);
        if (sum) st_vals<V>(sum + base + c * V, v);
#pragma unroll
        for (int e = 0; e < V; e++) ss += v[e] * v[e];
    }
    float r = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
    for (int i = 0; i < KEEP; i++) {
        int c = threadIdx.x + i * blockDim.x;
        if (c < n) {
            float o[V];
#pragma unroll
            for (int e = 0; e < V; e++) o[e] = kept[i][e] * r * wk[i][e];
            st_vals<V>(out + base + c * V, o);
        }
    }
    for (int c = threadIdx.x + KEEP * blockDim.x; c < n; c += blockDim.x) {
        float v[V], s[V];
        ld_vals<V>((sum ? sum : x) + base + c * V, v);
        ld_scale<V>(w, wdt, c * V, offset, s);
#pragma unroll
        for (int e = 0; e < V; e++) v[e] *= r * s[e];
        st_vals<V>(out + base + c * V, v);
    }
}

__device__ __forceinline__ void norm_rows(bf16* sum, bf16* out, const bf16* x, const bf16* y, const void* w, int wdt, int d, float eps, float offset) {
    bool wide = d % 8 == 0 && wdt == DT_BF16 && (((u64)sum | (u64)out | (u64)x | (u64)y | (u64)w) & 15) == 0;
    if (wide) norm_row<8>(sum, out, x, y, w, wdt, d, eps, offset);
    else norm_row<1>(sum, out, x, y, w, wdt, d, eps, offset);
}

// out = x / rms(x) * (offset + w).
extern "C" __global__ void rms_norm(bf16* out, const bf16* x, const void* w, int wdt, int d, float eps, float offset) {
    grid_dep_begin();
    norm_rows(nullptr, out, x, nullptr, w, wdt, d, eps, offset);
}

// sum = x + y (bf16), out = rms_norm(sum).
extern "C" __global__ void add_rms_norm(bf16* sum, bf16* out, const bf16* x, const bf16* y, const void* w, int wdt, int d,
                                        float eps, float offset) {
    grid_dep_begin();
    norm_rows(sum, out, x, y, w, wdt, d, eps, offset);
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
