// Random tensor contents on the device: exactly the bytes of vt-core's random::random_bytes
// (element i from mix(key ^ i), key = mix(seed) computed by the caller).

__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// kind 0: f32, 1: bf16 (uniform in [-scale, scale)); 2: fp8 e4m3 positive, uniform in
// [scale / 2, scale) truncated; 3: bytes. One thread per element (per byte for kind 3).
extern "C" __global__ void fill_random(void* out, int kind, long long n, u64 key, float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 h = mix64(key ^ (u64)i);
    float u = (float)(h >> 40) * (1.0f / 16777216.0f);
    if (kind == 0) ((float*)out)[i] = __fmul_rn(__fsub_rn(__fmul_rn(u, 2.0f), 1.0f), scale);
    else if (kind == 1) ((bf16*)out)[i] = f2bf(__fmul_rn(__fsub_rn(__fmul_rn(u, 2.0f), 1.0f), scale));
    else if (kind == 2) {
        unsigned bits = __float_as_uint(__fmul_rn(scale, __fadd_rn(0.5f, __fmul_rn(0.5f, u))));
        int e = (int)((bits >> 23) & 0xffu) - 127 + 7;
        unsigned char code = e <= 0 ? 0x08 : e >= 16 ? 0x7e : (unsigned char)min((e << 3) | (int)((bits >> 20) & 7u), 0x7e);
        ((unsigned char*)out)[i] = code;
    } else ((unsigned char*)out)[i] = (unsigned char)(h >> 32);
}
