// Gated delta rule, chunked (WY) form for prefill: 64-token chunks, key dim 128, f32 state,
// TF32 tensor cores with f32 accumulation (bf16 inputs are exact in TF32; derived operands carry
// ~2^-11 relative rounding). The algebra is vt-cpu's ops/gdn.rs `chunked_head`:
//   A = tril(beta_i (k_i . k_j) G_ij, -1), G_ij = exp(c_i - c_j), c = cumsum(g) within the chunk
//   T = (I + A)^-1,  W = T (beta k exp(c)),  U = T (beta v),  QK = tril(q_i . k_j G_ij)
//   v' = U - W S,  o = (q exp(c)) S + QK v',  S' = exp(c_L) S + (k exp(c_L - c))^T v'
// rewritten so that everything not involving the state is computed for all chunks in parallel:
//   o = Q' S + O0 with Q' = q exp(c) - QK W and O0 = QK U.
// gdn_chunk_prep (one block per chunk and value head) writes W and Q' ([128][128]), K~^T
// ([128][64]), U and O0 ([128][dv]) and exp(c_L) in f32; gdn_chunk_scan (one block per value head
// and 32 value columns) walks the chunks: v' = U - W S, o = Q' S + O0, S = exp(c_L) S + K~^T v'.
// A final partial chunk is zero-padded (q = k = v = 0, g = 0, beta = 0), which adds exact zeros.

#define GC 64    // tokens per chunk
#define GDK 128  // key dim
#define GLD 132  // row stride (floats) of [64][128] tiles: A-fragment reads hit 32 banks
#define GLA 68   // row stride of [64][64] tiles

// Warp-level TF32 products on f32 shared-memory tiles; g = lane / 4, c = lane % 4.
// acc[MI][NT] (rows r0 + 16 mi.., columns n0..n0+8NT) += X[rows, :K] * B, with B[k][n] = Y[n][k]
// (NMAJOR) or Z[k][n] (row-major [k][n]); the B fragments of a k step serve all MI row tiles.
template <int MI, int NT, int K, bool NMAJOR>
__device__ __forceinline__ void warp_mma_tf32(float (*acc)[NT][4], const float* x, int ldx, const float* y, int ldy, int r0, int n0) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned b[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            int n = n0 + nt * 8 + g;
            b[nt][0] = tf32(NMAJOR ? y[n * ldy + k0 + c] : y[(k0 + c) * ldy + n]);
            b[nt][1] = tf32(NMAJOR ? y[n * ldy + k0 + c + 4] : y[(k0 + c + 4) * ldy + n]);
        }
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            int r = r0 + 16 * mi;
            unsigned a[4] = {tf32(x[(r + g) * ldx + k0 + c]), tf32(x[(r + g + 8) * ldx + k0 + c]), tf32(x[(r + g) * ldx + k0 + c + 4]),
                             tf32(x[(r + g + 8) * ldx + k0 + c + 4])};
#pragma unroll
            for (int nt = 0; nt < NT; nt++) mma_tf32(acc[mi][nt], a, b[nt][0], b[nt][1]);
        }
    }
}

template <int NT> __device__ __forceinline__ void zero_acc(float (*acc)[4]) {
    for (int nt = 0; nt < NT; nt++)
        for (int x = 0; x < 4; x++) acc[nt][x] = 0.0f;
}

// Calls f(row, col, value) for every accumulator element of a warp tile at (r0, n0).
template <int NT, typename F> __device__ __forceinline__ void each_acc(float (*acc)[4], int r0, int n0, F f) {
    int lane = threadIdx.x & 31, g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) f(r0 + g + 8 * (x >> 1), n0 + nt * 8 + c2 + (x & 1), acc[nt][x]);
}

// Grid: (chunks, value_heads), 256 threads, dynamic shared memory (3 * 64 * GLD + 2 * 64 * GLA +
// 2 * 64) floats. Outputs per (chunk, head) ch = chunk * value_heads + head: wq + ch * 128 * 128,
// kt + ch * 128 * 64, uo + ch * 128 * DV, decay[ch].
template <int DV>
__device__ __forceinline__ void gdn_chunk_prep(float* wq, float* kt, float* uo, float* decay, const bf16* q, const bf16* k, const bf16* v,
                                               const bf16* a, const bf16* b, const void* a_log, int a_log_dt, const void* dt_bias,
                                               int dt_bias_dt, int t, int key_heads, int value_heads, float qmul) {
    constexpr int LV = DV + 4;
    extern __shared__ __align__(16) float gp_sh[];
    float *qs = gp_sh, *ks = qs + GC * GLD, *vs = ks + GC * GLD, *am = vs + GC * GLD, *qk = am + GC * GLA;
    float *cum = qk + GC * GLA, *beta = cum + GC;
    int chunk = blockIdx.x, h = blockIdx.y, s0 = chunk * GC, len = min(GC, t - s0);
    int kh = h / (value_heads / key_heads), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    long long ch = (long long)chunk * value_heads + h;

    // q, k l2-normalised (q also times 1/sqrt(dk)), v, as f32; rows past the chunk are zero.
    for (int r = warp; r < GC; r += 8) {
        bool in = r < len;
        long long qk_off = ((long long)(s0 + r) * key_heads + kh) * GDK + lane * 4;
        float xq[4], xk[4], sq = 0.0f, sk = 0.0f;
        for (int i = 0; i < 4; i++) {
            xq[i] = in ? bf2f(q[qk_off + i]) : 0.0f;
            xk[i] = in ? bf2f(k[qk_off + i]) : 0.0f;
            sq += xq[i] * xq[i];
            sk += xk[i] * xk[i];
        }
        float iq = 1.0f / sqrtf(warp_sum(sq) + 1e-6f), ik = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
        for (int i = 0; i < 4; i++) {
            qs[r * GLD + lane * 4 + i] = xq[i] * iq * qmul;
            ks[r * GLD + lane * 4 + i] = xk[i] * ik;
        }
        for (int d = lane; d < DV; d += 32) vs[r * LV + d] = in ? bf2f(v[((long long)(s0 + r) * value_heads + h) * DV + d]) : 0.0f;
    }
    float g = 0.0f;
    if (tid < GC) {
        long long ab = (long long)(s0 + tid) * value_heads + h;
        bool in = tid < len;
        g = in ? -expf(ld(a_log, a_log_dt, h)) * softplusf(bf2f(a[ab]) + ld(dt_bias, dt_bias_dt, h)) : 0.0f;
        beta[tid] = in ? sigmoidf(bf2f(b[ab])) : 0.0f;
        cum[tid] = g;
    }
    __syncthreads();
    if (tid == 0) {  // as torch's CPU cumsum: f64 accumulation, each prefix rounded to f32
        double acc = 0.0;
        for (int i = 0; i < GC; i++) {
            acc += cum[i];
            cum[i] = (float)acc;
        }
    }
    __syncthreads();

    // A (warps 0-3) and QK (warps 4-7), 16 rows each.
    {
        int r0 = (warp & 3) * 16;
        float acc[1][8][4];
        zero_acc<8>(acc[0]);
        warp_mma_tf32<1, 8, GDK, true>(acc, warp < 4 ? ks : qs, GLD, ks, GLD, r0, 0);
        each_acc<8>(acc[0], r0, 0, [&](int i, int j, float val) {
            if (warp < 4) am[i * GLA + j] = j < i ? beta[i] * val * expf(cum[i] - cum[j]) : 0.0f;
            else qk[i * GLA + j] = j <= i ? val * expf(cum[i] - cum[j]) : 0.0f;
        });
    }
    __syncthreads();

    // T = (I + A)^-1 by forward substitution, one column per thread (warps 0-1), while warps 2-7
    // write K~^T and turn k into beta k exp(c) and v into beta v in place.
    float x[GC];
    if (tid < GC) {
        int col = tid;
#pragma unroll
        for (int i = 0; i < GC; i++) {
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < i; j++) p[j & 3] += am[i * GLA + j] * x[j];
            x[i] = (i == col ? 1.0f : 0.0f) - ((p[0] + p[1]) + (p[2] + p[3]));
        }
    } else {
        float c_last = cum[GC - 1];
        for (int idx = tid - GC; idx < GDK * GC; idx += 256 - GC) {
            int d = idx / GC, j = idx % GC;
            float kv = ks[j * GLD + d];
            kt[ch * GDK * GC + idx] = kv * expf(c_last - cum[j]);
            ks[j * GLD + d] = kv * beta[j] * expf(cum[j]);
        }
        for (int idx = tid - GC; idx < GC * DV; idx += 256 - GC) vs[(idx / DV) * LV + idx % DV] *= beta[idx / DV];
        if (tid == GC) decay[ch] = expf(c_last);
    }
    __syncthreads();
    if (tid < GC)
#pragma unroll
        for (int i = 0; i < GC; i++) am[i * GLA + tid] = x[i];
    __syncthreads();

    // W = T (beta k exp(c)), U = T (beta v): warp rows 16 (warp & 3), column half (warp >> 2).
    int r0 = (warp & 3) * 16, half = warp >> 2;
    float accw[1][8][4], accu[1][DV / 16][4];
    zero_acc<8>(accw[0]);
    zero_acc<DV / 16>(accu[0]);
    warp_mma_tf32<1, 8, GC, false>(accw, am, GLA, ks, GLD, r0, half * 64);
    warp_mma_tf32<1, DV / 16, GC, false>(accu, am, GLA, vs, LV, r0, half * DV / 2);
    __syncthreads();  // every warp is done reading beta k exp(c) and beta v
    float* wq_ch = wq + ch * 2 * GC * GDK;
    float* uo_ch = uo + ch * 2 * GC * DV;
    each_acc<8>(accw[0], r0, half * 64, [&](int i, int d, float val) { ks[i * GLD + d] = wq_ch[i * GDK + d] = val; });
    each_acc<DV / 16>(accu[0], r0, half * DV / 2, [&](int i, int d, float val) { vs[i * LV + d] = uo_ch[i * DV + d] = val; });
    __syncthreads();

    // Q' = q exp(c) - QK W and O0 = QK U.
    zero_acc<8>(accw[0]);
    zero_acc<DV / 16>(accu[0]);
    warp_mma_tf32<1, 8, GC, false>(accw, qk, GLA, ks, GLD, r0, half * 64);
    warp_mma_tf32<1, DV / 16, GC, false>(accu, qk, GLA, vs, LV, r0, half * DV / 2);
    each_acc<8>(accw[0], r0, half * 64,
                [&](int i, int d, float val) { wq_ch[(GC + i) * GDK + d] = qs[i * GLD + d] * expf(cum[i]) - val; });
    each_acc<DV / 16>(accu[0], r0, half * DV / 2, [&](int i, int d, float val) { uo_ch[(GC + i) * DV + d] = val; });
}

#define GS_BV 32  // value columns per scan block
#define GS_LD 132 // [W; Q'] row stride
#define GS_LK 68  // K~^T row stride
#define GS_LV 40  // row stride of 32-column tiles (U/O0, S, v'): k-major B reads hit 32 banks

// Grid: (value_heads, DV / 32), 128 threads, dynamic shared memory (128 * GS_LD + 2 * 128 * GS_LK
// + 2 * 128 * GS_LV + 128 * GS_LV + 64 * GS_LV) floats. Reads and updates state[h][:, v0:v0+32].
template <int DV>
__device__ __forceinline__ void gdn_chunk_scan(bf16* out, float* state, const float* wq, const float* kt, const float* uo,
                                               const float* decay, int t, int value_heads) {
    extern __shared__ __align__(16) float gs_sh[];
    float* wqs = gs_sh;
    float* kts = wqs + 2 * GC * GS_LD;     // two buffers of [128][GS_LK]
    float* uos = kts + 2 * GDK * GS_LK;    // two buffers of [128][GS_LV]
    float* ss = uos + 2 * 2 * GC * GS_LV;  // [128][GS_LV]
    float* vp = ss + GDK * GS_LV;          // [64][GS_LV]
    int h = blockIdx.x, v0 = blockIdx.y * GS_BV, tid = threadIdx.x, warp = tid >> 5;
    int chunks = (t + GC - 1) / GC;
    float* st = state + (long long)h * GDK * DV + v0;

    auto load_kt_uo = [&](int c) {
        long long ch = (long long)c * value_heads + h;
        float* kd = kts + (c & 1) * GDK * GS_LK;
        float* ud = uos + (c & 1) * 2 * GC * GS_LV;
        for (int i = tid; i < GDK * GC / 4; i += 128)
            cp_async16(smem_addr(kd + (i / 16) * GS_LK + (i % 16) * 4), kt + ch * GDK * GC + i * 4, true);
        for (int i = tid; i < 2 * GC * GS_BV / 4; i += 128)
            cp_async16(smem_addr(ud + (i / 8) * GS_LV + (i % 8) * 4), uo + ch * 2 * GC * DV + (i / 8) * DV + v0 + (i % 8) * 4, true);
    };
    auto load_wq = [&](int c) {
        const float* src = wq + ((long long)c * value_heads + h) * 2 * GC * GDK;
        for (int i = tid; i < 2 * GC * GDK / 4; i += 128) cp_async16(smem_addr(wqs + (i / 32) * GS_LD + (i % 32) * 4), src + i * 4, true);
    };
    for (int i = tid; i < GDK * GS_BV / 4; i += 128) cp_async16(smem_addr(ss + (i / 8) * GS_LV + (i % 8) * 4), st + (i / 8) * DV + (i % 8) * 4, true);
    load_wq(0);
    load_kt_uo(0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // This warp's 32 state rows, kept in accumulators across chunks.
    float sacc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++) each_acc<4>(sacc[mi], warp * 32 + mi * 16, 0, [&](int r, int col, float& val) { val = ss[r * GS_LV + col]; });

    for (int c = 0; c < chunks; c++) {
        cp_async_wait<0>();
        __syncthreads();  // chunk c is in, S is in ss; every warp is done with chunk c - 1
        if (c + 1 < chunks) load_kt_uo(c + 1);
        cp_async_commit();
        const float* ud = uos + (c & 1) * 2 * GC * GS_LV;
        int s0 = c * GC, len = min(GC, t - s0);
        // [W; Q'] S: warps 0-1 make v' = U - W S, warps 2-3 the outputs Q' S + O0.
        float x[2][4][4];
        zero_acc<4>(x[0]);
        zero_acc<4>(x[1]);
        warp_mma_tf32<2, 4, GDK, false>(x, wqs, GS_LD, ss, GS_LV, warp * 32, 0);
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
            each_acc<4>(x[mi], warp * 32 + mi * 16, 0, [&](int r, int col, float val) {
                if (r < GC) vp[r * GS_LV + col] = ud[r * GS_LV + col] - val;
                else if (r - GC < len)
                    out[((long long)(s0 + r - GC) * value_heads + h) * DV + v0 + col] = f2bf(val + ud[r * GS_LV + col]);
            });
        }
        __syncthreads();  // v' is complete; every warp is done reading [W; Q'] and S
        if (c + 1 < chunks) load_wq(c + 1);
        cp_async_commit();
        // S = exp(c_L) S + K~^T v'.
        float dec = decay[(long long)c * value_heads + h];
        const float* kd = kts + (c & 1) * GDK * GS_LK;
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) sacc[mi][nt][e] *= dec;
        warp_mma_tf32<2, 4, GC, false>(sacc, kd, GS_LK, vp, GS_LV, warp * 32, 0);
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
            each_acc<4>(sacc[mi], warp * 32 + mi * 16, 0, [&](int r, int col, float val) { ss[r * GS_LV + col] = val; });
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mi = 0; mi < 2; mi++) each_acc<4>(sacc[mi], warp * 32 + mi * 16, 0, [&](int r, int col, float val) { st[r * DV + col] = val; });
}

#define GDN_KERNELS(DV)                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep_v##DV(                                                         \
        float* wq, float* kt, float* uo, float* decay, const bf16* q, const bf16* k, const bf16* v, const bf16* a, const bf16* b,     \
        const void* a_log, int a_log_dt, const void* dt_bias, int dt_bias_dt, int t, int key_heads, int value_heads, float qmul) {   \
        gdn_chunk_prep<DV>(wq, kt, uo, decay, q, k, v, a, b, a_log, a_log_dt, dt_bias, dt_bias_dt, t, key_heads, value_heads, qmul); \
    }                                                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) gdn_chunk_scan_v##DV(bf16* out, float* state, const float* wq, const float* kt, \
                                                                            const float* uo, const float* decay, int t,              \
                                                                            int value_heads) {                                       \
        gdn_chunk_scan<DV>(out, state, wq, kt, uo, decay, t, value_heads);                                                           \
    }
GDN_KERNELS(64)
GDN_KERNELS(128)
