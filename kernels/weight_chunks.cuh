// How the bf16 decode kernels (gemv.cu, moe_decode.cu) read a weight row: 16-byte chunks of 8
// inputs, streamed once, several in flight per lane. (NVFP4 weights take the tensor-core kernels
// of nvfp4.cuh's layout.)

struct Bf16Chunks {
    static constexpr int ELEMS = 8;
    static __device__ __forceinline__ void load(const WeightDesc& w, long long row, int c, uint4& v) {
        v = ld_stream((const bf16*)w.data + row * w.k + c * 8);
    }
    static __device__ __forceinline__ float dot(uint4 v, const float* x) {
        float w0, w1, w2, w3, w4, w5, w6, w7;
        bf16x2(v.x, w0, w1); bf16x2(v.y, w2, w3); bf16x2(v.z, w4, w5); bf16x2(v.w, w6, w7);
        return w0 * x[0] + w1 * x[1] + w2 * x[2] + w3 * x[3] + w4 * x[4] + w5 * x[5] + w6 * x[6] + w7 * x[7];
    }
};

// The 8 inputs of chunk c, as f32.
template <typename X> __device__ __forceinline__ void load_xchunk(const X* x, int c, float* f) { load_x8(x + (long long)c * 8, f); }
