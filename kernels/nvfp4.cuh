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
// 4e .. 4e + 2 and its sign at bit 3 + 4 (e >> 1) + 16 (e & 1), where one shift puts it on the sign
// bit of its bf16 (nv4_decode). One 16-byte load per lane thus gives a warp a 16 x 64 block with
// no shuffle: as the A operand (weight rows as M), or as two B fragments (rows g and g + 8 as N).
// A tile's scales: byte 8 g + 4 h + s is the fp8 scale of row 8 h + g for step s, so a lane's 8
// bytes at 8 g are its two rows' four steps.
//
// Numerics: e2m1 (2 significant bits) x e4m3 (4 significant bits, 2^-9 .. 448) is exact in bf16
// (8 significant bits, f32's exponent range), so the tensor cores see the weight exactly up to
// the per-tensor multiplier, which the kernels apply in f32.

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

// Scales s = 0..3 (bytes of `sc`) as bf16 pairs (s_s, s_s), exactly (via f16).
__device__ __forceinline__ void nv4_scales(unsigned sc, unsigned* s) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
        unsigned h2;
        float lo, hi;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(sc >> (16 * p))));
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(h2));
        asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(s[2 * p]) : "f"(lo));
        asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(s[2 * p + 1]) : "f"(hi));
    }
}

// The 8 codes of one word (layout above) as bf16 pairs times their rows' scales: lo = row g's
// (inputs 2c, 2c + 1 | 2c + 8, 2c + 9) times sa, hi = row g + 8's times sb. Magnitudes go through
// two byte tables (low and high bytes of the bf16 of 0, .5, 1, 1.5, 2, 3, 4, 6), signs are
// shifted onto bits 15 and 31.
__device__ __forceinline__ void nv4_decode(unsigned q, unsigned sa, unsigned sb, unsigned* lo, unsigned* hi) {
    const unsigned lo_a = 0xC0800000u, lo_b = 0xC0804000u, hi_a = 0x3F3F3F00u, hi_b = 0x40404040u;
    unsigned m = q & 0x77777777u;
    unsigned l0 = prmt(lo_a, lo_b, m), h0 = prmt(hi_a, hi_b, m);
    unsigned l1 = prmt(lo_a, lo_b, m >> 16), h1 = prmt(hi_a, hi_b, m >> 16);
    const unsigned sign = 0x80008000u;
    lo[0] = mul_bf16x2(prmt(l0, h0, 0x5140) | ((q << 12) & sign), sa);
    lo[1] = mul_bf16x2(prmt(l0, h0, 0x7362) | ((q << 8) & sign), sa);
    hi[0] = mul_bf16x2(prmt(l1, h1, 0x5140) | ((q << 4) & sign), sb);
    hi[1] = mul_bf16x2(prmt(l1, h1, 0x7362) | (q & sign), sb);
}

// One word as the A fragment of an m16n8k16 MMA (rows g, g + 8 of the tile as M).
__device__ __forceinline__ void nv4_a_frag(unsigned q, unsigned sa, unsigned sb, unsigned* a) {
    unsigned lo[2], hi[2];
    nv4_decode(q, sa, sb, lo, hi);
    a[0] = lo[0];
    a[1] = hi[0];
    a[2] = lo[1];
    a[3] = hi[1];
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
// when !ok and for steps at or past k (the last tile of a row may be partial). Loaded once with
// the tile's weights, so no MMA waits on a load of its own.
__device__ __forceinline__ void nv4_x_frags(const bf16* xr, int k0, int k, bool ok, unsigned (&b)[4][2]) {
#pragma unroll
    for (int s = 0; s < 4; s++) {
        bool in = ok && k0 + 16 * s < k;
        b[s][0] = in ? *(const unsigned*)(xr + k0 + 16 * s) : 0u;
        b[s][1] = in ? *(const unsigned*)(xr + k0 + 16 * s + 8) : 0u;
    }
}

// c += W_tile(16 rows) . B over the k steps of one tile that lie inside k (the last tile of a row
// may be partial: its steps past k hold zero codes, and the B operand has no inputs there). `b(nb,
// s, b0, b1)` gives this lane's B fragment registers of column tile nb for step s (inputs k0 + 16 s
// .. k0 + 16 s + 15); NB column tiles share each decoded A fragment.
template <int NB, typename BFrag>
__device__ __forceinline__ void nv4_tile_mma(float (*c)[4], uint4 q, uint2 sc, int k0, int k, BFrag b) {
    unsigned sg[4], sg8[4], qw[4] = {q.x, q.y, q.z, q.w};
    nv4_scales(sc.x, sg);
    nv4_scales(sc.y, sg8);
#pragma unroll
    for (int s = 0; s < 4; s++) {
        if (k0 + 16 * s >= k) break;
        unsigned a[4];
        nv4_a_frag(qw[s], sg[s], sg8[s], a);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            unsigned b0, b1;
            b(nb, s, b0, b1);
            mma_bf16(c[nb], a, b0, b1);
        }
    }
}
