// How the decode kernels (gemv.cu, moe_decode.cu) read a weight row: 16-byte chunks, streamed
// once, several in flight per lane, decoded in registers. bf16 chunks hold 8 inputs; NVFP4 chunks
// hold 32 e2m1 codes and take two fp8 block scales (Hopper has no fp4 MMA, and decode needs none).

// The two halves of an f16 pair as f32.
__device__ __forceinline__ void f16x2(unsigned v, float& lo, float& hi) {
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}" : "=f"(lo), "=f"(hi) : "r"(v));
}

// Eight e2m1 codes (element i in nibble i) dotted with x[0..8), times 2^-14. Each shift/mask pair
// moves two codes' magnitude bits to an f16's bits 9..11 and their signs to bit 15: the f16 then
// holds e2m1 * 2^-14 exactly (code 1 as the subnormal 2^-15), so no lookup table is needed.
__device__ __forceinline__ float fp4x8_dot(unsigned w, const float* x) {
    float a0, a4, b1, b5, c2, c6, d3, d7;
    f16x2(((w << 9) & 0x0e000e00u) | ((w << 12) & 0x80008000u), a0, a4);
    f16x2(((w << 5) & 0x0e000e00u) | ((w << 8) & 0x80008000u), b1, b5);
    f16x2(((w << 1) & 0x0e000e00u) | ((w << 4) & 0x80008000u), c2, c6);
    f16x2(((w >> 3) & 0x0e000e00u) | (w & 0x80008000u), d3, d7);
    return a0 * x[0] + b1 * x[1] + c2 * x[2] + d3 * x[3] + a4 * x[4] + b5 * x[5] + c6 * x[6] + d7 * x[7];
}
#define FP4_UNSCALE 16384.0f

// A weight format: ELEMS inputs per 16-byte chunk; `load` fetches chunk c of a row (and, for
// NVFP4, its two fp8 block scales); `dot` takes the chunk's inputs as f32.
template <bool FP4> struct Fmt;

template <> struct Fmt<false> {
    static constexpr int ELEMS = 8;
    static __device__ __forceinline__ void load(const WeightDesc& w, long long row, int c, uint4& v, unsigned& s) {
        v = ld_stream((const bf16*)w.data + row * w.k + c * 8);
        s = 0;
    }
    static __device__ __forceinline__ float dot(uint4 v, unsigned, const float* x) {
        float w0, w1, w2, w3, w4, w5, w6, w7;
        bf16x2(v.x, w0, w1); bf16x2(v.y, w2, w3); bf16x2(v.z, w4, w5); bf16x2(v.w, w6, w7);
        return w0 * x[0] + w1 * x[1] + w2 * x[2] + w3 * x[3] + w4 * x[4] + w5 * x[5] + w6 * x[6] + w7 * x[7];
    }
    // Multiplier of a row's dot.
    static __device__ __forceinline__ float scale(const WeightDesc&) { return 1.0f; }
};

template <> struct Fmt<true> {
    static constexpr int ELEMS = 32;
    static __device__ __forceinline__ void load(const WeightDesc& w, long long row, int c, uint4& v, unsigned& s) {
        v = ld_stream((const unsigned char*)w.data + row * (w.k >> 1) + c * 16);
        s = ((const unsigned short*)((const unsigned char*)w.scales + row * (w.k >> 4)))[c];
    }
    // Without the global scale and 2^14 (scale).
    static __device__ __forceinline__ float dot(uint4 v, unsigned s, const float* x) {
        float g0 = fp4x8_dot(v.x, x) + fp4x8_dot(v.y, x + 8);
        float g1 = fp4x8_dot(v.z, x + 16) + fp4x8_dot(v.w, x + 24);
        return g0 * f8e4m3(s & 0xffu) + g1 * f8e4m3(s >> 8);
    }
    static __device__ __forceinline__ float scale(const WeightDesc& w) {
        return w.global[0] * FP4_UNSCALE;
    }
};

// The ELEMS inputs of chunk c, as f32.
template <bool FP4, typename X> __device__ __forceinline__ void load_xchunk(const X* x, int c, float* f) {
#pragma unroll
    for (int j = 0; j < Fmt<FP4>::ELEMS; j += 8) load_x8(x + (long long)c * Fmt<FP4>::ELEMS + j, f + j);
}
