// Expert routing, the one implementation every router kernel calls (moe.cu, moe_prefill.cu,
// moe_decode.cu): how a token's router logits become its top_k experts and their weights, as
// vt-cpu's `route` (crates/vt-cpu/src/ops/moe.rs), the reference.

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
    auto sigmoid_score = [&](float l) { return sigmoidf(ra.softcap > 0.0f ? ra.softcap * tanhf(l / ra.softcap) : l); };
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
            if (e < n) choice[i] = sigmoid_score(choice[i]) + (ra.bias ? ld((const void*)ra.bias, ra.bias_dt, e) : 0.0f);
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
            if (oi != none && (bi == none || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        // Every lane now holds the winner: softmax's score is its choice value.
        if (lane == (bi & 31)) taken |= 1u << (bi >> 5);
        float sc = ra.kind == 0 ? bv : sigmoid_score(logit(bi));
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
