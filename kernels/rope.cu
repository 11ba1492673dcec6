// Rotary position embedding (NeoX) of bf16 activations, f32 arithmetic.

// NeoX rotary embedding over the first 2 * half features of each head; the rest copied.
struct RopeFreqs { float f[ROPE_MAX_FREQS]; };

// Element i of x [t, heads, d] rotated at position pos.
__device__ __forceinline__ void rope_one(bf16* out, const bf16* x, long long i, int heads, int d, int pos, int half, const RopeFreqs& inv,
                                         float scaling) {
    int j = (int)(i % d);
    long long head = i - j;
    if (j >= 2 * half) { out[i] = x[i]; return; }
    int f = j < half ? j : j - half;
    // As transformers: the angle is an f32 product, cos/sin in f32, times the scaling.
    float a = (float)pos * inv.f[f];
    float c = cosf(a) * scaling, s = sinf(a) * scaling;
    float x1 = bf2f(x[head + f]), x2 = bf2f(x[head + f + half]);
    out[i] = f2bf(j < half ? x1 * c - x2 * s : x2 * c + x1 * s);
}

// Tokens at positions start.. (`start_at`, when not null, holds the start position instead of
// `start`: a recorded decode step reads its position from device memory).
extern "C" __global__ void rope(bf16* out, const bf16* x, int t, int heads, int d, int start, const int* start_at, int half, RopeFreqs inv,
                               float scaling) {
    grid_dep_begin();
    if (start_at) start = *start_at;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * heads * d) return;
    rope_one(out, x, i, heads, d, start + (int)(i / ((long long)heads * d)), half, inv, scaling);
}

// One token of each of t sequences, token r at position pos[r] (device memory).
extern "C" __global__ void rope_seqs(bf16* out, const bf16* x, int t, int heads, int d, const int* pos, int half, RopeFreqs inv,
                                    float scaling) {
    grid_dep_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * heads * d) return;
    rope_one(out, x, i, heads, d, pos[i / ((long long)heads * d)], half, inv, scaling);
}
