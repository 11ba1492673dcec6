// The residual update and the norm after it in one pass (one launch instead of add + rms_norm):
// sum = x + y rounded to bf16, exactly as `add` writes the residual stream, then out = the
// `rms_norm` of that sum, bit for bit what the two kernels of elementwise.cu give.

// Grid: one block per row, 256 threads.
extern "C" __global__ void add_rms_norm(bf16* sum, bf16* out, const bf16* x, const bf16* y, const void* w, int wdt, int d,
                                        float eps, float offset) {
    grid_dep_trigger();
    long long base = (long long)blockIdx.x * d;
    float kept[NORM_KEEP], wk[NORM_KEEP];
#pragma unroll
    for (int i = 0; i < NORM_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        kept[i] = 0.0f;
        wk[i] = 0.0f;
        if (j < d) {
            kept[i] = bf2f(f2bf(bf2f(x[base + j]) + bf2f(y[base + j])));
            wk[i] = offset + ld(w, wdt, j);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < d) {
            sum[base + j] = f2bf(kept[i]);
            ss += kept[i] * kept[i];
        }
    }
    for (int j = threadIdx.x + NORM_KEEP * blockDim.x; j < d; j += blockDim.x) {
        bf16 s = f2bf(bf2f(x[base + j]) + bf2f(y[base + j]));
        sum[base + j] = s;
        float v = bf2f(s);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
    for (int i = 0; i < NORM_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < d) out[base + j] = f2bf(kept[i] * r * wk[i]);
    }
    for (int j = threadIdx.x + NORM_KEEP * blockDim.x; j < d; j += blockDim.x)
        out[base + j] = f2bf(bf2f(sum[base + j]) * r * (offset + ld(w, wdt, j)));
}
