// Decode-time linear layers: a few tokens against weights that are read once, 16 bytes per lane
// per load, several loads in flight per lane before any arithmetic (decode is bound by the
// latency of those loads, not by FLOPs). Weights are bf16 (weight_chunks.cuh) or NVFP4 W4A16
// (nvfp4.cuh).
//
// gemv_bf16: dense linear layers for t <= GEMV_MAX_T tokens, up to GEMV_MAX_PARTS weights that
// share the input in one launch (a mixer's projections; a MoE block's router and shared-expert
// gate, as f32 logits); gemv_bf16_mma*: the same for bf16 from 3 tokens, on tensor cores;
// gemv_nvfp4*: NVFP4 for 1 to GEMV_MMA_MAX_T tokens, on tensor cores.

#include "weight_chunks.cuh"
#include "nvfp4.cuh"

// GEMV_ROWS: rows per warp in gemv_*, each x chunk loaded is used GEMV_ROWS times.
// Chunks each lane loads before it computes.
#define CHUNKS 4

// y[i * ld + r] = v, as f32 when `f32_out`, else rounded to bf16.
__device__ __forceinline__ void store_y(void* y, bool f32_out, long long at, float v) {
    if (f32_out) ((float*)y)[at] = v;
    else ((bf16*)y)[at] = f2bf(v);
}

// ---------------------------------------------------------------------------------------------
// Dense linear layers: y[i, r] = x[i, :] . W[r, :] for i < t <= MAXT. Block: 128 threads
// (4 warps) in 4 / ks groups of ks warps; group g of block b owns rows (b * 4 / ks + g) * GEMV_ROWS
// + [0, GEMV_ROWS), its warps splitting each row's chunks (ks in {1, 2, 4}): a layer of few rows
// then still has enough loads in flight, where a warp per row pair would leave most SMs idle and
// stream each row in several dependent rounds. k % ELEMS == 0.
template <int MAXT> __device__ void gemv(void* y, int ld, bool f32_out, const bf16* x, const WeightDesc& w, int n, int t, int block, int ks) {
    typedef Bf16Chunks F;
    __shared__ float part[4][MAXT][GEMV_ROWS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slice = warp % ks;
    int r0 = (block * (4 / ks) + warp / ks) * GEMV_ROWS;
    // Split warps meet at a barrier below, so a group past the last row still runs (on row n - 1).
    if (r0 >= n && ks == 1) return;
    long long rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) rows[r] = min(r0 + r, n - 1);  // the tail repeats a row, unused
    float acc[MAXT][GEMV_ROWS];
#pragma unroll
    for (int i = 0; i < MAXT; i++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) acc[i][r] = 0.0f;
    int nc = w.k / F::ELEMS, step = 32 * ks, first = lane + 32 * slice;
    uint4 v[CHUNKS][GEMV_ROWS];
    auto load_round = [&](int c0) {
#pragma unroll
        for (int u = 0; u < CHUNKS; u++)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++)
                if (c0 + step * u < nc) F::load(w, rows[r], c0 + step * u, v[u][r]);
    };
    // The first round of weights is in flight before the previous kernel (which writes x) ends.
    load_round(first);
    grid_dep_wait();
    for (int c0 = first; c0 < nc; c0 += step * CHUNKS) {
        if (c0 != first) load_round(c0);
#pragma unroll
        for (int u = 0; u < CHUNKS; u++) {
            if (c0 + step * u >= nc) break;
#pragma unroll
            for (int i = 0; i < MAXT; i++) {
                if (i >= t) break;
                float xf[F::ELEMS];
                load_xchunk(x + (long long)i * w.k, c0 + step * u, xf);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; r++) acc[i][r] += F::dot(v[u][r], xf);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAXT; i++) {
        if (i >= t) break;
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            float sum = warp_sum(acc[i][r]);
            if (ks == 1) {
                if (lane == 0 && r0 + r < n) store_y(y, f32_out, (long long)i * ld + r0 + r, sum);
            } else if (lane == 0) {
                part[warp][i][r] = sum;
            }
        }
    }
    if (ks == 1) return;
    __syncthreads();
    // The group's first warp adds the slices in a fixed order (the result does not depend on timing).
    if (slice != 0) return;
    for (int e = lane; e < t * GEMV_ROWS; e += 32) {
        int i = e / GEMV_ROWS, r = e % GEMV_ROWS;
        float sum = 0.0f;
        for (int j = 0; j < ks; j++) sum += part[warp + j][i][r];
        if (r0 + r < n) store_y(y, f32_out, (long long)i * ld + r0 + r, sum);
    }
}

// Weights of one format that read the same input (vt-cuda's `GemvParts`, #[repr(C)]): part p
// writes y[p] [t, n[p]] (rows ld[p] apart) from blocks first_block[p] .. first_block[p + 1] (the
// last: to the grid's end), as bf16, or as f32 when `f32_out` (router logits).
struct GemvParts {
    WeightDesc w[GEMV_MAX_PARTS];
    u64 y[GEMV_MAX_PARTS];
    int n[GEMV_MAX_PARTS];
    int ld[GEMV_MAX_PARTS];
    int first_block[GEMV_MAX_PARTS];
    int parts;
    int ks;  // warps per row group (see gemv)
    int f32_out;
    int pad;
};

// The part this block serves.
__device__ __forceinline__ int part_of(const GemvParts& p) {
    int part = 0;
    for (int i = 1; i < p.parts; i++)
        if ((int)blockIdx.x >= p.first_block[i]) part = i;
    return part;
}

template <int MAXT> __device__ void gemv_parts(const GemvParts& p, const bf16* x, int t) {
    grid_dep_trigger();
    int part = part_of(p);
    gemv<MAXT>((void*)p.y[part], p.ld[part], p.f32_out, x, p.w[part], p.n[part], t, blockIdx.x - p.first_block[part], p.ks);
}

// ---------------------------------------------------------------------------------------------
// bf16 linear layers for 3..GEMV_MAX_T tokens (vt-cuda's MMA_MIN_T) on tensor cores. On CUDA
// cores each 16-byte weight chunk costs 8 FMAs and a conversion of the chunk's inputs per token,
// which made these layers issue-bound; an m16n8k16 MMA takes 16 rows x 16 inputs x all 8 token
// columns at once (docs/performance.md).
//
// A dot product does not depend on the order of its terms, so the MMA's k positions can map to
// memory in any order both operands share. Lane (g = lane / 4, q = lane % 4) loads 16 bytes at
// inputs 8q .. 8q + 7 of a 32-input chunk from weight rows g and g + 8 and from token g's input
// (zeros past t); the chunk's first MMA takes each lane's inputs 8q .. 8q + 3, the second 8q + 4 ..
// 8q + 7, which puts exactly the A and B fragment elements of the same k position together
// (A: a0/a2 row g, a1/a3 row g + 8, k pairs {2q, 2q + 1} and {2q + 8, 2q + 9}; B: b0/b1 the same
// k pairs of column g). C: c0/c1 row g, tokens 2q, 2q + 1; c2/c3 row g + 8.
//
// Block: GEMV_MMA_WARPS warps on M 16-row tiles, warp j taking every GEMV_MMA_WARPS-th 32-input
// chunk from chunk j (so the block reads each row 1 KB a round; a warp per tile, reading its rows
// 128 bytes a round, kept too many rows open at once); the warps' sums
// are added in a fixed order. k % 32 == 0. NB column tiles of 8 tokens: NB = 2 takes up to
// GEMV_MMA_MAX_T tokens, each weight fragment serving both tiles' MMAs (a decode batch of 9 to 16
// sequences then reads every weight once, where cuBLASLt's GEMMs read them at a fraction of the
// bandwidth).
template <int M, int NB> __device__ void gemv_mma(void* y, int ld, bool f32_out, const bf16* x, const WeightDesc& w, int n, int t, int block) {
    constexpr int U = 4 / M;  // chunks a lane loads before it computes: 8 x 16 bytes in flight
    constexpr int STEP = GEMV_MMA_WARPS * U;
    __shared__ float part[GEMV_MMA_WARPS][M][NB][4][32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    int r0 = block * 16 * M;
    const bf16* rows[M][2];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) rows[m][h] = (const bf16*)w.data + (long long)min(r0 + 16 * m + 8 * h + g, n - 1) * w.k + 8 * q;
    const bf16* xrow[NB];
#pragma unroll
    for (int nb = 0; nb < NB; nb++) xrow[nb] = x + (long long)min(8 * nb + g, t - 1) * w.k + 8 * q;
    float acc[M][NB][4];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][nb][i] = 0.0f;
    int nc = w.k / 32;
    uint4 wv[U][M][2];
    auto load_round = [&](int c0) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int m = 0; m < M; m++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    if (c0 + GEMV_MMA_WARPS * u < nc) wv[u][m][h] = ld_stream(rows[m][h] + (c0 + GEMV_MMA_WARPS * u) * 32);
    };
    // The first round of weights is in flight before the previous kernel (which writes x) ends.
    load_round(warp);
    grid_dep_wait();
    for (int c0 = warp; c0 < nc; c0 += STEP) {
        if (c0 != warp) load_round(c0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + GEMV_MMA_WARPS * u;
            if (c >= nc) break;
            uint4 xv[NB];
#pragma unroll
            for (int nb = 0; nb < NB; nb++) xv[nb] = 8 * nb + g < t ? *(const uint4*)(xrow[nb] + c * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int m = 0; m < M; m++) {
                const uint4 &lo = wv[u][m][0], &hi = wv[u][m][1];
                unsigned a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    mma_bf16(acc[m][nb], a0, xv[nb].x, xv[nb].y);
                    mma_bf16(acc[m][nb], a1, xv[nb].z, xv[nb].w);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int i = 0; i < 4; i++) part[warp][m][nb][i][lane] = acc[m][nb][i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < GEMV_MMA_WARPS; j++) sum += part[j][m][nb][i][lane];
                int row = r0 + 16 * m + g + 8 * (i >> 1), tok = 8 * nb + 2 * q + (i & 1);
                if (row < n && tok < t) store_y(y, f32_out, (long long)tok * ld + row, sum);
            }
}

template <int M, int NB> __device__ void gemv_mma_parts(const GemvParts& p, const bf16* x, int t) {
    grid_dep_trigger();
    int part = part_of(p);
    gemv_mma<M, NB>((void*)p.y[part], p.ld[part], p.f32_out, x, p.w[part], p.n[part], t, blockIdx.x - p.first_block[part]);
}

// One 16-row tile per block, or two (layers of many rows: each input chunk then serves 32 rows);
// up to 8 tokens, or (_t16) up to GEMV_MMA_MAX_T.
extern "C" __global__ void gemv_bf16_mma1(GemvParts p, const bf16* x, int t) { gemv_mma_parts<1, 1>(p, x, t); }
extern "C" __global__ void gemv_bf16_mma2(GemvParts p, const bf16* x, int t) { gemv_mma_parts<2, 1>(p, x, t); }
extern "C" __global__ void gemv_bf16_mma1_t16(GemvParts p, const bf16* x, int t) { gemv_mma_parts<1, 2>(p, x, t); }
extern "C" __global__ void gemv_bf16_mma2_t16(GemvParts p, const bf16* x, int t) { gemv_mma_parts<2, 2>(p, x, t); }

// Up to GEMV_MAX_T tokens; the _t1 and _t2 kernels take one and two tokens with as many
// accumulators per row (_t1: 60 registers a thread instead of 84), so more blocks, and more loads,
// are resident per SM at batch 1 and in a verification of one draft.
extern "C" __global__ void gemv_bf16(GemvParts p, const bf16* x, int t) { gemv_parts<GEMV_MAX_T>(p, x, t); }
extern "C" __global__ void gemv_bf16_t1(GemvParts p, const bf16* x, int t) { gemv_parts<1>(p, x, t); }
extern "C" __global__ void gemv_bf16_t2(GemvParts p, const bf16* x, int t) { gemv_parts<2>(p, x, t); }

// ---------------------------------------------------------------------------------------------
// NVFP4 linear layers for 1..GEMV_MMA_MAX_T tokens on tensor cores. On CUDA cores each code cost a
// conversion and an FMA per token, which made these layers issue-bound at a fraction of the
// bandwidth their quarter of the bytes allows; here a lane's 16 bytes of a tile (nvfp4.cuh) are
// one A fragment of 16 rows for each of 4 k steps, decoded in registers, and the tokens are the
// MMA's 8 (NB = 2: 16) columns, so the arithmetic per byte does not grow with the tokens.
//
// Block: blockDim.x / 32 = W warps (vt-cuda gives a row about GEMV_NV4_TILES tiles a warp, up to
// GEMV_NV4_MAX_WARPS warps) on one 16-row block, warp j taking the k tiles j, j + W, ...,
// GEMV_NV4_TILES at a time, so that a row block's tiles are in flight at once: at batch 1 these
// layers are bound by the latency of their loads, and a block of 4 warps streaming k = 4096 in
// rounds left too few bytes in flight. Each tile's B fragments are loaded with it (an MMA waiting
// on its own input load serialised a round trip per k step; one token's come from shared memory,
// where each warp stages its round's tiles of x as B fragments: nv4_stage_round). The warps' sums
// are added in a fixed order. Lane (g, c)'s B fragment is token 8 nb + g's inputs 2c, 2c + 1 and
// 2c + 8, 2c + 9 of the step (columns past t repeat the last token); C: c0/c1 row g, tokens
// 8 nb + 2c, 2c + 1; c2/c3 row g + 8.
template <int NB, bool COL0> __device__ void gemv_nv4(void* y, int ld, bool f32_out, const bf16* x, const WeightDesc& w, int n, int t, int block) {
    constexpr int U = GEMV_NV4_TILES;
    __shared__ float part[GEMV_NV4_MAX_WARPS][NB][4][32];
    extern __shared__ uint4 nv4_x[];  // COL0: the token's x as staged B fragments
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3, W = blockDim.x >> 5;
    int kt_n = nv4_k_tiles(w);
    long long tile0 = (long long)block * kt_n;
    // Columns past t read the last token again: their sums are never stored.
    const bf16* xrow[NB];
#pragma unroll
    for (int nb = 0; nb < NB; nb++) xrow[nb] = x + (long long)min(8 * nb + g, t - 1) * w.k + 2 * c;
    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nb][i] = 0.0f;
    uint4 q[U];
    uint2 sc[U];
    unsigned xb[U][NB][4][2];
    auto load_round = [&](int kt0) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kt0 + W * u < kt_n) nv4_load(w, tile0 + kt0 + W * u, lane, q[u], sc[u]);
    };
    // The first round of weights is in flight before the previous kernel (which writes x) ends.
    load_round(warp);
    grid_dep_wait();
    for (int kt0 = warp; kt0 < kt_n; kt0 += W * U) {
        if (kt0 != warp) load_round(kt0);
        if constexpr (COL0) {
            nv4_stage_x<U>(nv4_x, x, w.k, kt_n, kt0, W);
        } else {
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
                    if (kt0 + W * u < kt_n) nv4_x_frags(xrow[nb], (kt0 + W * u) * NV4_K, w.k, xb[u][nb]);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int kt = kt0 + W * u;
            if (kt >= kt_n) break;
            if constexpr (COL0) {
                uint4 f[2];
                nv4_staged_tile(nv4_x, kt, c, f);
                nv4_tile_mma<1, true>(acc, q[u], sc[u], [&](int, int s, unsigned& b0, unsigned& b1) { nv4_staged_b(f, s, b0, b1); });
            } else {
                nv4_tile_mma<NB, false>(acc, q[u], sc[u], [&](int nb, int s, unsigned& b0, unsigned& b1) {
                    b0 = xb[u][nb][s][0];
                    b1 = xb[u][nb][s][1];
                });
            }
        }
    }
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) part[warp][nb][i][lane] = acc[nb][i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float sum = 0.0f;
            for (int j = 0; j < W; j++) sum += part[j][nb][i][lane];
            int row = NV4_ROWS * block + g + 8 * (i >> 1), tok = 8 * nb + 2 * c + (i & 1);
            if (row < n && tok < t) store_y(y, f32_out, (long long)tok * ld + row, sum * w.global[0]);
        }
}

template <int NB, bool COL0> __device__ void gemv_nv4_parts(const GemvParts& p, const bf16* x, int t) {
    grid_dep_trigger();
    int part = part_of(p);
    gemv_nv4<NB, COL0>((void*)p.y[part], p.ld[part], p.f32_out, x, p.w[part], p.n[part], t, blockIdx.x - p.first_block[part]);
}

// One token (_t1: the MMA's column 0 alone), up to 8 tokens, or (_t16) up to GEMV_MMA_MAX_T;
// blocks of up to GEMV_NV4_MAX_WARPS warps.
extern "C" __global__ void __launch_bounds__(32 * GEMV_NV4_MAX_WARPS) gemv_nvfp4_t1(GemvParts p, const bf16* x, int t) { gemv_nv4_parts<1, true>(p, x, t); }
extern "C" __global__ void __launch_bounds__(32 * GEMV_NV4_MAX_WARPS) gemv_nvfp4(GemvParts p, const bf16* x, int t) { gemv_nv4_parts<1, false>(p, x, t); }
extern "C" __global__ void __launch_bounds__(32 * GEMV_NV4_MAX_WARPS) gemv_nvfp4_t16(GemvParts p, const bf16* x, int t) { gemv_nv4_parts<2, false>(p, x, t); }

// ---------------------------------------------------------------------------------------------
// NVFP4 for one token with a block's weights in shared memory (_t1s). A block takes `per` (p.ks)
// consecutive row blocks of its part, whose tiles are one contiguous span of the tiled layout,
// and copies all of them to shared memory before its grid_dep_wait, while earlier kernels still
// run. gemv_nvfp4_t1's block per row block runs a 12288-row layer in waves (its blocks are not
// all resident at once), each wave a round trip to memory; here every SM has its whole share in
// flight from its block's start. The W warps take each row block's k tiles in turn; their sums
// are added in a fixed order. Dynamic shared memory (vt-cuda: gemv.rs's t1s_shared): per row
// block kt_n * (NV4_CODE_BYTES + NV4_SCALE_BYTES) bytes, then x as staged B fragments (kt_n *
// 128 bytes).
extern "C" __global__ void __launch_bounds__(32 * GEMV_NV4S_WARPS) gemv_nvfp4_t1s(GemvParts p, const bf16* x, int t) {
    constexpr int W = GEMV_NV4S_WARPS, U = 4;
    extern __shared__ uint4 t1s[];
    __shared__ float part[GEMV_NV4S_MAX_PER][W][NV4_ROWS];
    grid_dep_trigger();
    int pi = part_of(p);
    const WeightDesc& w = p.w[pi];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int kt_n = nv4_k_tiles(w), per = p.ks, n = p.n[pi];
    int rb0 = (blockIdx.x - p.first_block[pi]) * per, rbs = min(per, (n + NV4_ROWS - 1) / NV4_ROWS - rb0);
    uint4* codes = t1s;
    uint4* scales = codes + per * kt_n * (NV4_CODE_BYTES / 16);
    uint4* xs = scales + per * kt_n * (NV4_SCALE_BYTES / 16);
    const uint4* code_src = (const uint4*)((const unsigned char*)w.data + (long long)rb0 * kt_n * NV4_CODE_BYTES);
    const uint4* scale_src = (const uint4*)((const unsigned char*)w.scales + (long long)rb0 * kt_n * NV4_SCALE_BYTES);
    cp_async_block(codes, code_src, rbs * kt_n * (NV4_CODE_BYTES / 16));
    cp_async_block(scales, scale_src, rbs * kt_n * (NV4_SCALE_BYTES / 16));
    cp_async_commit();
    grid_dep_wait();
    for (int kt0 = warp; kt0 < kt_n; kt0 += W * U)
        nv4_stage_x<U>(xs, x, w.k, kt_n, kt0, W);
    cp_async_wait<0>();
    __syncthreads();  // every warp's staged x and every thread's copies
    // Two tiles at a time, each into its own accumulators: two independent chains of decodes
    // and MMAs per warp (a row block of 2048 inputs is 2 tiles a warp).
    for (int r = 0; r < rbs; r++) {
        float acc[2][1][4] = {};
        for (int kt0 = warp; kt0 < kt_n; kt0 += 2 * W) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int kt = kt0 + W * h, tile = r * kt_n + kt;
                if (kt >= kt_n) break;
                uint4 f[2];
                nv4_staged_tile(xs, kt, c, f);
                nv4_tile_mma<1, true>(acc[h], codes[tile * (NV4_CODE_BYTES / 16) + lane],
                                      ((const uint2*)scales)[tile * (NV4_SCALE_BYTES / 8) + (lane >> 2)],
                                      [&](int, int s, unsigned& b0, unsigned& b1) { nv4_staged_b(f, s, b0, b1); });
            }
        }
        if (c == 0) {
            part[r][warp][g] = acc[0][0][0] + acc[1][0][0];
            part[r][warp][g + 8] = acc[0][0][2] + acc[1][0][2];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rbs * NV4_ROWS; e += blockDim.x) {
        int r = e / NV4_ROWS, row = NV4_ROWS * (rb0 + r) + e % NV4_ROWS;
        float sum = 0.0f;
        for (int j = 0; j < W; j++) sum += part[r][j][e % NV4_ROWS];
        if (row < n) store_y((void*)p.y[pi], p.f32_out, row, sum * w.global[0]);
    }
}
