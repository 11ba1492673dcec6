// Elementwise and row-gathering ops on bf16 activations (f32 arithmetic): embedding, add,
// SwiGLU, gates, column narrowing. (Norms: norm.cu; rotary embedding: rope.cu; greedy argmax:
// argmax.cu.)

// out[i, :] = table[ids[i], :]. Grid: one block per token.
extern "C" __global__ void embedding(bf16* out, const void* table, int dt, const unsigned* ids, int hidden) {
    grid_dep_begin();
    long long row = ids[blockIdx.x], base = (long long)blockIdx.x * hidden;
    float kept[NORM_KEEP];
#pragma unroll
    for (int i = 0; i < NORM_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        kept[i] = j < hidden ? ld(table, dt, row * hidden + j) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < NORM_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < hidden) out[base + j] = f2bf(kept[i]);
    }
    for (int j = threadIdx.x + NORM_KEEP * blockDim.x; j < hidden; j += blockDim.x)
        out[base + j] = f2bf(ld(table, dt, row * hidden + j));
}

extern "C" __global__ void add(bf16* out, const bf16* a, const bf16* b, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
}

extern "C" __global__ void swiglu(bf16* out, const bf16* g, const bf16* u, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(silu(bf2f(g[i])) * bf2f(u[i]));
}

// out[i] = x[i] * act(g[i / per]); act 0 = sigmoid, 1 = softplus.
extern "C" __global__ void gate(bf16* out, const bf16* x, const bf16* g, long long n, int per, int act) {
    grid_dep_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = bf2f(g[i / per]);
    out[i] = f2bf(bf2f(x[i]) * (act == 0 ? sigmoidf(gv) : softplusf(gv)));
}

// Columns start..start+len of x [rows, width]. Grid covers rows * len elements.
extern "C" __global__ void narrow_cols(bf16* out, const bf16* x, long long rows, int width, int start, int len) {
    grid_dep_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * len) return;
    long long r = i / len;
    out[i] = x[r * width + start + (int)(i % len)];
}

// Copies n blocks of memory, `table` holding (dst, src, bytes) for each (unsigned long long
// triples): blockIdx.y picks the pair, the x blocks stride over it in 16-byte words, block 0
// copies a tail that is not a whole word. Every address is 16-byte aligned (the allocator's 256).
extern "C" __global__ void copy_pairs(const unsigned long long* table) {
    const unsigned long long* p = table + 3 * (size_t)blockIdx.y;
    uint4* dst = (uint4*)p[0];
    const uint4* src = (const uint4*)p[1];
    unsigned long long bytes = p[2], words = bytes / 16;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
    if (blockIdx.x == 0) {
        for (unsigned long long i = words * 16 + threadIdx.x; i < bytes; i += blockDim.x) {
            ((char*)dst)[i] = ((const char*)src)[i];
        }
    }
}
