// Gated DeltaNet decode: single-token steps, one position or several of each sequence.
// gdn_dec_conv (the causal conv1d step + SiLU over every q/k/v channel, conv state shifted) then
// gdn_dec_state (l2-normalised q and k, the gates, the state's decay, delta update and output: the
// f32 state is read once and written once a call, kept in registers across the positions), or
// both in one launch (gdn_dec_step: each block steps the conv channels it reads itself, a key
// head's blocks a thread block cluster). Mirrors gdn.cu's token-by-token kernels; the conv output
// stays f32 between the two. The state kernels need key_dim = value_dim = GDN_D.

// GDN_COLS: value columns of one head per block: 4 blocks per head, so a single sequence's 32
// heads already spread over 128 blocks.

// Both kernels serve a batch of sequences, each stepping one token or several (a verification's
// positions) in waves: wave j is the j-th position of the first waves.seqs[j] sequences, and the
// rows of the inputs and outputs are wave after wave (a plain decode step is one wave). blockIdx.y
// (conv) or blockIdx.z (state) is the sequence, counted from `first` (a launch serves at most
// SEQ_MAX of them); it takes its rows in position order (row `seq` at position 0, each next one
// past the rows of the wave before), and its state's address from `states.p`,
// or `states_at` where that is not null (device memory: a recorded step's replays write it).
// Where its `firsts` address (from `firsts.p` or `firsts_at` alike) is not 0, the state after its
// first position is also written there: a verification's rollback point.
struct GdnWaves { int seqs[GDN_WAVES_MAX]; };

// out[ch] = silu(sum_j w[ch, j] * window_j), window = (state[ch, :], x[ch]); the state then holds
// the last k - 1 inputs. One thread per channel, its positions in order; x bf16 [rows, c], out
// f32 [rows, c], a sequence's state bf16 [c, k - 1].
extern "C" __global__ void gdn_dec_conv(float* out, const bf16* x, const void* w, int wdt, SeqPtrs states, const u64* states_at,
                                        SeqPtrs firsts, const u64* firsts_at, const __grid_constant__ GdnWaves waves,
                                        int nwaves, int first, int c, int k) {
    grid_dep_begin();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    int seq = first + blockIdx.y;
    bf16* st = (bf16*)seq_ptr(states, states_at, blockIdx.y) + (long long)ch * (k - 1);
    u64 at_first = seq_ptr(firsts, firsts_at, blockIdx.y);
    long long row = seq;
    for (int j = 0; j < nwaves && waves.seqs[j] > seq; row += waves.seqs[j], j++) {
        float acc = 0.0f;
        for (int i = 0; i < k - 1; i++) acc += ld(w, wdt, (long long)ch * k + i) * bf2f(st[i]);
        acc += ld(w, wdt, (long long)ch * k + k - 1) * bf2f(x[row * c + ch]);
        for (int i = 0; i + 2 < k; i++) st[i] = st[i + 1];
        if (k > 1) st[k - 2] = x[row * c + ch];
        out[row * c + ch] = silu(acc);
        if (j == 0 && at_first != 0)
            for (int i = 0; i < k - 1; i++) ((bf16*)at_first)[(long long)ch * (k - 1) + i] = st[i];
    }
}

// Column sums over the block's 128 state rows of p[c] (this thread's partial for its 4 columns);
// every thread gets its columns' totals back in p. red: [8][GDN_COLS], tot: [GDN_COLS] shared.
__device__ __forceinline__ void col_sums(float* p, float (*red)[GDN_COLS], float* tot) {
    int tid = threadIdx.x, lane = tid & 31, cg = tid & 7;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        p[c] += __shfl_xor_sync(0xffffffffu, p[c], 8);
        p[c] += __shfl_xor_sync(0xffffffffu, p[c], 16);
    }
    if (lane < 8)
#pragma unroll
        for (int c = 0; c < 4; c++) red[tid >> 5][cg * 4 + c] = p[c];
    __syncthreads();
    if (tid < GDN_COLS) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) s += red[w][tid];
        tot[tid] = s;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < 4; c++) p[c] = tot[cg * 4 + c];
}

// One thread's conv channel in gdn_dec_step: its GDN_FUSED_TAPS weights and window (the last
// GDN_FUSED_TAPS - 1 inputs, oldest first), in registers.
struct ConvChannel {
    float w[GDN_FUSED_TAPS], win[GDN_FUSED_TAPS - 1];
};

__device__ __forceinline__ void conv_load(ConvChannel& cc, const void* wt, int wdt, const bf16* st, long long ch) {
#pragma unroll
    for (int i = 0; i < GDN_FUSED_TAPS; i++) cc.w[i] = ld(wt, wdt, ch * GDN_FUSED_TAPS + i);
#pragma unroll
    for (int i = 0; i + 1 < GDN_FUSED_TAPS; i++) cc.win[i] = bf2f(st[ch * (GDN_FUSED_TAPS - 1) + i]);
}

// gdn_dec_conv's step of one channel, in its order: silu(sum_j w_j * (window, x)_j), x shifted in.
__device__ __forceinline__ float conv_step(ConvChannel& cc, bf16 x) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i + 1 < GDN_FUSED_TAPS; i++) acc += cc.w[i] * cc.win[i];
    acc += cc.w[GDN_FUSED_TAPS - 1] * bf2f(x);
#pragma unroll
    for (int i = 0; i + 2 < GDN_FUSED_TAPS; i++) cc.win[i] = cc.win[i + 1];
    cc.win[GDN_FUSED_TAPS - 2] = bf2f(x);
    return silu(acc);
}

__device__ __forceinline__ void conv_store(const ConvChannel& cc, bf16* st, long long ch) {
#pragma unroll
    for (int i = 0; i + 1 < GDN_FUSED_TAPS; i++) st[ch * (GDN_FUSED_TAPS - 1) + i] = f2bf(cc.win[i]);
}

// The conv step inside gdn_dec_step (CONV): thread tid steps q/k channel `qk` (of q for tid <
// GDN_D, then of k), threads tid < GDN_COLS value channel `vc`, into shared memory. The windows
// are written after the first position to the rollback point (`first`, when not 0) and after the
// last to the conv state `st`: the q/k ones by the cluster's `lead` block only, and to `st` only
// once every block of the cluster has stepped its first position, the last read of `st` (a split
// cluster barrier: each block arrives after its first step and waits before its last writes; the
// arrive's release waits for the block's loads so far, which the step needs anyway).
struct ConvArgs {
    const bf16* x;
    bf16* st;
    const void* w;
    int wdt;
    u64 first;
    bool lead;
};

// The gated delta rule for each of a sequence's positions in turn: S *= exp(g);  delta = (v - S^T
// k) * beta;  S += k (x) delta;  o = S^T q, with q, k and v from gdn_dec_conv's f32 rows `qkv`
// (a row per position: q [key_heads, D], k [key_heads, D], v [value_heads, D]) or, with CONV, from
// the block's own conv step of `conv.x` (ConvArgs). The state stays in registers across the
// positions: read once, written once. Grid: (value_heads, D / GDN_COLS, sequences), 256 threads;
// thread (rg = tid / 8, cg = tid % 8) keeps S rows rg + 32m (m < 4), columns col .. col + 3.
template <bool CONV>
__device__ __forceinline__ void gdn_state_steps(bf16* out, const float* qkv, const ConvArgs& conv, const bf16* a, const bf16* b,
                                                const void* a_log, int a_log_dt, const void* dt_bias, int dt_bias_dt, float* state,
                                                u64 at_first, const GdnWaves& waves, int nwaves, int seq, int key_heads, int value_heads) {
    __shared__ float qs[GDN_D], ks[GDN_D];
    __shared__ float red[8][GDN_COLS];
    __shared__ float tot[GDN_COLS];
    __shared__ float conv_qk[CONV ? 2 * GDN_D : 1], conv_v[CONV ? GDN_COLS : 1];
    int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int kh = h / (value_heads / key_heads);
    int rg = tid >> 3, col = blockIdx.y * GDN_COLS + (tid & 7) * 4;
    float* S = state + (long long)h * GDN_D * GDN_D + col;
    int c = (2 * key_heads + value_heads) * GDN_D;
    long long qk = tid < GDN_D ? (long long)kh * GDN_D + tid : (long long)(key_heads + kh) * GDN_D + tid - GDN_D;
    long long vc = (long long)(2 * key_heads + h) * GDN_D + blockIdx.y * GDN_COLS + tid;
    ConvChannel cq, cv;
    if (CONV) {
        conv_load(cq, conv.w, conv.wdt, conv.st, qk);
        if (tid < GDN_COLS) conv_load(cv, conv.w, conv.wdt, conv.st, vc);
    }
    // The state's loads go first: they are in flight while q and k load and normalise.
    float4 s[GDN_D / 32];
#pragma unroll
    for (int m = 0; m < GDN_D / 32; m++) s[m] = *(const float4*)(S + (rg + 32 * m) * GDN_D);
    float neg_a = -expf(ld(a_log, a_log_dt, h)), bias = ld(dt_bias, dt_bias_dt, h);
    long long row = seq;
    for (int j = 0; j < nwaves && waves.seqs[j] > seq; row += waves.seqs[j], j++) {
        const float *q, *k, *v;
        if (CONV) {
            // The previous position's reads of conv_qk and conv_v came before its col_sums' barriers.
            conv_qk[tid] = conv_step(cq, conv.x[row * c + qk]);
            if (tid < GDN_COLS) conv_v[tid] = conv_step(cv, conv.x[row * c + vc]);
            if (j == 0) {
                asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
                if (conv.first != 0) {
                    if (conv.lead) conv_store(cq, (bf16*)conv.first, qk);
                    if (tid < GDN_COLS) conv_store(cv, (bf16*)conv.first, vc);
                }
            }
            if (j + 1 == nwaves || waves.seqs[j + 1] <= seq) {
                asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
                if (conv.lead) conv_store(cq, conv.st, qk);
                if (tid < GDN_COLS) conv_store(cv, conv.st, vc);
            }
            __syncthreads();
            q = conv_qk, k = conv_qk + GDN_D, v = conv_v + col % GDN_COLS;
        } else {
            const float* x = qkv + row * c;
            q = x + (long long)kh * GDN_D, k = x + (long long)(key_heads + kh) * GDN_D, v = x + (long long)(2 * key_heads + h) * GDN_D + col;
        }
        // The previous position's last reads of qs and ks came before its col_sums' barriers.
        if (warp < 2) {
            // As gdn.cu's load_l2: x * (1 / sqrt(sum x^2 + 1e-6)) * (1 / sqrt(D) for q).
            const float* from = warp == 0 ? q : k;
            float vals[GDN_D / 32], ss = 0.0f;
#pragma unroll
            for (int m = 0; m < GDN_D / 32; m++) { vals[m] = from[lane + 32 * m]; ss += vals[m] * vals[m]; }
            float inv = 1.0f / sqrtf(warp_sum(ss) + 1e-6f), mul = warp == 0 ? 1.0f / sqrtf((float)GDN_D) : 1.0f;
            float* dst = warp == 0 ? qs : ks;
#pragma unroll
            for (int m = 0; m < GDN_D / 32; m++) dst[lane + 32 * m] = vals[m] * inv * mul;
        }
        float beta = sigmoidf(bf2f(b[row * value_heads + h]));
        float decay = expf(neg_a * softplusf(bf2f(a[row * value_heads + h]) + bias));
        __syncthreads();
        float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int m = 0; m < GDN_D / 32; m++) {
            float kk = ks[rg + 32 * m];
            s[m].x *= decay; s[m].y *= decay; s[m].z *= decay; s[m].w *= decay;
            p[0] += s[m].x * kk; p[1] += s[m].y * kk; p[2] += s[m].z * kk; p[3] += s[m].w * kk;
        }
        col_sums(p, red, tot);
        float delta[4];
#pragma unroll
        for (int c = 0; c < 4; c++) { delta[c] = (v[c] - p[c]) * beta; p[c] = 0.0f; }
#pragma unroll
        for (int m = 0; m < GDN_D / 32; m++) {
            float kk = ks[rg + 32 * m], qq = qs[rg + 32 * m];
            s[m].x += kk * delta[0]; s[m].y += kk * delta[1]; s[m].z += kk * delta[2]; s[m].w += kk * delta[3];
            p[0] += s[m].x * qq; p[1] += s[m].y * qq; p[2] += s[m].z * qq; p[3] += s[m].w * qq;
        }
        col_sums(p, red, tot);
        if (rg == 0)
#pragma unroll
            for (int c = 0; c < 4; c++) out[(row * value_heads + h) * GDN_D + col + c] = f2bf(p[c]);
        if (j == 0 && at_first != 0) {
            float* F = (float*)at_first + (long long)h * GDN_D * GDN_D + col;
#pragma unroll
            for (int m = 0; m < GDN_D / 32; m++) *(float4*)(F + (rg + 32 * m) * GDN_D) = s[m];
        }
    }
#pragma unroll
    for (int m = 0; m < GDN_D / 32; m++) *(float4*)(S + (rg + 32 * m) * GDN_D) = s[m];
}

extern "C" __global__ void gdn_dec_state(bf16* out, const float* qkv, const bf16* a, const bf16* b, const void* a_log, int a_log_dt,
                                         const void* dt_bias, int dt_bias_dt, SeqPtrs states, const u64* states_at,
                                         SeqPtrs firsts, const u64* firsts_at, const __grid_constant__ GdnWaves waves,
                                         int nwaves, int first, int key_heads, int value_heads) {
    grid_dep_begin();
    float* state = (float*)seq_ptr(states, states_at, blockIdx.z);
    u64 at_first = seq_ptr(firsts, firsts_at, blockIdx.z);
    gdn_state_steps<false>(out, qkv, ConvArgs{}, a, b, a_log, a_log_dt, dt_bias, dt_bias_dt, state, at_first, waves, nwaves, first + blockIdx.z,
                           key_heads, value_heads);
}

// gdn_dec_conv and gdn_dec_state in one launch, for GDN_FUSED_TAPS taps: each block steps
// the conv of its key head's q and k channels and of its own value columns itself. A key head's
// q/k channels are stepped by all the value_heads / key_heads x GDN_D / GDN_COLS blocks that read
// them, launched as one thread block cluster (x: the key head's value heads, y: their column
// blocks), whose first block writes their conv state back (ConvArgs); each block writes its value
// columns' own. The states and their rollback points come as gdn_dec_conv's and gdn_dec_state's.
extern "C" __global__ void gdn_dec_step(bf16* out, const bf16* x, const void* w, int wdt, const bf16* a, const bf16* b, const void* a_log,
                                        int a_log_dt, const void* dt_bias, int dt_bias_dt, SeqPtrs conv_states, const u64* conv_at,
                                        SeqPtrs rec_states, const u64* rec_at, SeqPtrs conv_firsts, const u64* conv_firsts_at,
                                        SeqPtrs rec_firsts, const u64* rec_firsts_at, const __grid_constant__ GdnWaves waves, int nwaves,
                                        int first, int key_heads, int value_heads) {
    grid_dep_begin();
    int z = blockIdx.z;
    ConvArgs conv{x, (bf16*)seq_ptr(conv_states, conv_at, z), w, wdt, seq_ptr(conv_firsts, conv_firsts_at, z),
                  blockIdx.x % (value_heads / key_heads) == 0 && blockIdx.y == 0};
    float* state = (float*)seq_ptr(rec_states, rec_at, z);
    u64 at_first = seq_ptr(rec_firsts, rec_firsts_at, z);
    gdn_state_steps<true>(out, nullptr, conv, a, b, a_log, a_log_dt, dt_bias, dt_bias_dt, state, at_first, waves, nwaves, first + z, key_heads,
                          value_heads);
}
