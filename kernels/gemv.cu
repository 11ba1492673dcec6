// Decode-time matrix-vector kernels: a few tokens against weights that are read once, 16 bytes per
// lane per load, several loads in flight per lane before any arithmetic (decode is bound by the
// latency of those loads, not by FLOPs). Weights are bf16 (8 per chunk) or NVFP4 W4A16 (32 e2m1
// codes per chunk, decoded in registers: Hopper has no fp4 MMA, and decode needs none).
//
// - gemv_bf16 / gemv_nvfp4: dense linear layers for t <= GEMV_MAX_T tokens, up to GEMV_MAX_PARTS
//   weights that share the input in one launch (a mixer's projections; a MoE block's router and
//   shared-expert gate, as f32 logits); gemv_bf16_mma*: the same for bf16 from 3 tokens, on
//   tensor cores.
// - moe_dec_route, moe_dec_gate_up_*, moe_dec_down_*: the rest of a MoE block for a few tokens,
//   three launches after its logits: routing (a block per token); fused SwiGLU of every chosen
//   expert and the shared expert; down projections + weighted combine.
//   No host synchronisation: expert ids never leave the device; the expert table is the
//   MoeExperts' resident WeightDesc array (gate, up, down of expert e at 3e, 3e + 1, 3e + 2).

#define GEMV_MAX_T 8
#define GEMV_MAX_PARTS 4
// Rows per warp in gemv_*: each x chunk loaded is used GEMV_ROWS times.
#define GEMV_ROWS 2
// Chunks each lane loads before it computes.
#define CHUNKS 4

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
template <bool FP4, int MAXT> __device__ void gemv(void* y, int ld, bool f32_out, const bf16* x, const WeightDesc& w, int n, int t, int block, int ks) {
    typedef Fmt<FP4> F;
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
    unsigned s[CHUNKS][GEMV_ROWS];
    auto load_round = [&](int c0) {
#pragma unroll
        for (int u = 0; u < CHUNKS; u++)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++)
                if (c0 + step * u < nc) F::load(w, rows[r], c0 + step * u, v[u][r], s[u][r]);
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
                load_xchunk<FP4>(x + (long long)i * w.k, c0 + step * u, xf);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; r++) acc[i][r] += F::dot(v[u][r], s[u][r], xf);
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
                if (lane == 0 && r0 + r < n) store_y(y, f32_out, (long long)i * ld + r0 + r, sum * F::scale(w));
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
        if (r0 + r < n) store_y(y, f32_out, (long long)i * ld + r0 + r, sum * F::scale(w));
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

template <bool FP4, int MAXT> __device__ void gemv_parts(const GemvParts& p, const bf16* x, int t) {
    grid_dep_trigger();
    int part = part_of(p);
    gemv<FP4, MAXT>((void*)p.y[part], p.ld[part], p.f32_out, x, p.w[part], p.n[part], t, blockIdx.x - p.first_block[part], p.ks);
}

// ---------------------------------------------------------------------------------------------
// bf16 linear layers for 3..GEMV_MAX_T tokens (vt-cuda's MMA_MIN_T) on tensor cores. On CUDA
// cores each 16-byte weight chunk costs 8 FMAs and a conversion of the chunk's inputs per token,
// which made these layers issue-bound (H200, 8192 x 2048: 10.2 us for one token, 19.0 for four,
// 31.3 for eight); an m16n8k16 MMA takes 16 rows x 16 inputs x all 8 token columns at once
// (13.4 to 13.7 us for 2 to 8 tokens).
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
// 128 bytes a round, kept so many rows open that a lm_head took 1.5x as long); the warps' sums
// are added in a fixed order. k % 32 == 0. NB column tiles of 8 tokens: NB = 2 takes up to
// GEMV_MMA_MAX_T tokens, each weight fragment serving both tiles' MMAs (a decode batch of 9 to 16
// sequences then reads every weight once, where cuBLASLt's GEMMs ran at 1/3 to 1/2 of the bytes
// rate, H200).
#define GEMV_MMA_WARPS 8
#define GEMV_MMA_MAX_T 16
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

// Up to GEMV_MAX_T tokens; the _t1 kernels take one token with a single accumulator per row: 60
// registers a thread instead of 84 for bf16 (113 instead of 177 for NVFP4), so more blocks, and
// more loads, are resident per SM at batch 1.
extern "C" __global__ void gemv_bf16(GemvParts p, const bf16* x, int t) { gemv_parts<false, GEMV_MAX_T>(p, x, t); }
extern "C" __global__ void gemv_nvfp4(GemvParts p, const bf16* x, int t) { gemv_parts<true, GEMV_MAX_T>(p, x, t); }
extern "C" __global__ void gemv_bf16_t1(GemvParts p, const bf16* x, int t) { gemv_parts<false, 1>(p, x, t); }
extern "C" __global__ void gemv_nvfp4_t1(GemvParts p, const bf16* x, int t) { gemv_parts<true, 1>(p, x, t); }

// ---------------------------------------------------------------------------------------------
// MoE block decode.

// The shared expert (vt-cuda's `SharedDesc`): `present` 0 when the block has none; `gated` 1 when
// it is scaled by sigmoid of the last logit column.
struct SharedDesc {
    WeightDesc gate, up, down;
    int present;
    int gated;
};

// Shared memory of route_token.
struct __align__(16) RouteScratch {
    float choice[ROUTE_MAX_EXP];
    float score[ROUTE_MAX_EXP];
    float top_score[ROUTE_MAX_K];
    int top_id[ROUTE_MAX_K];
    float red[32];
    // Each warp's first min(top_k, 32) experts: choice and id, by rank within the warp.
    float warp_choice[ROUTE_MAX_EXP / 32][ROUTE_MAX_K];
    int warp_id[ROUTE_MAX_EXP / 32][ROUTE_MAX_K];
};

// Whether choice a of expert i ranks ahead of choice b of expert j.
__device__ __forceinline__ bool ranks_ahead(float a, int i, float b, int j) { return a > b || (a == b && i < j); }

// Routing of one token by the whole block (one thread per expert: blockDim.x >= n_exp), as
// vt-cpu's `route`: an expert's choice rank counts the experts ahead of it (a higher choice value,
// or an equal one at a lower index); the normaliser sums the chosen scores in rank order. Writes
// the k choices in ascending expert order (the combine order) to ids/wts. n_exp <= ROUTE_MAX_EXP,
// top_k <= 32.
// The rank is counted in two steps: within the warp (shuffles), then, for the warp's first k,
// against the other warps' first k. That count is exact for every expert of rank < k: fewer than
// k experts are ahead of it, so those of any warp are among that warp's first k; an expert of rank
// >= k counts at least k (a warp with k ahead of it has all its first k ahead).
__device__ void route_token(const float* logits, const RouteArgs& ra, int* ids, float* wts, RouteScratch& rs) {
    int n = ra.n_exp;
    if (ra.kind == 0) {
        float m = __int_as_float(0xff800000);
        for (int e = threadIdx.x; e < n; e += blockDim.x) m = fmaxf(m, logits[e]);
        m = block_reduce<true>(m, rs.red);
        float sum = 0.0f;
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            float p = expf(logits[e] - m);
            rs.score[e] = p;
            sum += p;
        }
        sum = block_reduce<false>(sum, rs.red);
        for (int e = threadIdx.x; e < n; e += blockDim.x) rs.choice[e] = rs.score[e] = rs.score[e] / sum;
    } else {
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            float l = logits[e];
            if (ra.softcap > 0.0f) l = ra.softcap * tanhf(l / ra.softcap);
            rs.score[e] = sigmoidf(l);
            rs.choice[e] = rs.score[e] + (ra.bias ? ld((const void*)ra.bias, ra.bias_dt, e) : 0.0f);
        }
    }
    __syncthreads();
    // A NaN choice ranks last, so ranks stay a permutation and every chosen id is an expert; the
    // threads past n_exp rank after every expert.
    int e = threadIdx.x, warp = e >> 5, k = ra.top_k;
    float c = e < n ? rs.choice[e] : __int_as_float(0xff800000);
    if (isnan(c)) c = __int_as_float(0xff800000);
    int rank = 0;
#pragma unroll 8
    for (int o = 0; o < 32; o++) rank += ranks_ahead(__shfl_sync(0xffffffffu, c, o), (e & ~31) + o, c, e);
    if (rank < k) {
        rs.warp_choice[warp][rank] = c;
        rs.warp_id[warp][rank] = e;
    }
    __syncthreads();
    if (rank < k) {
        int kw = min(k, 32);
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
            if (w == warp) continue;
            for (int j = 0; j < kw; j++) rank += ranks_ahead(rs.warp_choice[w][j], rs.warp_id[w][j], c, e);
        }
        if (rank < k) {
            rs.top_id[rank] = e;
            rs.top_score[rank] = rs.score[e];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float norm = 0.0f;
        for (int r = 0; r < ra.top_k; r++) norm += rs.top_score[r];
        rs.red[0] = norm;
    }
    __syncthreads();
    if ((int)threadIdx.x < ra.top_k) {
        int id = rs.top_id[threadIdx.x], pos = 0;
        for (int r = 0; r < ra.top_k; r++) pos += rs.top_id[r] < id;
        ids[pos] = id;
        wts[pos] = rs.top_score[threadIdx.x] / (ra.renorm ? rs.red[0] : 1.0f) * (ra.kind == 1 ? ra.scaling : 1.0f);
    }
    __syncthreads();
}

// Routing of token blockIdx.x: slot_ids / slot_w [t, slots] get its chosen experts in ascending
// order, then -1 and the shared expert's multiplier when `slots` exceeds top_k. A thread per
// expert (128 to 512 threads).
extern "C" __global__ void moe_dec_route(int* slot_ids, float* slot_w, const float* logits, RouteArgs ra, int gated, int slots) {
    __shared__ RouteScratch rs;
    grid_dep_begin();
    int tok = blockIdx.x;
    const float* lg = logits + (long long)tok * (ra.n_exp + 1);
    route_token(lg, ra, slot_ids + tok * slots, slot_w + tok * slots, rs);
    if (threadIdx.x == 0 && slots > ra.top_k) {
        slot_ids[tok * slots + ra.top_k] = -1;
        slot_w[tok * slots + ra.top_k] = gated ? sigmoidf(lg[ra.n_exp]) : 1.0f;
    }
}

// Chunks of each row a gate/up lane has in flight before it computes, both rows of its unit at
// once. At Qwen3.5's hidden 2048: four rounds of 2 for bf16, whose 48 registers a thread let all
// 1152 blocks of the 8 + 1 slots be resident at once (10 a SM; rounds of 4 took 62 registers, 8
// blocks a SM: 27.5 against 26.6 µs a bf16 MoE layer, H200, same call), and one round for NVFP4
// (a row is 64 chunks).
#define MOE_CHUNKS_BF16 2
#define MOE_CHUNKS_NVFP4 2

// Dots of row `row` of the ROWS weights w[] with x's chunks [0, k / ELEMS) (f32 or bf16), by one
// warp; every lane gets the sums. With `wait`, the lanes execute grid_dep_wait once their first
// loads are in flight (x may come from the previous kernel).
template <bool FP4, int ROWS, typename X>
__device__ __forceinline__ void warp_dots(const WeightDesc* w, long long row, const X* x, bool wait, float* dots) {
    typedef Fmt<FP4> F;
    constexpr int CH = FP4 ? MOE_CHUNKS_NVFP4 : MOE_CHUNKS_BF16;
    int lane = threadIdx.x & 31, nc = w[0].k / F::ELEMS;
    float acc[ROWS] = {};
    for (int i0 = lane; i0 < nc; i0 += 32 * CH) {
        uint4 v[CH][ROWS];
        unsigned sc[CH][ROWS];
#pragma unroll
        for (int j = 0; j < CH; j++)
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                if (i0 + 32 * j < nc) F::load(w[r], row, i0 + 32 * j, v[j][r], sc[j][r]);
        if (wait) {
            grid_dep_wait();
            wait = false;
        }
#pragma unroll
        for (int j = 0; j < CH; j++) {
            if (i0 + 32 * j >= nc) break;
            float xf[F::ELEMS];
            load_xchunk<FP4>(x, i0 + 32 * j, xf);
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r] += F::dot(v[j][r], sc[j][r], xf);
        }
    }
    if (wait) grid_dep_wait();  // a lane with no chunks
#pragma unroll
    for (int r = 0; r < ROWS; r++) dots[r] = warp_sum(acc[r]) * F::scale(w[r]);
}

// act[slot, u] = silu(gate_u . x) * (up_u . x), f32, for every (token, slot) of slot_ids: an
// expert e (its gate and up at table[3e], table[3e + 1]) or -1, the shared expert. Grid:
// (t * slots, ceil(inter / 4)), 128 threads: warp j takes the gate and the up row of unit
// 4 * blockIdx.y + j. Each slot's first block also writes the slot's down matrix to down_desc, so
// that the down kernel reads it in one step instead of two dependent ones (ids, then the table).
template <bool FP4>
__device__ void moe_dec_gate_up(float* act, WeightDesc* down_desc, const int* slot_ids, const bf16* x, const WeightDesc* table,
                                const SharedDesc& sh, int slots, int inter) {
    int tok = blockIdx.x / slots, u = blockIdx.y * 4 + (threadIdx.x >> 5);
    // The shared expert's blocks (its slot is the last) know their rows without the routing: their
    // first round of weights is in flight before they wait, while the routing kernel runs.
    bool shared_slot = sh.present && blockIdx.x % slots == slots - 1;
    grid_dep_trigger();
    if (!shared_slot) grid_dep_wait();
    if (u >= inter) {
        if (shared_slot) grid_dep_wait();
        return;
    }
    int id = shared_slot ? -1 : slot_ids[blockIdx.x];
    WeightDesc w[2] = {id >= 0 ? table[3 * id] : sh.gate, id >= 0 ? table[3 * id + 1] : sh.up};
    // Written once this block has waited: a routed slot's now (it arrives with the gate and up
    // descriptors), the shared slot's after its dots.
    bool writes_down = blockIdx.y == 0 && threadIdx.x == 0;
    if (writes_down && !shared_slot) down_desc[blockIdx.x] = table[3 * id + 2];
    float d[2];
    warp_dots<FP4, 2>(w, u, x + (long long)tok * w[0].k, shared_slot, d);
    if ((threadIdx.x & 31) == 0) act[(long long)blockIdx.x * inter + u] = silu(d[0]) * d[1];
    if (writes_down && shared_slot) down_desc[blockIdx.x] = sh.down;
}

// The down kernel runs one resident wave (a grid of MOE_DEC_WAVE_* blocks per SM): each block
// takes an equal share of the output rows, a token at a time, and its warps stream them. An item's
// loads go in one round at Qwen3.5's shapes (a row of 8 + 1 slots of 512: 18 bf16 chunks per lane,
// or 4.5 NVFP4 chunks of each of 4 rows). Each block copies the slots' weight descriptors to
// shared memory and, meanwhile, each token's SwiGLU activations to dynamic shared memory, where
// every warp's chunk reads find them at once (read from global memory, each of those reads waited
// on a round trip to L2 between the weight loads and the arithmetic). NVFP4 decodes its chunks in
// registers (210 of them), so one block of it fits an SM without spilling.
// Slots of one launch: t <= MOE_DEC_MAX_T tokens of top_k + 1 (shared) slots at most (the logits
// of more than GEMV_MAX_T tokens come from the tensor-core GEMV, up to GEMV_MMA_MAX_T).
#define MOE_DEC_MAX_T 16
#define MOE_DEC_SLOTS (MOE_DEC_MAX_T * (ROUTE_MAX_K + 1))
#define MOE_DEC_THREADS 256
#define MOE_DEC_WAVE_BF16 2
#define MOE_DEC_WAVE_NVFP4 1

// out[i, r] = sum over token i's slots of slot_w * (down_slot[r] . act[slot]) (down_slot: the
// slot's down_desc, written by the gate/up kernel): a row's chunks run over the slots in order,
// lane l taking chunks l + 32 j. An item is R rows of one token (R = 4 for NVFP4; hidden % 4 == 0
// as NVFP4 gate/up rows are whole 32-code chunks). Dynamic shared memory: slots * inter floats.
template <bool FP4>
__device__ void moe_dec_down(bf16* out, const float* act, const WeightDesc* down_desc, const float* slot_w, int t, int slots,
                             int hidden, int inter) {
    typedef Fmt<FP4> F;
    constexpr int R = FP4 ? 4 : 1, J = FP4 ? 5 : 18;
    extern __shared__ float4 dyn[];
    float* as = (float*)dyn;
    __shared__ WeightDesc dn[MOE_DEC_SLOTS];
    __shared__ float mul[MOE_DEC_SLOTS];
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5, groups = hidden / R, nc = inter / F::ELEMS, total = slots * nc;
    // This block's share of the t * groups items, a token at a time; threads past the block's last
    // item still reach every barrier.
    int items = t * groups;
    int first = (int)((long long)blockIdx.x * items / gridDim.x), last = (int)((long long)(blockIdx.x + 1) * items / gridDim.x);
    // Token tok's activations into shared memory, every copy in flight at once (a load-then-store
    // loop waits on L2 once per iteration).
    auto stage = [&](int tok) {
        const float4* src = (const float4*)(act + (long long)tok * slots * inter);
        for (int i = threadIdx.x; i < slots * inter / 4; i += blockDim.x) cp_async16(smem_addr((float4*)as + i), src + i, true);
        cp_async_commit();
    };
    grid_dep_wait();
    // The first token's copy is in flight while the descriptors load. (Issuing each warp's first
    // weights before the copy instead made t = 4 slower: 83 against 72 µs a bf16 layer, H200.)
    stage(first / groups);
    for (int s = threadIdx.x; s < t * slots; s += blockDim.x) {
        dn[s] = down_desc[s];
        mul[s] = slot_w[s] * F::scale(dn[s]);
    }
    for (int tok = first / groups; tok * groups < last; tok++) {
        if (tok > first / groups) {
            __syncthreads();  // the previous token's activations are no longer read
            stage(tok);
        }
        cp_async_wait<0>();
        __syncthreads();  // the activations (and, the first time, dn and mul) are in shared memory
        const WeightDesc* d = dn + tok * slots;
        const float* m = mul + tok * slots;
        int hi = min(last, (tok + 1) * groups), item0 = max(first, tok * groups) + (threadIdx.x >> 5);
        for (int item = item0; item < hi; item += warps) {
            int r0 = (item % groups) * R;
            float acc[R] = {};
            for (int i0 = lane; i0 < total; i0 += 32 * J) {
                // Chunk i = i0 + 32 j is chunk c of slot sl (i / nc, i % nc), stepped along without
                // a division per chunk.
                uint4 v[J][R];
                unsigned sc[J][R];
                int sl = i0 / nc, c = i0 % nc;
#pragma unroll
                for (int j = 0; j < J; j++) {
                    if (i0 + 32 * j < total)
#pragma unroll
                        for (int r = 0; r < R; r++) F::load(d[sl], r0 + r, c, v[j][r], sc[j][r]);
                    for (c += 32; c >= nc; c -= nc) sl++;
                }
                sl = i0 / nc, c = i0 % nc;
#pragma unroll
                for (int j = 0; j < J; j++) {
                    int i = i0 + 32 * j;
                    if (i >= total) break;
                    // Chunk i of the row (chunk c of slot sl) meets element i * ELEMS of the staged slots.
                    const float* xf = as + i * F::ELEMS;
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r] += m[sl] * F::dot(v[j][r], sc[j][r], xf);
                    for (c += 32; c >= nc; c -= nc) sl++;
                }
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                float sum = warp_sum(acc[r]);
                if (lane == 0) out[(long long)tok * hidden + r0 + r] = f2bf(sum);
            }
        }
    }
}

extern "C" __global__ void moe_dec_gate_up_bf16(float* act, WeightDesc* down_desc, const int* slot_ids, const bf16* x, const WeightDesc* table,
                                                SharedDesc sh, int slots, int inter) {
    moe_dec_gate_up<false>(act, down_desc, slot_ids, x, table, sh, slots, inter);
}
extern "C" __global__ void moe_dec_gate_up_nvfp4(float* act, WeightDesc* down_desc, const int* slot_ids, const bf16* x, const WeightDesc* table,
                                                 SharedDesc sh, int slots, int inter) {
    moe_dec_gate_up<true>(act, down_desc, slot_ids, x, table, sh, slots, inter);
}
// One resident wave of down blocks (see moe_dec_down).
#define MOE_DEC_DOWN(wave) extern "C" __global__ void __launch_bounds__(MOE_DEC_THREADS, wave)
MOE_DEC_DOWN(MOE_DEC_WAVE_BF16) moe_dec_down_bf16(bf16* out, const float* act, const WeightDesc* down_desc, const float* slot_w, int t,
                                                  int slots, int hidden, int inter) {
    moe_dec_down<false>(out, act, down_desc, slot_w, t, slots, hidden, inter);
}
MOE_DEC_DOWN(MOE_DEC_WAVE_NVFP4) moe_dec_down_nvfp4(bf16* out, const float* act, const WeightDesc* down_desc, const float* slot_w, int t,
                                                   int slots, int hidden, int inter) {
    moe_dec_down<true>(out, act, down_desc, slot_w, t, slots, hidden, inter);
}
