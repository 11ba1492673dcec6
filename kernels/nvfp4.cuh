// NVFP4 weights as vt-cuda keeps them on the device, and their decode into tensor-core fragments.
//
// Layout (built once at load by nvfp4_repack in place of the checkpoint's bytes: vt-cuda's
// nvfp4.rs): the matrix [n, k] is cut into tiles of NV4_ROWS = 16 rows x NV4_K = 64 inputs, row
// block rb's tiles one after another along k (tile rb * ceil(k / 64) + kb), rows and inputs past
// the matrix zero codes and scales. `codes` holds 512 bytes a tile, `scales` 64, so a matrix of
// whole tiles takes exactly the checkpoint's bytes.
//
// A tile's codes: lane l (g = l / 4, c = l % 4) owns the 16 bytes at 16 l, one 32-bit word per k
// step s (inputs 16 s .. 16 s + 15 of the tile): the 8 codes the lane holds of an mma m16n8k16
// fragment of rows (g, g + 8) x inputs (2c, 2c + 1, 2c + 8, 2c + 9). Element e (0..7) of a word is
// row g + 8 (e >> 2), input 16 s + 2c + 8 ((e >> 1) & 1) + (e & 1); its magnitude sits in bits
// 4e .. 4e + 2 and its sign at nv4_sign_bit(e) (common.cuh): bit 7 of byte e for e < 4, bit 3 of
// byte e - 4 otherwise, from where it lands on the sign bit of its bf16's high byte (nv4_codes).
// One 16-byte load per lane thus gives a warp a 16 x 64 block with no shuffle: as the A operand
// (weight rows as M), or as two B fragments (rows g and g + 8 as N).
// A tile's scales: byte 8 g + 4 h + s is the fp8 scale of row 8 h + g for step s, so a lane's 8
// bytes at 8 g are its two rows' four steps.
//
// Numerics: e2m1 (2 significant bits) x e4m3 (4 significant bits, 2^-9 .. 448) is exact in bf16
// (8 significant bits, f32's exponent range), so the prefill kernels' tensor cores see the weight
// exactly up to the per-tensor multiplier, which they apply in f32. The decode kernels give the
// tensor cores the codes alone (exact in bf16 too) and scale each k step's f32 product: a step
// is one scale group of each row (nv4_tile_mma).

#define NV4_CODE_BYTES (NV4_ROWS * NV4_K / 2)   // 512
#define NV4_SCALE_BYTES (NV4_ROWS * NV4_K / 16) // 64

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// a * b per bf16 half, exact when the product is representable (fma with -0 keeps a -0 product).
__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// The two e4m3 scales of `two` (low byte first) as f32, exactly (e4m3 -> f16 -> f32).
__device__ __forceinline__ void nv4_scale_pair(unsigned short two, float& lo, float& hi) {
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(h2));
}

// Scales s = 0..3 (bytes of `sc`) as bf16 pairs (s_s, s_s), exactly.
__device__ __forceinline__ void nv4_scales(unsigned sc, unsigned* s) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
        float lo, hi;
        nv4_scale_pair((unsigned short)(sc >> (16 * p)), lo, hi);
        asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(s[2 * p]) : "f"(lo));
        asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(s[2 * p + 1]) : "f"(hi));
    }
}

// The 8 codes of one word (layout above) as bf16 pairs, unscaled, in A fragment order: a[0] =
// elements 0, 1 (row g, inputs 2c, 2c + 1), a[1] = 4, 5 (row g + 8), a[2] = 2, 3 (row g, inputs
// 2c + 8, 2c + 9), a[3] = 6, 7. Magnitudes go through two byte tables (low and high bytes of the
// bf16 of 0, .5, 1, 1.5, 2, 3, 4, 6), four codes a lookup; the signs are or-ed onto the high
// bytes, which the last four byte permutes pair with the low ones.
__device__ __forceinline__ void nv4_codes(unsigned q, unsigned* a) {
    const unsigned lo_a = 0xC0800000u, lo_b = 0xC0804000u, hi_a = 0x3F3F3F00u, hi_b = 0x40404040u, sign = 0x80808080u;
    unsigned m = q & 0x77777777u;  // a selector nibble's bit 3 would replicate a sign instead
    unsigned l0 = prmt(lo_a, lo_b, m), h0 = prmt(hi_a, hi_b, m) | (q & sign);
    unsigned l1 = prmt(lo_a, lo_b, m >> 16), h1 = prmt(hi_a, hi_b, m >> 16) | ((q << 4) & sign);
    a[0] = prmt(l0, h0, 0x5140);
    a[2] = prmt(l0, h0, 0x7362);
    a[1] = prmt(l1, h1, 0x5140);
    a[3] = prmt(l1, h1, 0x7362);
}

// nv4_codes times the rows' scales (exact: see Numerics): lo = row g's pairs (inputs 2c, 2c + 1 |
// 2c + 8, 2c + 9) times sa, hi = row g + 8's times sb, as the prefill kernels' B fragments take them.
__device__ __forceinline__ void nv4_decode(unsigned q, unsigned sa, unsigned sb, unsigned* lo, unsigned* hi) {
    unsigned a[4];
    nv4_codes(q, a);
    lo[0] = mul_bf16x2(a[0], sa);
    lo[1] = mul_bf16x2(a[2], sa);
    hi[0] = mul_bf16x2(a[1], sb);
    hi[1] = mul_bf16x2(a[3], sb);
}

// 8 bytes of weights (a lane's tile scales), streamed like ld_stream's 16.
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// A lane's part of tile `tile` of weight w: its 16 code bytes and its 8 scale bytes.
__device__ __forceinline__ void nv4_load(const WeightDesc& w, long long tile, int lane, uint4& q, uint2& sc) {
    q = ld_stream((const unsigned char*)w.data + tile * NV4_CODE_BYTES + 16 * lane);
    sc = ld_stream8((const unsigned char*)w.scales + tile * NV4_SCALE_BYTES + 8 * (lane >> 2));
}

// Tiles along k of a row block of w.
__device__ __forceinline__ int nv4_k_tiles(const WeightDesc& w) { return (w.k + NV4_K - 1) / NV4_K; }

// Lane (g, c)'s B fragments of the 4 k steps of the tile at input k0 of the bf16 row `xr` (which
// points at the row's input 2c): step s's inputs 16 s + 2c, + 1 and 16 s + 2c + 8, + 9; zeros
// for steps at or past k (the last tile of a row may be partial; its codes there are zeros, and so
// must the inputs be). Loaded once with the tile's weights, so no MMA waits on a load of its own.
__device__ __forceinline__ void nv4_x_frags(const bf16* xr, int k0, int k, unsigned (&b)[4][2]) {
    bool whole = k0 + NV4_K <= k;
#pragma unroll
    for (int s = 0; s < 4; s++) {
        bool in = whole || k0 + 16 * s < k;
        b[s][0] = in ? *(const unsigned*)(xr + k0 + 16 * s) : 0u;
        b[s][1] = in ? *(const unsigned*)(xr + k0 + 16 * s + 8) : 0u;
    }
}

// B operands staged in shared memory as fragments: for row r of k inputs, k tile kt and lane column
// c, the 8 words lane (g, c) takes of that tile (step s, half h: inputs 64 kt + 16 s + 2c + 8 h,
// + 1 as one bf16 pair), 32 bytes at 2 (4 (r kt_n + kt) + c) uint4s; zeros past k. A warp stages
// the U tiles of its own round (`tile(u, r, kt)`: row and k tile of tile u, false for none), lane
// l the word 8c + 2s + h = l of each (`pair(r, input)`), so no other warp waits on them: all
// loads are issued before any store (the compiler cannot move a global load past a shared store,
// so a load-store loop would wait on L2 once per word), then the warp syncs.
template <int U, typename Tile, typename Pair> __device__ __forceinline__ void nv4_stage_round(uint4* dst, int k, int kt_n, Tile tile, Pair pair) {
    int lane = threadIdx.x & 31, j0 = 16 * ((lane >> 1) & 3) + 2 * ((lane >> 3) & 3) + 8 * (lane & 1);
    unsigned v[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        int r, kt;
        bool live = tile(u, r, kt);
        v[u] = live && NV4_K * kt + j0 < k ? pair(r, NV4_K * kt + j0) : 0u;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        int r, kt;
        if (tile(u, r, kt)) ((unsigned*)dst)[32 * (r * kt_n + kt) + lane] = v[u];
    }
    __syncwarp();
}

// One token's x (bf16, k inputs) staged for k tiles kt0 + W u, u < U (those below kt_n).
template <int U> __device__ __forceinline__ void nv4_stage_x(uint4* dst, const bf16* x, int k, int kt_n, int kt0, int W) {
    nv4_stage_round<U>(
        dst, k, kt_n,
        [&](int u, int& r, int& kt) {
            r = 0, kt = kt0 + W * u;
            return kt < kt_n;
        },
        [&](int, int j) { return *(const unsigned*)(x + j); });
}

// Lane column c's two 16-byte reads of staged tile `tile` (row r's k tile kt: r * kt_n + kt).
__device__ __forceinline__ void nv4_staged_tile(const uint4* st, int tile, int c, uint4 (&f)[2]) {
    f[0] = st[2 * (4 * tile + c)];
    f[1] = st[2 * (4 * tile + c) + 1];
}

// The B fragment of step s from a tile's two staged 16-byte reads.
__device__ __forceinline__ void nv4_staged_b(const uint4 (&f)[2], int s, unsigned& b0, unsigned& b1) {
    const uint4& v = f[s >> 1];
    b0 = (s & 1) ? v.z : v.x;
    b1 = (s & 1) ? v.w : v.y;
}

// The tile's scales (a lane's 8 bytes, nv4_load) as f32: s[st] is row g's at k step st, s[4 + st]
// row g + 8's.
__device__ __forceinline__ void nv4_scales_f32(uint2 sc, float (&s)[8]) {
#pragma unroll
    for (int i = 0; i < 4; i++) nv4_scale_pair((unsigned short)((i < 2 ? sc.x : sc.y) >> (16 * (i & 1))), s[2 * i], s[2 * i + 1]);
}

// c += W_tile(16 rows) . B over the tile's 4 k steps (steps past a row's k hold zero codes, and
// the B operand must be zero there). `b(nb, s, b0, b1)` gives this lane's B fragment registers of
// column tile nb for step s (inputs k0 + 16 s .. k0 + 16 s + 15); NB column tiles share each
// decoded A fragment. A step is one scale group of each row, so its codes go to the tensor cores
// unscaled and its product is scaled in f32: fewer instructions than scaling every code pair.
// COL0: only the MMA's column 0 (one token) is wanted: c[nb][0] (row g) and c[nb][2] (row g + 8)
// of the lanes with c = 0; the odd accumulators are left alone.
template <int NB, bool COL0, typename BFrag>
__device__ __forceinline__ void nv4_tile_mma(float (*c)[4], uint4 q, uint2 sc, BFrag b) {
    float sf[8];
    nv4_scales_f32(sc, sf);
    const unsigned qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int s = 0; s < 4; s++) {
        unsigned a[4];
        nv4_codes(qw[s], a);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            unsigned b0, b1;
            b(nb, s, b0, b1);
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_bf16(d, a, b0, b1);
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (!COL0 || !(i & 1)) c[nb][i] += sf[s + 4 * (i >> 1)] * d[i];
        }
    }
}
