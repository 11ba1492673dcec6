// The whole MoE block for the few tokens of a decode step, three launches after its logits (the
// router's and the shared-expert gate's rows, from gemv.cu's kernels as f32): routing (a block per
// token); fused SwiGLU of every chosen expert and the shared expert; down projections + weighted
// combine. No host synchronisation: expert ids never leave the device; the expert table is the
// MoeExperts' resident WeightDesc array (gate, up, down of expert e at 3e, 3e + 1, 3e + 2).

#include "route.cuh"
#include "weight_chunks.cuh"
#include "nvfp4.cuh"

// The shared expert (vt-cuda's `SharedDesc`): `present` 0 when the block has none; `gated` 1 when
// it is scaled by sigmoid of the last logit column.
struct SharedDesc {
    WeightDesc gate, up, down;
    int present;
    int gated;
};

// Routing of token blockIdx.x by the block (route_block: a thread per expert, 128 to 512):
// slot_ids / slot_w [t, slots] get its chosen experts in ascending order, then -1 and the shared
// expert's multiplier when `slots` exceeds top_k.
extern "C" __global__ void moe_dec_route(int* slot_ids, float* slot_w, const float* logits, RouteArgs ra, int gated, int slots) {
    __shared__ RouteScratch rs;
    grid_dep_begin();
    int tok = blockIdx.x;
    const float* lg = logits + (long long)tok * (ra.n_exp + 1);
    route_block(lg, ra, slot_ids + tok * slots, slot_w + tok * slots, rs);
    if (threadIdx.x == 0 && slots > ra.top_k) {
        slot_ids[tok * slots + ra.top_k] = -1;
        slot_w[tok * slots + ra.top_k] = gated ? sigmoidf(lg[ra.n_exp]) : 1.0f;
    }
}

// Chunks of each row a gate/up lane has in flight before it computes, both rows of its unit at
// once. At Qwen3.5's hidden 2048: four rounds of 2, whose 48 registers a thread let all 1152
// blocks of the 8 + 1 slots be resident at once (rounds of 4 took 62 registers, fewer blocks a
// SM, and were slower: docs/performance.md).
#define MOE_CHUNKS_BF16 2

// Dots of row `row` of the ROWS bf16 weights w[] with x's chunks [0, k / 8) (f32 or bf16), by one
// warp; every lane gets the sums. With `wait`, the lanes execute grid_dep_wait once their first
// loads are in flight (x may come from the previous kernel), and then trigger the next.
template <int ROWS, typename X>
__device__ __forceinline__ void warp_dots(const WeightDesc* w, long long row, const X* x, bool wait, float* dots) {
    typedef Bf16Chunks F;
    constexpr int CH = MOE_CHUNKS_BF16;
    int lane = threadIdx.x & 31, nc = w[0].k / F::ELEMS;
    float acc[ROWS] = {};
    for (int i0 = lane; i0 < nc; i0 += 32 * CH) {
        uint4 v[CH][ROWS];
#pragma unroll
        for (int j = 0; j < CH; j++)
#pragma unroll
            for (int r = 0; r < ROWS; r++)
                if (i0 + 32 * j < nc) F::load(w[r], row, i0 + 32 * j, v[j][r]);
        if (wait) {
            grid_dep_wait_then_trigger();
            wait = false;
        }
#pragma unroll
        for (int j = 0; j < CH; j++) {
            if (i0 + 32 * j >= nc) break;
            float xf[F::ELEMS];
            load_xchunk(x, i0 + 32 * j, xf);
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r] += F::dot(v[j][r], xf);
        }
    }
    if (wait) grid_dep_wait_then_trigger();  // a lane with no chunks
#pragma unroll
    for (int r = 0; r < ROWS; r++) dots[r] = warp_sum(acc[r]);
}

// act[slot, u] = silu(gate_u . x) * (up_u . x), f32, for every (token, slot) of slot_ids: an
// expert e (its gate and up at table[3e], table[3e + 1]) or -1, the shared expert. Grid:
// (t * slots, ceil(inter / MOE_DEC_GU_WARPS)) of MOE_DEC_GU_WARPS warps: warp j takes the gate and
// the up row of unit MOE_DEC_GU_WARPS * blockIdx.y + j. Every block triggers the down kernel only
// after its wait, so that the down kernel may read the routing before its own wait (common.cuh:
// grid_dep_wait_then_trigger).
__device__ void moe_dec_gate_up(float* act, const int* slot_ids, const bf16* x, const WeightDesc* table, const SharedDesc& sh, int slots,
                                int inter) {
    int tok = blockIdx.x / slots, u = blockIdx.y * MOE_DEC_GU_WARPS + (threadIdx.x >> 5);
    // The shared expert's blocks (its slot is the last) know their rows without the routing: their
    // first round of weights is in flight before they wait, while the routing kernel runs.
    bool shared_slot = sh.present && blockIdx.x % slots == slots - 1;
    if (!shared_slot || u >= inter) grid_dep_wait_then_trigger();
    if (u >= inter) return;
    int id = shared_slot ? -1 : slot_ids[blockIdx.x];
    WeightDesc w[2] = {id >= 0 ? table[3 * id] : sh.gate, id >= 0 ? table[3 * id + 1] : sh.up};
    float d[2];
    warp_dots<2>(w, u, x + (long long)tok * w[0].k, shared_slot, d);
    if ((threadIdx.x & 31) == 0) act[(long long)blockIdx.x * inter + u] = silu(d[0]) * d[1];
}

// The bf16 down kernel runs one resident wave (a grid of MOE_DEC_WAVE_BF16 blocks of
// MOE_DEC_THREADS per SM; its one-token instance MOE_DEC_T1_WAVE_BF16 of MOE_DEC_T1_THREADS): each
// block takes an equal share of the output rows, a token at a time, and its warps stream them, 9
// chunks a lane in flight (61 registers a thread), so an SM's 32 warps interleave their items'
// loads and arithmetic (at Qwen3.5's shapes a row of 8 + 1 slots of 512 is 18 chunks per lane:
// two rounds). The down kernels look up the slots' matrices before they wait for the gate/up
// kernel (the routing they read is the kernel's before it: moe_dec_gate_up); the NVFP4 ones also
// load their first round of weights then. The bf16 kernel copies each token's SwiGLU activations to
// dynamic shared memory, where every warp's chunk reads find them at once (read from global
// memory, each of those reads waited on a round trip to L2 between the weight loads and the
// arithmetic).
// Slots of one launch: t <= MOE_DEC_MAX_T tokens of top_k + 1 (shared) slots at most (the logits
// of more than GEMV_MAX_T tokens come from the tensor-core GEMV, up to GEMV_MMA_MAX_T).
#define MOE_DEC_SLOTS (MOE_DEC_MAX_T * (ROUTE_MAX_K + 1))
// Chunks of a down row a bf16 lane has in flight.
#define MOE_DEC_DOWN_CHUNKS 9

// Slot s's down matrix and multiplier (slot_ids and slot_w from the routing, read through L2
// before the down kernel waits; common.cuh: grid_dep_wait_then_trigger).
__device__ __forceinline__ void slot_down(const int* slot_ids, const float* slot_w, const WeightDesc* table, const SharedDesc& sh, int s,
                                          WeightDesc& dn, float& mul) {
    int id = __ldcg(slot_ids + s);
    dn = id >= 0 ? table[3 * id + 2] : sh.down;
    mul = __ldcg(slot_w + s);
}

// out[i, r] = sum over token i's slots of slot_w * (down_slot[r] . act[slot]): a row's chunks run
// over the slots in order, lane l taking chunks l + 32 j, J of them in flight. An item is a row
// of one token. Dynamic shared memory: slots * inter floats.
__device__ void moe_dec_down(bf16* out, const float* act, const int* slot_ids, const float* slot_w, const WeightDesc* table,
                             const SharedDesc& sh, int t, int slots, int hidden, int inter) {
    typedef Bf16Chunks F;
    constexpr int R = 1, J = MOE_DEC_DOWN_CHUNKS;
    extern __shared__ float4 dyn[];
    float* as = (float*)dyn;
    __shared__ WeightDesc dn[MOE_DEC_SLOTS];
    __shared__ float mul[MOE_DEC_SLOTS];
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5, groups = hidden / R, nc = inter / F::ELEMS, total = slots * nc;
    // This block's share of the t * groups items, a token at a time; threads past the block's last
    // item still reach every barrier.
    int items = t * groups;
    int first = (int)((long long)blockIdx.x * items / gridDim.x), last = (int)((long long)(blockIdx.x + 1) * items / gridDim.x);
    // Token tok's activations into shared memory.
    auto stage = [&](int tok) {
        cp_async_block(as, act + (long long)tok * slots * inter, slots * inter / 4);
        cp_async_commit();
    };
    // The slots' descriptors are looked up while the gate/up kernel ends (read after the loop's
    // first barrier). Issuing each warp's first weights before the wait as well, as the NVFP4
    // kernel does, made this loop slower from t = 4 on, and a model's step at one token
    // (docs/performance.md).
    for (int s = threadIdx.x; s < t * slots; s += blockDim.x) slot_down(slot_ids, slot_w, table, sh, s, dn[s], mul[s]);
    // The next kernel (the next layer's norm) launches once every block is here, not at the end.
    grid_dep_wait_then_trigger();
    stage(first / groups);
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
                int sl = i0 / nc, c = i0 % nc;
#pragma unroll
                for (int j = 0; j < J; j++) {
                    if (i0 + 32 * j < total)
#pragma unroll
                        for (int r = 0; r < R; r++) F::load(d[sl], r0 + r, c, v[j][r]);
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
                    for (int r = 0; r < R; r++) acc[r] += m[sl] * F::dot(v[j][r], xf);
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

extern "C" __global__ void moe_dec_gate_up_bf16(float* act, const int* slot_ids, const bf16* x, const WeightDesc* table, SharedDesc sh, int slots,
                                                int inter) {
    moe_dec_gate_up(act, slot_ids, x, table, sh, slots, inter);
}
// One resident wave of down blocks (see moe_dec_down), for several tokens.
extern "C" __global__ void __launch_bounds__(MOE_DEC_THREADS, MOE_DEC_WAVE_BF16)
    moe_dec_down_bf16(bf16* out, const float* act, const int* slot_ids, const float* slot_w, const WeightDesc* table, SharedDesc sh, int t, int slots,
                      int hidden, int inter) {
    moe_dec_down(out, act, slot_ids, slot_w, table, sh, t, slots, hidden, inter);
}
// The same for one token, in half as many blocks of twice the warps, which one token runs faster
// and several slower (docs/performance.md).
extern "C" __global__ void __launch_bounds__(MOE_DEC_T1_THREADS, MOE_DEC_T1_WAVE_BF16)
    moe_dec_down_bf16_t1(bf16* out, const float* act, const int* slot_ids, const float* slot_w, const WeightDesc* table, SharedDesc sh, int t,
                         int slots, int hidden, int inter) {
    moe_dec_down(out, act, slot_ids, slot_w, table, sh, t, slots, hidden, inter);
}

// ---- NVFP4 experts on tensor cores (nvfp4.cuh's layout): a 16-row block of a weight per warp
// and k tile, its lane's 16 bytes the A fragments of 4 k steps, the slot's one token the B
// operand (every column the same token: only column 0 is kept). The arithmetic per byte is then a
// few instructions, where decoding each code for a CUDA-core dot made these kernels issue-bound.
// At batch 1 these kernels are bound by the latency of their loads: the warps of a block (limits.rs:
// MOE_NV4_WARPS, MOE_NV4_DOWN_WARPS) and the tiles each has in flight (MOE_NV4_U, MOE_NV4_DOWN_U)
// are sized so that a block's weights go in one round at Qwen3.5's shapes. The B operand (the
// token's x, or its slots' SwiGLU activations rounded to bf16) is staged in shared memory in
// fragment order, each warp its own tiles (nvfp4.cuh: nv4_stage_round), two 16-byte reads a tile. ----

// Gate/up blocks an SM is to hold at once (the launch bound, limits.rs: MOE_NV4_SM_WARPS).
#define MOE_NV4_MIN_BLOCKS (MOE_NV4_SM_WARPS / MOE_NV4_WARPS > 0 ? MOE_NV4_SM_WARPS / MOE_NV4_WARPS : 1)

// act[slot, u] = silu(gate_u . x) * (up_u . x), f32, for units u of row block blockIdx.y of every
// (token, slot) blockIdx.x (experts as moe_dec_gate_up's). Grid (t * slots, ceil(inter / 16)),
// 32 MOE_NV4_WARPS threads: warp j takes the k tiles j, j + W, ... of both weights, MOE_NV4_U of
// each at a time; the warps' sums are added in a fixed order. Every block triggers after its wait,
// as moe_dec_gate_up's do. Dynamic shared memory: the token's x as staged fragments, ceil(k / 64)
// * 128 bytes.
extern "C" __global__ void __launch_bounds__(32 * MOE_NV4_WARPS, MOE_NV4_MIN_BLOCKS)
    moe_dec_gate_up_nvfp4(float* act, const int* slot_ids, const bf16* x, const WeightDesc* table, SharedDesc sh, int slots, int inter) {
    constexpr int W = MOE_NV4_WARPS, U = MOE_NV4_U;
    __shared__ float part[W][2][NV4_ROWS];
    extern __shared__ uint4 nv4_x[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int tok = blockIdx.x / slots, rb = blockIdx.y;
    // The shared expert's blocks know their rows without the routing: their first round of
    // weights is in flight before they wait, while the routing kernel runs.
    bool shared_slot = sh.present && blockIdx.x % slots == slots - 1;
    if (shared_slot && sh.gate.kind == DT_BF16) {
        // A bf16 shared expert (ModelOpt's exports keep it bf16 beside NVFP4 experts): the row
        // block's units a warp each, as moe_dec_gate_up does, each warp waiting once.
        const WeightDesc w[2] = {sh.gate, sh.up};
        bool wait = true;
        for (int j = warp; j < NV4_ROWS; j += W) {
            int u = NV4_ROWS * rb + j;
            if (u >= inter) break;
            float d[2];
            warp_dots<2>(w, u, x + (long long)tok * w[0].k, wait, d);
            wait = false;
            if (lane == 0) act[(long long)blockIdx.x * inter + u] = silu(d[0]) * d[1];
        }
        if (wait) grid_dep_wait_then_trigger();
        return;
    }
    if (!shared_slot) grid_dep_wait_then_trigger();
    int id = shared_slot ? -1 : slot_ids[blockIdx.x];
    const WeightDesc w[2] = {id >= 0 ? table[3 * id] : sh.gate, id >= 0 ? table[3 * id + 1] : sh.up};
    int k = w[0].k, kt_n = nv4_k_tiles(w[0]);
    long long tile0 = (long long)rb * kt_n;
    float acc[2][1][4] = {};
    uint4 q[U][2];
    uint2 sc[U][2];
    auto load_round = [&](int kt0) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int m = 0; m < 2; m++)
                if (kt0 + W * u < kt_n) nv4_load(w[m], tile0 + kt0 + W * u, lane, q[u][m], sc[u][m]);
    };
    load_round(warp);
    if (shared_slot) grid_dep_wait_then_trigger();
    const bf16* xr = x + (long long)tok * k;
    for (int kt0 = warp; kt0 < kt_n; kt0 += W * U) {
        if (kt0 != warp) load_round(kt0);
        nv4_stage_x<U>(nv4_x, xr, k, kt_n, kt0, W);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int kt = kt0 + W * u;
            if (kt >= kt_n) break;
            uint4 f[2];
            nv4_staged_tile(nv4_x, kt, c, f);
            auto b_frag = [&](int, int s, unsigned& b0, unsigned& b1) { nv4_staged_b(f, s, b0, b1); };
#pragma unroll
            for (int m = 0; m < 2; m++) nv4_tile_mma<1, true>(acc[m], q[u][m], sc[u][m], b_frag);
        }
    }
    // Column 0 (the token) is c0 (row g) and c2 (row g + 8) of the lanes with c = 0.
    if (c == 0)
#pragma unroll
        for (int m = 0; m < 2; m++) {
            part[warp][m][g] = acc[m][0][0];
            part[warp][m][g + 8] = acc[m][0][2];
        }
    __syncthreads();
    int u = NV4_ROWS * rb + threadIdx.x;
    if (threadIdx.x < NV4_ROWS && u < inter) {
        float d[2] = {0.0f, 0.0f};
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int j = 0; j < W; j++) d[m] += part[j][m][threadIdx.x];
        act[(long long)blockIdx.x * inter + u] = silu(d[0] * w[0].global[0]) * (d[1] * w[1].global[0]);
    }
}

// out[tok, r] = sum over the token's slots of slot_w * (down_slot[r] . act[slot]) for the rows r of
// row block blockIdx.x and token blockIdx.y. Grid (ceil(hidden / 16), t), 32 W threads: the
// (slot, k tile) items are shared out over the warps, warp j taking j, j + W, ..., U at a time,
// and the warps' sums are added in a fixed order. The first round's weights load before the wait
// (moe_dec_down); each round's activations are staged while its weights load, rounded to bf16 for
// the tensor cores (as the grouped prefill's are). Dynamic shared memory: slots * ceil(inter / 64)
// * 128 bytes.
template <int W, int U>
__device__ __forceinline__ void moe_nv4_down(bf16* out, const float* act, const int* slot_ids, const float* slot_w, const WeightDesc* table,
                                             const SharedDesc& sh, int slots, int hidden, int inter) {
    extern __shared__ uint4 nv4_act[];
    __shared__ WeightDesc dn[ROUTE_MAX_K + 1];
    __shared__ float mul[ROUTE_MAX_K + 1];
    __shared__ float part[W][NV4_ROWS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    int rb = blockIdx.x, tok = blockIdx.y;
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        slot_down(slot_ids, slot_w, table, sh, tok * slots + s, dn[s], mul[s]);
        mul[s] *= dn[s].global[0];
    }
    __syncthreads();
    // A bf16 shared expert (the last slot) is not in the tensor-core items: its rows are dots of
    // their own after them.
    bool bf16_shared = sh.present && sh.down.kind == DT_BF16;
    int kt_n = (inter + NV4_K - 1) / NV4_K, items = (slots - bf16_shared) * kt_n;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint4 q[U];
    uint2 sc[U];
    int sl[U], kt[U];  // item i0 + W u is k tile kt[u] of slot sl[u]
    auto load_round = [&](int i0) {
        // Stepped along from one division (W < kt_n steps a slot at most once, else a loop).
        int s = i0 / kt_n, k = i0 % kt_n;
#pragma unroll
        for (int u = 0; u < U; u++) {
            sl[u] = s;
            kt[u] = k;
            if (i0 + W * u < items) nv4_load(dn[s], (long long)rb * kt_n + k, lane, q[u], sc[u]);
            for (k += W; k >= kt_n; k -= kt_n) s++;
        }
    };
    load_round(warp);
    grid_dep_wait_then_trigger();
    const float* a = act + (long long)tok * slots * inter;
    for (int i0 = warp; i0 < items; i0 += W * U) {
        if (i0 != warp) load_round(i0);
        // The round's activations while its weights are in flight.
        nv4_stage_round<U>(
            nv4_act, inter, kt_n,
            [&](int u, int& r, int& k) {
                r = sl[u], k = kt[u];
                return i0 + W * u < items;
            },
            [&](int r, int j) {
                float2 v = *(const float2*)(a + (long long)r * inter + j);
                return pack_bf16(v.x, v.y);
            });
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (i0 + W * u >= items) break;
            uint4 f[2];
            nv4_staged_tile(nv4_act, sl[u] * kt_n + kt[u], c, f);
            float d[1][4] = {};
            nv4_tile_mma<1, true>(d, q[u], sc[u], [&](int, int s, unsigned& b0, unsigned& b1) { nv4_staged_b(f, s, b0, b1); });
            acc[0] += mul[sl[u]] * d[0][0];
            acc[2] += mul[sl[u]] * d[0][2];
        }
    }
    if (c == 0) {
        part[warp][g] = acc[0];
        part[warp][g + 8] = acc[2];
    }
    __shared__ float shared_rows[NV4_ROWS];
    if (bf16_shared) {
        // Row r of the block by warp r % W, over the shared slot's f32 activations.
        typedef Bf16Chunks F;
        const float* as = a + (long long)(slots - 1) * inter;
        for (int r = warp; r < NV4_ROWS; r += W) {
            long long row = (long long)NV4_ROWS * rb + r;
            float dot = 0.0f;
            if (row < hidden)
                for (int ch = lane; ch < inter / F::ELEMS; ch += 32) {
                    uint4 v;
                    float xf[F::ELEMS];
                    F::load(sh.down, row, ch, v);
                    load_xchunk(as, ch, xf);
                    dot += F::dot(v, xf);
                }
            dot = warp_sum(dot);
            if (lane == 0) shared_rows[r] = mul[slots - 1] * dot;
        }
    }
    __syncthreads();
    int row = NV4_ROWS * rb + threadIdx.x;
    if (threadIdx.x < NV4_ROWS && row < hidden) {
        float sum = bf16_shared ? shared_rows[threadIdx.x] : 0.0f;
#pragma unroll
        for (int j = 0; j < W; j++) sum += part[j][threadIdx.x];
        out[(long long)tok * hidden + row] = f2bf(sum);
    }
}

// The down kernels: one token (its grid of ceil(hidden / 16) blocks the whole launch) in blocks of
// MOE_NV4_DOWN1_WARPS, more tokens in blocks of MOE_NV4_DOWN_WARPS (limits.rs).
extern "C" __global__ void __launch_bounds__(32 * MOE_NV4_DOWN1_WARPS)
    moe_dec_down_nvfp4_t1(bf16* out, const float* act, const int* slot_ids, const float* slot_w, const WeightDesc* table, SharedDesc sh, int t,
                          int slots, int hidden, int inter) {
    moe_nv4_down<MOE_NV4_DOWN1_WARPS, MOE_NV4_DOWN1_U>(out, act, slot_ids, slot_w, table, sh, slots, hidden, inter);
}
extern "C" __global__ void __launch_bounds__(32 * MOE_NV4_DOWN_WARPS)
    moe_dec_down_nvfp4(bf16* out, const float* act, const int* slot_ids, const float* slot_w, const WeightDesc* table, SharedDesc sh, int t, int slots,
                       int hidden, int inter) {
    moe_nv4_down<MOE_NV4_DOWN_WARPS, MOE_NV4_DOWN_U>(out, act, slot_ids, slot_w, table, sh, slots, hidden, inter);
}
