// W4A16 on the tensor cores: bf16 activations times NVFP4 weights, f32 accumulation, through
// mma.sync m16n8k16 bf16. The codes are decoded in registers and never expanded in memory.
//
// w4a16_repack lays each weight out once (vt-cuda keeps the copy in the weight's resident slot) in
// tiles of W4_BN rows x W4_BK inputs, one tile after another along k for each row tile, each tile
// its codes (4096 bytes) then its fp8 scales (512 bytes). Inside a tile, warp column wn (rows
// 32 wn .. 32 wn + 31) owns 1024 code bytes: [half h][lane][16 bytes], so one 16-byte load per
// lane per half gives a warp exactly its B fragments of two k16 steps (2h, 2h + 1) with no bank
// conflict. Lane (g = lane / 4, c = lane % 4) holds, for step s and column fragment j (rows 8 j + g),
// the codes of inputs 16 s + {2c, 2c+1} (fragment register b0) and 16 s + {2c+8, 2c+9} (b1).
// Word 2 (s & 1) + (j >> 1) of the lane's 16 bytes holds fragments j = 2 (j >> 1), +1: its
// element e (0..7) is fragment j0 + e / 4, register (e / 2) & 1, input e & 1 of the pair, with
// the magnitude in bits 4e..4e+2 and the sign at bit 3 + 4 (e / 2) + 16 (e & 1), where one shift
// puts it on the sign bit of its bf16 (w4_decode). Scales: warp column wn owns 128 bytes,
// [g][s][j], the scale of row 32 wn + 8 j + g for the inputs of step s.
//
// Numerics: e2m1 (2 significant bits) x e4m3 (4 significant bits, 2^-9 .. 448) is exact in bf16
// (8 significant bits, f32's exponent range), so the tensor cores see the weight exactly up to
// the per-tensor multiplier, which the epilogue applies in f32.

// W4_BN weight rows and W4_BK inputs per tile (and pipeline stage), W4_STAGES stages.
#define W4_CODE_BYTES (W4_BN * W4_BK / 2)          // 4096
#define W4_SCALE_BYTES (W4_BN * W4_BK / 16)        // 512
#define W4_TILE_BYTES (W4_CODE_BYTES + W4_SCALE_BYTES)

// Row `row` of a matrix of `row_bytes` rows at `a`, or, when `b` is set, of the rows of a and b
// interleaved (an expert's gate and up rows u as rows 2u, 2u + 1).
__device__ __forceinline__ const unsigned char* w4_src_row(const unsigned char* a, const unsigned char* b, int row, long long row_bytes) {
    return b ? ((row & 1) ? b : a) + (row >> 1) * row_bytes : a + row * row_bytes;
}

// Grid (k tiles, row tiles), 256 threads. The matrix is [n, k] (codes, scales), or with codes2
// set, those rows interleaved with (codes2, scales2)'s (w4_src_row). Rows >= n and inputs >= k
// are zero codes and scales, so the GEMM needs no bounds on the weight side.
extern "C" __global__ void w4a16_repack(unsigned char* packed, const unsigned char* codes, const unsigned char* scales,
                                        const unsigned char* codes2, const unsigned char* scales2, int n, int k) {
    int kt = blockIdx.x, nt = blockIdx.y;
    unsigned char* tile = packed + ((long long)nt * gridDim.x + kt) * W4_TILE_BYTES;
    for (int wd = threadIdx.x; wd < W4_CODE_BYTES / 4; wd += blockDim.x) {
        int wi = wd & 3, lane = (wd >> 2) & 31, h = (wd >> 7) & 1, wn = wd >> 8;
        int w = 4 * h + wi, s = w >> 1, g = lane >> 2, c = lane & 3;
        unsigned word = 0;
        for (int e = 0; e < 8; e++) {
            int j = 2 * (w & 1) + (e >> 2);
            int row = nt * W4_BN + wn * 32 + 8 * j + g;
            int col = kt * W4_BK + 16 * s + 2 * c + 8 * ((e >> 1) & 1) + (e & 1);
            unsigned code = 0;
            if (row < n && col < k) {
                unsigned char byte = w4_src_row(codes, codes2, row, k / 2)[col >> 1];
                code = (col & 1) ? byte >> 4 : byte & 15u;
            }
            word |= (code & 7u) << (4 * e);
            word |= (code >> 3) << (3 + 4 * (e >> 1) + 16 * (e & 1));
        }
        ((unsigned*)tile)[wd] = word;
    }
    for (int i = threadIdx.x; i < W4_SCALE_BYTES; i += blockDim.x) {
        int j = i & 3, s = (i >> 2) & 3, g = (i >> 4) & 7, wn = i >> 7;
        int row = nt * W4_BN + wn * 32 + 8 * j + g, group = kt * (W4_BK / 16) + s;
        tile[W4_CODE_BYTES + i] = row < n && group < k / 16 ? w4_src_row(scales, scales2, row, k / 16)[group] : 0;
    }
}

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

// Scales j = 0..3 of one step (bytes of `sc`) as bf16 pairs (s_j, s_j), exactly (via f16).
__device__ __forceinline__ void w4_scales(unsigned sc, unsigned* s) {
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

// The two B fragments of one repacked word (layout above), times their scales sa and sb.
// Magnitudes go through two byte tables (low and high bytes of the bf16 of 0, .5, 1, 1.5, 2, 3,
// 4, 6), signs are shifted onto bits 15 and 31.
__device__ __forceinline__ void w4_decode(unsigned q, unsigned sa, unsigned sb, unsigned* fa, unsigned* fb) {
    const unsigned lo_a = 0xC0800000u, lo_b = 0xC0804000u, hi_a = 0x3F3F3F00u, hi_b = 0x40404040u;
    unsigned m = q & 0x77777777u;
    unsigned l0 = prmt(lo_a, lo_b, m), h0 = prmt(hi_a, hi_b, m);
    unsigned l1 = prmt(lo_a, lo_b, m >> 16), h1 = prmt(hi_a, hi_b, m >> 16);
    const unsigned sign = 0x80008000u;
    fa[0] = mul_bf16x2(prmt(l0, h0, 0x5140) | ((q << 12) & sign), sa);
    fa[1] = mul_bf16x2(prmt(l0, h0, 0x7362) | ((q << 8) & sign), sa);
    fb[0] = mul_bf16x2(prmt(l1, h1, 0x5140) | ((q << 4) & sign), sb);
    fb[1] = mul_bf16x2(prmt(l1, h1, 0x7362) | (q & sign), sb);
}

// C = A W^T for one tile of 32 MI rows of A and W4_BN weight rows. A row r (< rows) is
// `a + a_row(r) * k`; `wt` is the weight's first packed tile of this row tile; k % 16 == 0.
// 256 threads: 2 x 4 warps of 16 MI x 32. Dynamic shared memory: W4_STAGES stages of A
// (32 MI x W4_BK bf16, 16-byte chunks XOR-swizzled by row) and one packed tile.
// Hands each pair of adjacent outputs (tile row r, weight row col, col + 1) to `epilogue`.
template <int MI, typename ARow, typename Epi>
__device__ __forceinline__ void w4a16_tile(const bf16* a, ARow a_row, int rows, const unsigned char* wt, int n0, int n, int k, Epi epilogue) {
    constexpr int BM = 32 * MI;
    constexpr unsigned A_STAGE = BM * W4_BK * 2;  // bytes
    extern __shared__ __align__(16) unsigned char w4_sh[];
    unsigned char* sb = w4_sh + W4_STAGES * A_STAGE;
    // 32-bit shared addresses for cp.async and ldmatrix.
    const unsigned sa_u = smem_addr(w4_sh), sb_u = sa_u + W4_STAGES * A_STAGE;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp & 1, wn = warp >> 1;

    // This thread's copies per stage: chunk tid % 8 of A rows tid / 8 + 32 i (which share one
    // swizzle), one chunk of codes, and for 32 threads one of scales.
    const int ch = tid & 7, r0 = tid >> 3;
    const unsigned cdst = r0 * W4_BK * 2 + ((ch ^ (r0 & 7)) << 4);
    const bf16* a_src[MI];
    bool a_ok[MI];
#pragma unroll
    for (int i = 0; i < MI; i++) {
        int r = r0 + 32 * i;
        a_ok[i] = r < rows;
        a_src[i] = a + (a_ok[i] ? (long long)a_row(r) * k : 0) + 8 * ch;
    }
    auto load = [&](int stage, int kt) {
        int k0 = kt * W4_BK;
        bool in_k = k0 + 8 * ch < k;
#pragma unroll
        for (int i = 0; i < MI; i++)
            cp_async16(sa_u + stage * A_STAGE + cdst + i * 32 * W4_BK * 2, a_src[i] + (in_k ? k0 : 0), a_ok[i] && in_k);
        const unsigned char* src = wt + (long long)kt * W4_TILE_BYTES;
        unsigned dst = sb_u + stage * W4_TILE_BYTES;
        cp_async16(dst + 16 * tid, src + 16 * tid, true);
        if (tid < W4_SCALE_BYTES / 16) cp_async16(dst + W4_CODE_BYTES + 16 * tid, src + W4_CODE_BYTES + 16 * tid, true);
    };
    // ldmatrix rows wm * 16 MI + 16 mi + lane % 16 (all with r & 7 = lane & 7), chunk 2 s + lane / 16
    // of k-step s: a per-lane base for each s plus immediates.
    unsigned a_ld[W4_BK / 16];
#pragma unroll
    for (int s = 0; s < W4_BK / 16; s++) a_ld[s] = sa_u + (wm * 16 * MI + (lane & 15)) * W4_BK * 2 + (((2 * s + (lane >> 4)) ^ (lane & 7)) << 4);

    float acc[MI][4][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int x = 0; x < 4; x++) acc[mi][j][x] = 0.0f;

    // 16-row slices past `rows` (a short last tile) skip their products.
    bool live[MI];
#pragma unroll
    for (int mi = 0; mi < MI; mi++) live[mi] = wm * 16 * MI + mi * 16 < rows;
    cp_async_pipeline<W4_STAGES>((k + W4_BK - 1) / W4_BK, load, [&](int stage) {
        if (!live[0]) return;
        const unsigned char* tb = sb + stage * W4_TILE_BYTES;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint4 q = *(const uint4*)(tb + ((wn * 2 + h) * 32 + lane) * 16);
            unsigned qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int ss = 0; ss < 2; ss++) {
                int s = 2 * h + ss;
                unsigned sc[4], bfr[4][2], af[MI][4];
                w4_scales(*(const unsigned*)(tb + W4_CODE_BYTES + wn * 128 + (lane >> 2) * 16 + 4 * s), sc);
                w4_decode(qw[2 * ss], sc[0], sc[1], bfr[0], bfr[1]);
                w4_decode(qw[2 * ss + 1], sc[2], sc[3], bfr[2], bfr[3]);
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
                    if (live[mi]) ldsm_x4(af[mi], a_ld[s] + stage * A_STAGE + mi * 16 * W4_BK * 2);
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
                    if (live[mi])
#pragma unroll
                        for (int j = 0; j < 4; j++) mma_bf16(acc[mi][j], af[mi], bfr[j][0], bfr[j][1]);
            }
        }
    });

    int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                int r = wm * 16 * MI + mi * 16 + g + 8 * half, col = n0 + wn * 32 + 8 * j + c2;
                if (r < rows && col < n) epilogue(r, col, acc[mi][j][2 * half], acc[mi][j][2 * half + 1]);
            }
}

// y[t, n] = x[t, k] W^T for a repacked NVFP4 W. Grid (row tiles of W, ceil(t / 128)), 256 threads,
// W4_STAGES * (128 * W4_BK * 2 + W4_TILE_BYTES) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 2) w4a16_gemm(bf16* y, const bf16* x, const unsigned char* packed, int t, int n, int k, float global) {
    long long m0 = blockIdx.y * 128LL;
    int k_tiles = (k + W4_BK - 1) / W4_BK;
    w4a16_tile<4>(
        x + m0 * k, [](int r) { return r; }, min(128LL, t - m0), packed + (long long)blockIdx.x * k_tiles * W4_TILE_BYTES, blockIdx.x * W4_BN, n, k,
        [&](int r, int col, float v0, float v1) {
            bf16* o = y + (m0 + r) * n + col;
            if (col + 1 < n && (n & 1) == 0) {
                *(unsigned*)o = pack_bf16(v0 * global, v1 * global);
            } else {
                o[0] = f2bf(v0 * global);
                if (col + 1 < n) o[1] = f2bf(v1 * global);
            }
        });
}

// ---- Grouped MoE prefill with NVFP4 experts: moe_prefill.cu's tiles (128 expert-sorted slots
// of one expert each, MP_BM) over repacked copies of the expert table's weights (w4a16.rs
// `PackedExperts`): in `table`, entry 2e is expert e's gate and up packed as one [2 inter, hidden]
// matrix (rows 2u, 2u + 1 = gate u, up u, multipliers global[0], global[1]) and 2e + 1 its down
// [hidden, inter], each `data` its repacked tiles. ----

// W4_MOE_MI: a MoE tile's 128 slots as w4a16_tile's 32 MI rows.

// The tile of slots `blockIdx.y` (expert, first sorted row, row count); false for a spare block.
__device__ __forceinline__ bool w4_moe_tile(const int* tiles, const int* n_tiles, const int* counts, const int* offsets, int& e, int& row0, int& rows) {
    int tile = blockIdx.y;
    if (tile >= *n_tiles) return false;
    e = tiles[2 * tile];
    row0 = tiles[2 * tile + 1];
    rows = min(32 * W4_MOE_MI, offsets[e] + counts[e] - row0);
    return true;
}

// act[pos, u] = silu(gate_u . x) * (up_u . x) in bf16 for every sorted slot, the token rows of x
// gathered through sorted_tok. Grid (ceil(2 inter / W4_BN), max tiles), 256 threads,
// W4_STAGES * (128 * W4_BK * 2 + W4_TILE_BYTES) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 2) moe_w4_gate_up(bf16* act, const bf16* x, const int* sorted_tok, const WeightDesc* table, const int* tiles,
                                                                    const int* n_tiles, const int* counts, const int* offsets, int inter, int hidden) {
    int e, row0, rows;
    if (!w4_moe_tile(tiles, n_tiles, counts, offsets, e, row0, rows)) return;
    WeightDesc w = table[2 * e];
    const unsigned char* wt = (const unsigned char*)w.data + (long long)blockIdx.x * ((hidden + W4_BK - 1) / W4_BK) * W4_TILE_BYTES;
    w4a16_tile<W4_MOE_MI>(x, [&](int r) { return sorted_tok[row0 + r]; }, rows, wt, blockIdx.x * W4_BN, 2 * inter, hidden, [&](int r, int col, float gate, float up) {
        act[(long long)(row0 + r) * inter + col / 2] = f2bf(silu(gate * w.global[0]) * (up * w.global[1]));
    });
}

// y[pos, :] = down(act[pos]), rounded to bf16 as moe_gemm_down's (moe_prefill.cu). Grid
// (ceil(hidden / W4_BN), max tiles), as above.
extern "C" __global__ void __launch_bounds__(256, 2) moe_w4_down(bf16* y, const bf16* act, const WeightDesc* table, const int* tiles, const int* n_tiles,
                                                                 const int* counts, const int* offsets, int inter, int hidden) {
    int e, row0, rows;
    if (!w4_moe_tile(tiles, n_tiles, counts, offsets, e, row0, rows)) return;
    WeightDesc w = table[2 * e + 1];
    const unsigned char* wt = (const unsigned char*)w.data + (long long)blockIdx.x * ((inter + W4_BK - 1) / W4_BK) * W4_TILE_BYTES;
    w4a16_tile<W4_MOE_MI>(act + (long long)row0 * inter, [](int r) { return r; }, rows, wt, blockIdx.x * W4_BN, hidden, inter, [&](int r, int col, float v0, float v1) {
        bf16* o = y + (long long)(row0 + r) * hidden + col;
        o[0] = f2bf(v0 * w.global[0]);
        if (col + 1 < hidden) o[1] = f2bf(v1 * w.global[0]);
    });
}
