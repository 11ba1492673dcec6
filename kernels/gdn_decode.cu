// Gated DeltaNet decode: single-token steps, one position or several of each sequence.
// gdn_dec_conv (the causal conv1d step + SiLU over every q/k/v channel, conv state shifted) then
// gdn_dec_state (l2-normalised q and k, the gates, the state's decay, delta update and output: the
// f32 state is read once and written once a call, kept in registers across the positions).
// Mirrors gdn.cu's token-by-token kernels; the conv output stays f32 between the two.
// gdn_dec_state needs key_dim = value_dim = GDN_D.

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
    bf16* st = (bf16*)(states_at ? states_at[blockIdx.y] : states.p[blockIdx.y]) + (long long)ch * (k - 1);
    u64 at_first = firsts_at ? firsts_at[blockIdx.y] : firsts.p[blockIdx.y];
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

// The gated delta rule on the conv outputs qkv (f32, a row per position: q [key_heads, D], k
// [key_heads, D], v [value_heads, D]), for each of a sequence's positions in turn:
// S *= exp(g);  delta = (v - S^T k) * beta;  S += k (x) delta;  o = S^T q. The state stays in
// registers across the positions: read once, written once. Grid: (value_heads, D / GDN_COLS,
// sequences), 256 threads; thread (rg = tid / 8, cg = tid % 8) keeps S rows rg + 32m (m < 4),
// columns col .. col + 3.
extern "C" __global__ void gdn_dec_state(bf16* out, const float* qkv, const bf16* a, const bf16* b, const void* a_log, int a_log_dt,
                                         const void* dt_bias, int dt_bias_dt, SeqPtrs states, const u64* states_at,
                                         SeqPtrs firsts, const u64* firsts_at, const __grid_constant__ GdnWaves waves,
                                         int nwaves, int first, int key_heads, int value_heads) {
    grid_dep_begin();
    int seq = first + blockIdx.z;
    float* state = (float*)(states_at ? states_at[blockIdx.z] : states.p[blockIdx.z]);
    u64 at_first = firsts_at ? firsts_at[blockIdx.z] : firsts.p[blockIdx.z];
    __shared__ float qs[GDN_D], ks[GDN_D];
    __shared__ float red[8][GDN_COLS];
    __shared__ float tot[GDN_COLS];
    int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int kh = h / (value_heads / key_heads);
    int rg = tid >> 3, col = blockIdx.y * GDN_COLS + (tid & 7) * 4;
    float* S = state + (long long)h * GDN_D * GDN_D + col;
    // The state's loads go first: they are in flight while q and k load and normalise.
    float4 s[GDN_D / 32];
#pragma unroll
    for (int m = 0; m < GDN_D / 32; m++) s[m] = *(const float4*)(S + (rg + 32 * m) * GDN_D);
    float neg_a = -expf(ld(a_log, a_log_dt, h)), bias = ld(dt_bias, dt_bias_dt, h);
    long long row = seq;
    for (int j = 0; j < nwaves && waves.seqs[j] > seq; row += waves.seqs[j], j++) {
        const float* x = qkv + row * (2 * key_heads + value_heads) * GDN_D;
        // The previous position's last reads of qs and ks came before its col_sums' barriers.
        if (warp < 2) {
            // As gdn.cu's load_l2: x * (1 / sqrt(sum x^2 + 1e-6)) * (1 / sqrt(D) for q).
            const float* src = x + (long long)(warp * key_heads + kh) * GDN_D;
            float vals[GDN_D / 32], ss = 0.0f;
#pragma unroll
            for (int m = 0; m < GDN_D / 32; m++) { vals[m] = src[lane + 32 * m]; ss += vals[m] * vals[m]; }
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
        const float* v = x + (long long)(2 * key_heads + h) * GDN_D + col;
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
