// Linear layers that cuBLASLt does not take: NVFP4 (W4A16: codes decoded in registers, never
// expanded in memory) and dense f32/f16 weights. Correctness first: one warp per output element.

// y[i, r] = sum_j x[i, j] * W[r, j]. Grid: (t, ceil(n / 8)), 256 threads = 8 warps = 8 rows.
// The block stages its token's row of x as f32 in shared memory (k floats, dynamic).
extern "C" __global__ void linear_rows(bf16* y, const bf16* x, WeightDesc w, int n) {
    extern __shared__ float xs[];
    long long tok = blockIdx.x;
    for (int j = threadIdx.x; j < w.k; j += blockDim.x) xs[j] = bf2f(x[tok * w.k + j]);
    __syncthreads();
    int r = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (r >= n) return;
    float acc = warp_row_dot(w, r, xs);
    if ((threadIdx.x & 31) == 0) y[tok * n + r] = f2bf(acc);
}
