// The routed-experts block for many tokens (prefill), all on the device with no host sync:
//   1. moe_prefill_route: top-k from f32 router logits (one warp per token), counts per expert;
//   2. moe_prefill_plan: per-expert offsets and the list of row tiles (expert, first row): 64
//      rows for the bf16 GEMMs below, 128 for the NVFP4 ones (w4a16.cu);
//   3. moe_prefill_scatter: every (token, choice) slot gets a row in expert-sorted order;
//   4. moe_gemm_gate_up / moe_gemm_down: grouped bf16 tensor-core GEMMs over the layer's expert
//      table (moe.rs: gate, up, down of expert e at 3e, 3e + 1, 3e + 2), SwiGLU fused into the
//      first, which reads gate row u and up row u as its rows 2u, 2u + 1;
//   5. moe_prefill_combine: weighted sum per token in ascending expert order, as vt-cpu does.
// Rows of one expert land in arbitrary order within its range (atomics), but each row's result
// depends only on its own inputs, so the output is deterministic.

#include "route.cuh"

// GEMM tiles: MP_BM slots (the NVFP4 kernels take 128: w4a16.cu) x MP_BN weight rows, MP_BK
// inputs per pipeline stage, MP_STAGES stages (3 * (64 + 128) * 64 bf16 = 72 KiB of dynamic shared
// memory), MP_THREADS threads (2 x 2 warps of 32 x 64).
#define MP_CPR (MP_BK / 8)  // 16-byte chunks per tile row

// One warp per token (route_warp): ids / weights [t, top_k] in rank order; counts[e] += the tokens
// that chose e. Block: 256 threads (8 tokens).
extern "C" __global__ void moe_prefill_route(int* ids, float* weights, int* counts, const float* logits, int t, RouteArgs ra) {
    int tok = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (tok >= t) return;
    const float* lg = logits + (long long)tok * ra.n_exp;
    // Each logit is read once (twice for a sigmoid's winners), through L2 only.
    Choice c = route_warp([&](int e) { return __ldcg(lg + e); }, ra);
    if (lane < ra.top_k) {
        ids[(long long)tok * ra.top_k + lane] = c.id;
        weights[(long long)tok * ra.top_k + lane] = c.w;
        atomicAdd(&counts[c.id], 1);
    }
}

// One block of 256 threads (thread i owns experts 2i, 2i + 1; n_exp <= 512). offsets[e] = first
// sorted row of expert e; tiles[2i], tiles[2i + 1] = expert and first row of tile i (tile_rows
// rows each, the last of an expert partial); *n_tiles. Rows and tiles are laid out in ascending
// expert order by a block-wide exclusive scan.
extern "C" __global__ void moe_prefill_plan(int* offsets, int* tiles, int* n_tiles, const int* counts, int n_exp, int tile_rows) {
    __shared__ int warp_rows[8], warp_tiles[8];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int c[2], rows = 0, nt = 0;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int e = 2 * tid + j;
        c[j] = e < n_exp ? counts[e] : 0;
        rows += c[j];
        nt += (c[j] + tile_rows - 1) / tile_rows;
    }
    int rows_inc = rows, tiles_inc = nt;  // inclusive scans over the warp's lanes
    for (int o = 1; o < 32; o <<= 1) {
        int r = __shfl_up_sync(0xffffffffu, rows_inc, o), t = __shfl_up_sync(0xffffffffu, tiles_inc, o);
        if (lane >= o) {
            rows_inc += r;
            tiles_inc += t;
        }
    }
    if (lane == 31) {
        warp_rows[warp] = rows_inc;
        warp_tiles[warp] = tiles_inc;
    }
    __syncthreads();
    for (int w = 0; w < warp; w++) {
        rows_inc += warp_rows[w];
        tiles_inc += warp_tiles[w];
    }
    if (tid == 255) *n_tiles = tiles_inc;
    int off = rows_inc - rows, first = tiles_inc - nt;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int e = 2 * tid + j;
        if (e >= n_exp) break;
        offsets[e] = off;
        for (int i = 0; i * tile_rows < c[j]; i++) {
            tiles[2 * (first + i)] = e;
            tiles[2 * (first + i) + 1] = off + i * tile_rows;
        }
        off += c[j];
        first += (c[j] + tile_rows - 1) / tile_rows;
    }
}

// Slot s (token s / top_k) gets sorted row pos in its expert's range; fill[] starts at zero.
extern "C" __global__ void moe_prefill_scatter(int* sorted_tok, int* slot_pos, int* fill, const int* ids, const int* offsets, int slots, int top_k) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= slots) return;
    int e = ids[s];
    int pos = offsets[e] + atomicAdd(&fill[e], 1);
    sorted_tok[pos] = s / top_k;
    slot_pos[s] = pos;
}

// XOR key of tile row r: consecutive 8 * 16 bytes of the rows one ldmatrix reads (8 rows of 16
// bytes at one column) then cover all banks. Rows 8 apart share it.
__device__ __forceinline__ int mp_key(int r) { return (r / (8 / MP_CPR)) % MP_CPR; }

// Shared-memory byte offset of 16-byte chunk `ch` of row `r` in a [rows][MP_BK] tile.
__device__ __forceinline__ unsigned mp_swz(int r, int ch) { return r * MP_BK * 2 + ((ch ^ mp_key(r)) << 4); }

// C = A W^T over one tile of MP_BM sorted rows (all of one expert) and MP_BN weight rows.
// GATE_UP: A rows are token rows of `a` gathered through a_rows, and W is [2 * inter, k] with
// rows 2u, 2u + 1 the expert's gate and up row u; otherwise A rows are consecutive and W is the
// expert's down projection. MP_THREADS threads: 2 x 2 warps of 32 x 64. k % 8 == 0.
// Hands the accumulators (warp tile [mi][nj][4]) and the tile's geometry to `epilogue`.
template <bool GATE_UP, typename Epi>
__device__ __forceinline__ void grouped_gemm(const bf16* a, const int* a_rows, const WeightDesc* table, const int* tiles,
                                             const int* n_tiles, const int* counts, const int* offsets, int n, int k, Epi epilogue) {
    constexpr unsigned A_STAGE = MP_BM * MP_BK * 2, B_STAGE = MP_BN * MP_BK * 2;  // bytes
    constexpr int RSTEP = MP_THREADS / MP_CPR;  // rows one pass of the block's copies covers
    extern __shared__ __align__(16) bf16 mp_sh[];
    int tile = blockIdx.y;
    if (tile >= *n_tiles) return;
    int e = tiles[2 * tile], row0 = tiles[2 * tile + 1];
    int rows = min(MP_BM, offsets[e] + counts[e] - row0);
    const WeightDesc* w = table + 3 * e;
    int n0 = blockIdx.x * MP_BN;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp & 1, wn = warp >> 1;
    // 32-bit shared addresses (what cp.async and ldmatrix take).
    const unsigned sa = smem_addr(mp_sh), sb = sa + MP_STAGES * A_STAGE;

    // This thread's copies: chunk tid % MP_CPR of rows tid / MP_CPR + RSTEP i, which share one
    // swizzle (RSTEP is a multiple of 8).
    const int ch = tid % MP_CPR, r0 = tid / MP_CPR;
    const unsigned cdst = mp_swz(r0, ch);
    const bf16* a_src[MP_BM / RSTEP];
    bool a_ok[MP_BM / RSTEP];
#pragma unroll
    for (int i = 0; i < MP_BM / RSTEP; i++) {
        int r = r0 + RSTEP * i;
        a_ok[i] = r < rows;
        long long src_row = a_ok[i] ? (GATE_UP ? a_rows[row0 + r] : row0 + r) : 0;
        a_src[i] = a + src_row * k + ch * 8;
    }
    const bf16* b_src[MP_BN / RSTEP];
    bool b_ok[MP_BN / RSTEP];
#pragma unroll
    for (int i = 0; i < MP_BN / RSTEP; i++) {
        int wr = n0 + r0 + RSTEP * i;
        b_ok[i] = wr < n;
        const WeightDesc& d = GATE_UP ? w[wr & 1] : w[2];
        b_src[i] = (const bf16*)d.data + (b_ok[i] ? (long long)(GATE_UP ? wr >> 1 : wr) * k + ch * 8 : 0);
    }
    auto load = [&](int stage, int kt) {
        int k0 = kt * MP_BK;
        bool in_k = k0 + ch * 8 < k;
#pragma unroll
        for (int i = 0; i < MP_BM / RSTEP; i++)
            cp_async16(sa + stage * A_STAGE + cdst + i * RSTEP * MP_BK * 2, a_src[i] + (in_k ? k0 : 0), a_ok[i] && in_k);
#pragma unroll
        for (int i = 0; i < MP_BN / RSTEP; i++) {
            bool ok = b_ok[i] && in_k;
            cp_async16(sb + stage * B_STAGE + cdst + i * RSTEP * MP_BK * 2, b_src[i] + (ok ? k0 : 0), ok);
        }
    };

    // ldmatrix row addresses for the k-steps ks of a stage. Every row a lane addresses has the key
    // of row lane % 8, so tiles mi / nb further are immediates. A: rows wm * 32 + lane % 16,
    // chunk 2 ks + lane / 16; B: rows wn * 64 + lane % 8 + 8 (lane / 16), chunk 2 ks + lane / 8 % 2.
    unsigned a_ld[MP_BK / 16], b_ld[MP_BK / 16];
#pragma unroll
    for (int ks = 0; ks < MP_BK / 16; ks++) {
        int key = mp_key(lane & 7);
        a_ld[ks] = sa + (wm * 32 + (lane & 15)) * MP_BK * 2 + (((2 * ks + (lane >> 4)) ^ key) << 4);
        b_ld[ks] = sb + (wn * 64 + (lane & 7) + ((lane >> 4) << 3)) * MP_BK * 2 + (((2 * ks + ((lane >> 3) & 1)) ^ key) << 4);
    }

    float acc[2][8][4];
    for (int mi = 0; mi < 2; mi++)
        for (int nj = 0; nj < 8; nj++)
            for (int x = 0; x < 4; x++) acc[mi][nj][x] = 0.0f;

    // An expert's last tile is often short: 16-row slices past `rows` skip their products.
    bool live[2] = {wm * 32 < rows, wm * 32 + 16 < rows};
    cp_async_pipeline<MP_STAGES>((k + MP_BK - 1) / MP_BK, load, [&](int stage) {
        if (!live[0]) return;
#pragma unroll
        for (int ks = 0; ks < MP_BK / 16; ks++) {
            unsigned af[2][4], bfr[8][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                if (live[mi]) ldsm_x4(af[mi], a_ld[ks] + stage * A_STAGE + mi * 16 * MP_BK * 2);
#pragma unroll
            for (int nb = 0; nb < 4; nb++) {
                unsigned q[4];
                ldsm_x4(q, b_ld[ks] + stage * B_STAGE + nb * 16 * MP_BK * 2);
                bfr[2 * nb][0] = q[0];
                bfr[2 * nb][1] = q[1];
                bfr[2 * nb + 1][0] = q[2];
                bfr[2 * nb + 1][1] = q[3];
            }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                if (live[mi])
#pragma unroll
                    for (int nj = 0; nj < 8; nj++) mma_bf16(acc[mi][nj], af[mi], bfr[nj][0], bfr[nj][1]);
        }
    });

    int g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int nj = 0; nj < 8; nj++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                int r = wm * 32 + mi * 16 + g + 8 * half, col = n0 + wn * 64 + nj * 8 + c2;
                if (r < rows && col < n) epilogue(row0 + r, col, acc[mi][nj][2 * half], acc[mi][nj][2 * half + 1]);
            }
}

// act[pos, u] = silu(gate_u . x) * (up_u . x) in bf16 for every sorted slot: gate row u and up row
// u, as rows 2u, 2u + 1 of the tile, are adjacent columns of one thread's accumulators.
// Grid: (ceil(2 * inter / MP_BN), max tiles), MP_THREADS threads, 72 KiB dynamic shared memory: the
// column tiles of one row tile run side by side, so its rows and its expert's weights are read
// from L2 while they are hot.
extern "C" __global__ void __launch_bounds__(MP_THREADS) moe_gemm_gate_up(bf16* act, const bf16* x, const int* sorted_tok, const WeightDesc* table, const int* tiles,
                                            const int* n_tiles, const int* counts, const int* offsets, int inter, int hidden) {
    grouped_gemm<true>(x, sorted_tok, table, tiles, n_tiles, counts, offsets, 2 * inter, hidden,
                       [&](int pos, int col, float gate, float up) { act[(long long)pos * inter + col / 2] = f2bf(silu(gate) * up); });
}

// y[pos, :] = down(act[pos]), rounded to bf16 (as a bf16 model's expert outputs are: half the
// bytes of f32 for this kernel to write and the combine to read, at one more rounding of each
// term, u/2 of its size). Grid: (ceil(hidden / MP_BN), max tiles), as above. hidden % 8 == 0: a
// pair's column is even and both fit.
extern "C" __global__ void __launch_bounds__(MP_THREADS) moe_gemm_down(bf16* y, const bf16* act, const WeightDesc* table, const int* tiles, const int* n_tiles,
                                         const int* counts, const int* offsets, int inter, int hidden) {
    grouped_gemm<false>(act, nullptr, table, tiles, n_tiles, counts, offsets, hidden, inter, [&](int pos, int col, float v0, float v1) {
        *(unsigned*)(y + (long long)pos * hidden + col) = pack_bf16(v0, v1);
    });
}

// out[tok] = sum over its choices, in ascending expert order, of weight * y[slot_pos]. One block
// per token, 4 features per thread (hidden % 4 == 0: 8-byte loads of y's bf16 rows). A token's
// experts are distinct, so choice i's place in that order is the number of its experts below
// expert i.
extern "C" __global__ void moe_prefill_combine(bf16* out, const bf16* y, const int* slot_pos, const int* ids, const float* weights, int top_k, int hidden) {
    __shared__ long long row[32];  // y offset of each choice, in ascending expert order
    __shared__ float wt[32];
    long long tok = blockIdx.x;
    const int* id = ids + tok * top_k;
    if (threadIdx.x < top_k) {
        int i = threadIdx.x, rank = 0;
        for (int j = 0; j < top_k; j++) rank += id[j] < id[i];
        row[rank] = (long long)slot_pos[tok * top_k + i] * hidden;
        wt[rank] = weights[tok * top_k + i];
    }
    __syncthreads();
    for (int c = threadIdx.x * 4; c < hidden; c += blockDim.x * 4) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
        for (int n = 0; n < top_k; n++) {
            uint2 v = *(const uint2*)(y + row[n] + c);
            float v0, v1, v2, v3;
            bf16x2(v.x, v0, v1);
            bf16x2(v.y, v2, v3);
            acc.x += wt[n] * v0;
            acc.y += wt[n] * v1;
            acc.z += wt[n] * v2;
            acc.w += wt[n] * v3;
        }
        *(uint2*)(out + tok * hidden + c) = make_uint2(pack_bf16(acc.x, acc.y), pack_bf16(acc.z, acc.w));
    }
}
