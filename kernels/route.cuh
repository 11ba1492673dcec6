// Expert routing, the one rule every router kernel follows (moe.cu, moe_prefill.cu, moe_decode.cu):
// how a token's router logits become its top_k experts and their weights, as vt-cpu's `route`
// (crates/vt-cpu/src/ops/moe.rs), the reference. The scores (route_sigmoid, the softmax) and the
// order (ranks_ahead) are written once; two schedules apply them: route_warp, a warp per token
// (many tokens: prefill), and route_block, a block per token (a decode step's few tokens, where
// latency counts).

// How router logits become choices (vt-cuda's `RouteArgs`, #[repr(C)]): kind 0 = softmax over all
// experts, top-k on the probabilities; 1 = sigmoid of the (optionally tanh-softcapped) logits, top-k
// on score + bias, weights the unbiased scores times `scaling`. Renormalised over the k if `renorm`.
struct RouteArgs {
    u64 bias;
    int bias_dt;
    int kind;
    int renorm;
    int top_k;
    int n_exp;
    float softcap;
    float scaling;
    int pad;
};
// ROUTE_MAX_EXP experts at most (ROUTE_MAX_EXP / 32 choice values a lane), top-k <= ROUTE_MAX_K.

// Whether choice value a of expert i ranks ahead of value b of expert j: the higher value, an equal
// one at the lower index (NaN values are made -inf first, so they rank by index after numbers).
__device__ __forceinline__ bool ranks_ahead(float a, int i, float b, int j) { return a > b || (a == b && i < j); }

// A sigmoid router's score of logit l (tanh-softcapped first where the model caps it).
__device__ __forceinline__ float route_sigmoid(float l, const RouteArgs& ra) {
    return sigmoidf(ra.softcap > 0.0f ? ra.softcap * tanhf(l / ra.softcap) : l);
}

// One choice of a token: lane r < top_k holds its rank-r expert and weight.
struct Choice {
    int id;
    float w;
};

// The top_k choices of one token's n_exp logits (`logit(e)` reads expert e's), as vt-cpu's `route`:
// a higher choice value ranks first, an equal one at the lower index; a NaN value ranks after every
// number. Every lane of the warp calls it; the normaliser sums the chosen scores in rank order. Lane
// l holds the choice values of experts l + 32 i: each of the k rounds takes every lane's best
// untaken expert, then the warp's. A sigmoid router's winner gets its score from its logit again,
// so that only one array stays in registers.
template <typename Logit> __device__ __forceinline__ Choice route_warp(Logit logit, const RouteArgs& ra) {
    constexpr int PER = ROUTE_MAX_EXP / 32;
    const float neg_inf = __int_as_float(0xff800000);
    const int none = 0x7fffffff;
    // Registers of experts past n_exp are skipped (per: those a lane holds), which halves each
    // round's scan at 256 experts.
    int lane = threadIdx.x & 31, n = ra.n_exp, per = (n + 31) >> 5;
    float choice[PER];
    unsigned taken = 0;  // bit i: expert lane + 32 i chosen, or past n
#pragma unroll
    for (int i = 0; i < PER && i < per; i++) {
        int e = lane + 32 * i;
        choice[i] = e < n ? logit(e) : neg_inf;
        if (e >= n) taken |= 1u << i;
    }
    if (ra.kind == 0) {
        float mx = neg_inf, sum = 0.0f;
#pragma unroll
        for (int i = 0; i < PER && i < per; i++) mx = fmaxf(mx, choice[i]);
        mx = warp_max(mx);
#pragma unroll
        for (int i = 0; i < PER && i < per; i++) {
            choice[i] = taken >> i & 1u ? 0.0f : expf(choice[i] - mx);
            sum += choice[i];
        }
        sum = warp_sum(sum);
#pragma unroll
        for (int i = 0; i < PER && i < per; i++) choice[i] = choice[i] / sum;
    } else {
#pragma unroll
        for (int i = 0; i < PER && i < per; i++) {
            int e = lane + 32 * i;
            if (e < n) choice[i] = route_sigmoid(choice[i], ra) + (ra.bias ? ld((const void*)ra.bias, ra.bias_dt, e) : 0.0f);
        }
    }
#pragma unroll
    for (int i = 0; i < PER && i < per; i++)
        if (isnan(choice[i])) choice[i] = neg_inf;  // below every number, above nothing: by index
    Choice mine = {-1, 0.0f};
    float norm = 0.0f;
    for (int r = 0; r < ra.top_k; r++) {
        float bv = neg_inf;
        int bi = none;
#pragma unroll
        for (int i = 0; i < PER && i < per; i++)
            if (!(taken >> i & 1u) && (bi == none || choice[i] > bv)) { bv = choice[i]; bi = lane + 32 * i; }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi != none && (bi == none || ranks_ahead(ov, oi, bv, bi))) { bv = ov; bi = oi; }
        }
        // Every lane now holds the winner: softmax's score is its choice value.
        if (lane == (bi & 31)) taken |= 1u << (bi >> 5);
        float sc = ra.kind == 0 ? bv : route_sigmoid(logit(bi), ra);
        norm += sc;
        if (lane == r) mine = {bi, sc};
    }
    mine.w = mine.w / (ra.renorm ? norm : 1.0f) * (ra.kind == 1 ? ra.scaling : 1.0f);
    return mine;
}

// Where lane `lane`'s choice goes when a token's top_k choices are laid out in ascending expert
// order (the order vt-cpu adds the experts' outputs in): the number of chosen experts below it.
// Every lane of the warp calls it.
__device__ __forceinline__ int ascending_pos(const Choice& c, int top_k) {
    int pos = 0;
    for (int r = 0; r < top_k; r++) pos += __shfl_sync(0xffffffffu, c.id, r) < c.id;
    return pos;
}

// Shared memory of route_block.
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

// The same routing as route_warp, by a whole block (a thread per expert: blockDim.x >= n_exp), for
// latency: a decode step routes a few tokens, and one warp's k serial rounds cost it more than a
// block's parallel ranks. An expert's rank counts the experts ahead of it (ranks_ahead), in two
// steps: within the warp (shuffles), then, for the warp's first k, against the other warps' first
// k. That count is exact for every expert of rank < k: fewer than k experts are ahead of it, so
// those of any warp are among that warp's first k; an expert of rank >= k counts at least k.
// Writes the k choices in ascending expert order (the combine order) to ids/wts.
__device__ void route_block(const float* logits, const RouteArgs& ra, int* ids, float* wts, RouteScratch& rs) {
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
            rs.score[e] = route_sigmoid(logits[e], ra);
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
