// W4A16 on the tensor cores for prefill: bf16 activations times NVFP4 weights (nvfp4.cuh's
// layout, the weights' only device form), f32 accumulation, through mma.sync m16n8k16 bf16. The
// codes are decoded in registers and never expanded in memory. Also the repack that builds the
// layout at load.

#include "nvfp4.cuh"

// Bytes of one pipeline stage's weights: W4_BN / NV4_ROWS = 8 row blocks of one k tile.
#define W4_BLOCKS (W4_BN / NV4_ROWS)
#define W4_TILE_BYTES (W4_BLOCKS * (NV4_CODE_BYTES + NV4_SCALE_BYTES))

// The device layout of the [n, k] matrix whose checkpoint codes ([n, k / 2], even element in the
// low nibble) and scales ([n, k / 16]) are given, into codes_out and scales_out (nvfp4.cuh). One
// block of 128 threads per tile (row block blockIdx.x / ceil(k / 64), k tile blockIdx.x % that);
// thread (lane, s) writes word s of the lane's 16 bytes, threads < 64 one scale byte each.
extern "C" __global__ void nvfp4_repack(unsigned char* codes_out, unsigned char* scales_out, const unsigned char* codes,
                                        const unsigned char* scales, int n, int k) {
    int kt_n = (k + NV4_K - 1) / NV4_K;
    long long tile = blockIdx.x;
    int rb = (int)(tile / kt_n), kb = (int)(tile % kt_n), tid = threadIdx.x;
    int lane = tid >> 2, s = tid & 3, g = lane >> 2, c = lane & 3;
    unsigned word = 0;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        int row = NV4_ROWS * rb + g + 8 * (e >> 2);
        int col = NV4_K * kb + 16 * s + 2 * c + 8 * ((e >> 1) & 1) + (e & 1);
        unsigned code = 0;
        if (row < n && col < k) {
            unsigned char byte = codes[(long long)row * (k / 2) + (col >> 1)];
            code = (col & 1) ? byte >> 4 : byte & 15u;
        }
        word |= (code & 7u) << (4 * e);
        word |= (code >> 3) << nv4_sign_bit(e);
    }
    ((unsigned*)(codes_out + tile * NV4_CODE_BYTES))[4 * lane + s] = word;
    if (tid < NV4_SCALE_BYTES) {
        int sg = tid >> 3, h = (tid >> 2) & 1, ss = tid & 3;
        int row = NV4_ROWS * rb + 8 * h + sg, group = (NV4_K / 16) * kb + ss;
        scales_out[tile * NV4_SCALE_BYTES + tid] = row < n && group < k / 16 ? scales[(long long)row * (k / 16) + group] : 0;
    }
}

// The bf16 [n, k] matrix of an NVFP4 weight w (its tiled layout) without its per-tensor
// multiplier, which is exact (nvfp4.cuh): a warp per tile, lane (g, c) writing its rows g and g + 8
// at inputs 16 s + 2c, + 1 and + 8, + 9 of each step s. 128 threads (4 tiles) a block; k % 16 == 0.
extern "C" __global__ void nvfp4_dequant(bf16* out, WeightDesc w, int n) {
    int kt_n = nv4_k_tiles(w), lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    long long tile = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (tile >= (long long)((n + NV4_ROWS - 1) / NV4_ROWS) * kt_n) return;
    int rb = (int)(tile / kt_n), kb = (int)(tile % kt_n);
    uint4 q;
    uint2 sc;
    nv4_load(w, tile, lane, q, sc);
    unsigned sg[4], sg8[4], qw[4] = {q.x, q.y, q.z, q.w};
    nv4_scales(sc.x, sg);
    nv4_scales(sc.y, sg8);
#pragma unroll
    for (int s = 0; s < 4; s++) {
        unsigned pair[2][2];
        nv4_decode(qw[s], sg[s], sg8[s], pair[0], pair[1]);
        int col = NV4_K * kb + 16 * s + 2 * c;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            long long row = NV4_ROWS * rb + g + 8 * h;
            if (row >= n) continue;
            if (col < w.k) *(unsigned*)(out + row * w.k + col) = pair[h][0];
            if (col + 8 < w.k) *(unsigned*)(out + row * w.k + col + 8) = pair[h][1];
        }
    }
}

// C = A W^T for one tile of 32 MI rows of A and W4_BN weight rows. A row r (< rows) is
// `a + a_row(r) * k`; k % 16 == 0. The weight rows are 8 row blocks: `wsrc(i, w, rb)` names
// block i's weight and row block (false: none, zeros). 256 threads: 2 x 4 warps of 16 MI x 32,
// warp column wn taking blocks 2 wn, 2 wn + 1 (fragments j = 0, 1 and 2, 3). Dynamic shared
// memory: W4_STAGES stages of A (32 MI x NV4_K bf16, 16-byte chunks XOR-swizzled by row) and of
// the 8 blocks' codes then scales. Hands the accumulators (acc[mi][j]: C rows 16 MI wm + 16 mi +
// g (+ 8), fragment j's columns 2c, 2c + 1) to `epilogue(acc, r0, g, c2)` with r0 = 16 MI wm.
template <int MI, typename ARow, typename WSrc, typename Epi>
__device__ __forceinline__ void w4a16_tile(const bf16* a, ARow a_row, int rows, int k, WSrc wsrc, Epi epilogue) {
    constexpr int BM = 32 * MI;
    constexpr unsigned A_STAGE = BM * NV4_K * 2;  // bytes
    extern __shared__ __align__(16) unsigned char w4_sh[];
    unsigned char* sb = w4_sh + W4_STAGES * A_STAGE;
    // 32-bit shared addresses for cp.async and ldmatrix.
    const unsigned sa_u = smem_addr(w4_sh), sb_u = sa_u + W4_STAGES * A_STAGE;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp & 1, wn = warp >> 1;
    int kt_n = (k + NV4_K - 1) / NV4_K;

    // This thread's copies per stage: chunk tid % 8 of A rows tid / 8 + 32 i (which share one
    // swizzle); 16 code bytes of block tid / 32; for 32 threads 16 scale bytes of block tid / 4.
    const int ch = tid & 7, r0 = tid >> 3;
    const unsigned cdst = r0 * NV4_K * 2 + ((ch ^ (r0 & 7)) << 4);
    const bf16* a_src[MI];
    bool a_ok[MI];
#pragma unroll
    for (int i = 0; i < MI; i++) {
        int r = r0 + 32 * i;
        a_ok[i] = r < rows;
        a_src[i] = a + (a_ok[i] ? (long long)a_row(r) * k : 0) + 8 * ch;
    }
    WeightDesc cw, sw;
    int crb, srb;
    bool c_ok = wsrc(tid >> 5, cw, crb), s_ok = tid < 32 && wsrc(tid >> 2, sw, srb);
    const unsigned char* c_src = c_ok ? (const unsigned char*)cw.data + (long long)crb * kt_n * NV4_CODE_BYTES + 16 * (tid & 31) : nullptr;
    const unsigned char* s_src = s_ok ? (const unsigned char*)sw.scales + (long long)srb * kt_n * NV4_SCALE_BYTES + 16 * (tid & 3) : nullptr;
    auto load = [&](int stage, int kt) {
        int k0 = kt * NV4_K;
        bool in_k = k0 + 8 * ch < k;
#pragma unroll
        for (int i = 0; i < MI; i++)
            cp_async16(sa_u + stage * A_STAGE + cdst + i * 32 * NV4_K * 2, a_src[i] + (in_k ? k0 : 0), a_ok[i] && in_k);
        unsigned dst = sb_u + stage * W4_TILE_BYTES;
        cp_async16(dst + 16 * tid, c_ok ? c_src + (long long)kt * NV4_CODE_BYTES : nullptr, c_ok);
        if (tid < 32) cp_async16(dst + W4_BLOCKS * NV4_CODE_BYTES + 16 * tid, s_ok ? s_src + (long long)kt * NV4_SCALE_BYTES : nullptr, s_ok);
    };
    // ldmatrix rows wm * 16 MI + 16 mi + lane % 16 (all with r & 7 = lane & 7), chunk 2 s + lane / 16
    // of k-step s: a per-lane base for each s plus immediates.
    unsigned a_ld[NV4_K / 16];
#pragma unroll
    for (int s = 0; s < NV4_K / 16; s++) a_ld[s] = sa_u + (wm * 16 * MI + (lane & 15)) * NV4_K * 2 + (((2 * s + (lane >> 4)) ^ (lane & 7)) << 4);

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
    int g = lane >> 2;
    cp_async_pipeline<W4_STAGES>(kt_n, load, [&](int stage) {
        if (!live[0]) return;
        const unsigned char* tb = sb + stage * W4_TILE_BYTES;
        uint4 q[2];
        unsigned sg[2][4], sg8[2][4];
#pragma unroll
        for (int hb = 0; hb < 2; hb++) {
            int blk = 2 * wn + hb;
            q[hb] = *(const uint4*)(tb + blk * NV4_CODE_BYTES + 16 * lane);
            uint2 sc = *(const uint2*)(tb + W4_BLOCKS * NV4_CODE_BYTES + blk * NV4_SCALE_BYTES + 8 * g);
            nv4_scales(sc.x, sg[hb]);
            nv4_scales(sc.y, sg8[hb]);
        }
#pragma unroll
        for (int s = 0; s < NV4_K / 16; s++) {
            unsigned bfr[4][2], af[MI][4];
            const unsigned qw0[4] = {q[0].x, q[0].y, q[0].z, q[0].w}, qw1[4] = {q[1].x, q[1].y, q[1].z, q[1].w};
            nv4_decode(qw0[s], sg[0][s], sg8[0][s], bfr[0], bfr[1]);
            nv4_decode(qw1[s], sg[1][s], sg8[1][s], bfr[2], bfr[3]);
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
                if (live[mi]) ldsm_x4(af[mi], a_ld[s] + stage * A_STAGE + mi * 16 * NV4_K * 2);
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
                if (live[mi])
#pragma unroll
                    for (int j = 0; j < 4; j++) mma_bf16(acc[mi][j], af[mi], bfr[j][0], bfr[j][1]);
        }
    });
    epilogue(acc, wm * 16 * MI, g, (lane & 3) * 2);
}

// y[t, n] = x[t, k] W^T for an NVFP4 W. Grid (ceil(n / W4_BN), ceil(t / 128)), 256 threads,
// W4_STAGES * (128 * NV4_K * 2 + W4_TILE_BYTES) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 2) w4a16_gemm(bf16* y, const bf16* x, WeightDesc w, int t, int n) {
    long long m0 = blockIdx.y * 128LL;
    int rb0 = blockIdx.x * W4_BLOCKS, rb_n = (n + NV4_ROWS - 1) / NV4_ROWS, n0 = blockIdx.x * W4_BN, wn = (threadIdx.x >> 5) >> 1;
    float global = w.global[0];
    w4a16_tile<4>(
        x + m0 * w.k, [](int r) { return r; }, min(128LL, t - m0), w.k,
        [&](int i, WeightDesc& d, int& rb) {
            d = w;
            rb = rb0 + i;
            return rb < rb_n;
        },
        [&](float (&acc)[4][4][4], int rbase, int g, int c2) {
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        long long r = rbase + mi * 16 + g + 8 * half;
                        int col = n0 + wn * 32 + 8 * j + c2;
                        if (m0 + r >= t || col >= n) continue;
                        float v0 = acc[mi][j][2 * half] * global, v1 = acc[mi][j][2 * half + 1] * global;
                        bf16* o = y + (m0 + r) * n + col;
                        if (col + 1 < n && (n & 1) == 0) {
                            *(unsigned*)o = pack_bf16(v0, v1);
                        } else {
                            o[0] = f2bf(v0);
                            if (col + 1 < n) o[1] = f2bf(v1);
                        }
                    }
        });
}

// ---- Grouped MoE prefill with NVFP4 experts: moe_prefill.cu's tiles (128 expert-sorted slots
// of one expert each) over the expert table (gate, up, down of expert e at 3e, 3e + 1, 3e + 2). ----

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
// gathered through sorted_tok. A block takes 64 units: warp column wn's blocks are the gate's and
// the up's row block 4 blockIdx.x + wn, so a thread holds gate u (fragment j) and up u (j + 2)
// together. Grid (ceil(inter / 64), max tiles), 256 threads, W4_STAGES * (128 * NV4_K * 2 +
// W4_TILE_BYTES) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 2) moe_w4_gate_up(bf16* act, const bf16* x, const int* sorted_tok, const WeightDesc* table, const int* tiles,
                                                                    const int* n_tiles, const int* counts, const int* offsets, int inter, int hidden) {
    int e, row0, rows;
    if (!w4_moe_tile(tiles, n_tiles, counts, offsets, e, row0, rows)) return;
    const WeightDesc gate = table[3 * e], up = table[3 * e + 1];
    int ub0 = blockIdx.x * (W4_BLOCKS / 2), rb_n = (inter + NV4_ROWS - 1) / NV4_ROWS, wn = (threadIdx.x >> 5) >> 1;
    w4a16_tile<W4_MOE_MI>(
        x, [&](int r) { return sorted_tok[row0 + r]; }, rows, hidden,
        [&](int i, WeightDesc& d, int& rb) {
            d = (i & 1) ? up : gate;
            rb = ub0 + (i >> 1);
            return rb < rb_n;
        },
        [&](float (&acc)[W4_MOE_MI][4][4], int rbase, int g, int c2) {
#pragma unroll
            for (int mi = 0; mi < W4_MOE_MI; mi++)
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        int r = rbase + mi * 16 + g + 8 * half;
                        if (r >= rows) continue;
#pragma unroll
                        for (int p = 0; p < 2; p++) {
                            int u = NV4_ROWS * (ub0 + wn) + 8 * j + c2 + p;
                            if (u < inter)
                                act[(long long)(row0 + r) * inter + u] =
                                    f2bf(silu(acc[mi][j][2 * half + p] * gate.global[0]) * (acc[mi][j + 2][2 * half + p] * up.global[0]));
                        }
                    }
        });
}

// y[pos, :] = down(act[pos]), rounded to bf16 as moe_gemm_down's (moe_prefill.cu). Grid
// (ceil(hidden / W4_BN), max tiles), as above.
extern "C" __global__ void __launch_bounds__(256, 2) moe_w4_down(bf16* y, const bf16* act, const WeightDesc* table, const int* tiles, const int* n_tiles,
                                                                 const int* counts, const int* offsets, int inter, int hidden) {
    int e, row0, rows;
    if (!w4_moe_tile(tiles, n_tiles, counts, offsets, e, row0, rows)) return;
    const WeightDesc down = table[3 * e + 2];
    int rb0 = blockIdx.x * W4_BLOCKS, rb_n = (hidden + NV4_ROWS - 1) / NV4_ROWS, n0 = blockIdx.x * W4_BN, wn = (threadIdx.x >> 5) >> 1;
    w4a16_tile<W4_MOE_MI>(
        act + (long long)row0 * inter, [](int r) { return r; }, rows, inter,
        [&](int i, WeightDesc& d, int& rb) {
            d = down;
            rb = rb0 + i;
            return rb < rb_n;
        },
        [&](float (&acc)[W4_MOE_MI][4][4], int rbase, int g, int c2) {
#pragma unroll
            for (int mi = 0; mi < W4_MOE_MI; mi++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        int r = rbase + mi * 16 + g + 8 * half, col = n0 + wn * 32 + 8 * j + c2;
                        if (r >= rows || col >= hidden) continue;
                        bf16* o = y + (long long)(row0 + r) * hidden + col;
                        o[0] = f2bf(acc[mi][j][2 * half] * down.global[0]);
                        if (col + 1 < hidden) o[1] = f2bf(acc[mi][j][2 * half + 1] * down.global[0]);
                    }
        });
}
