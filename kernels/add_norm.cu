// The residual update and the norm after it in one pass (one launch instead of add + rms_norm):
// sum = x + y rounded to bf16, exactly as `add` writes the residual stream, then out = the
// `rms_norm` of that sum, bit for bit what the two kernels of elementwise.cu give.

// Grid: one block per row, 256 threads.
extern "C" __global__ void add_rms_norm(bf16* sum, bf16* out, const bf16* x, const bf16* y, const void* w, int wdt, int d,
                                        float eps, float offset) {
    grid_dep_trigger();
    long long base = (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        bf16 s = f2bf(bf2f(x[base + j]) + bf2f(y[base + j]));
        sum[base + j] = s;
        float v = bf2f(s);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        out[base + j] = f2bf(bf2f(sum[base + j]) * r * (offset + ld(w, wdt, j)));
}
