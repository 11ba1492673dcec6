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
//
// W, Q' and K~^T leave prep rounded to TF32 (tf32r; the scan only multiplies them), U and O0 in
// full f32 (the scan adds them); the scan rounds S and v' where it stores them and reads every
// operand with ldmatrix. The products are those of rounding at every read.

#define GC 64    // tokens per chunk
#define GDK 128  // key dim
#define GLD 132  // row stride (floats) of [64][128] tiles: ldmatrix rows hit distinct banks
#define GLA 68   // row stride of [.][64] tiles

// x rounded to TF32 (to nearest, ties away: cvt.rna), as an f32: cvt.rna.tf32.f32 clears the low
// 13 bits, so a stored operand is exact for the tensor cores and rounding it again changes nothing.
__device__ __forceinline__ float tf32r(float x) { return __uint_as_float(tf32(x)); }

// Byte offsets of this lane's ldmatrix row for the first k step of a warp product (below): A
// rows r0.. of a row-major [m][k] tile; B columns n0.. of an n-major [n][k] tile (stride ld floats).
__device__ __forceinline__ unsigned mma_a_lane(int r0, int ld) {
    int lane = threadIdx.x & 31;
    return ((r0 + (lane & 15)) * ld + 4 * (lane >> 4)) * 4;
}
__device__ __forceinline__ unsigned mma_b_lane(int n0, int ld) {
    int lane = threadIdx.x & 31;
    return ((n0 + (lane & 7) + 8 * (lane >> 4)) * ld + 4 * ((lane >> 3) & 1)) * 4;
}

// Warp-level TF32 product on TF32-rounded f32 shared-memory tiles: acc[MI][NT] (rows r0 + 16 mi..,
// columns n0..n0+8NT) += X[rows, :K] Y[cols, :K]^T, X row-major with stride LDX floats and Y
// n-major with stride LDY; xa = smem(X) + mma_a_lane(r0, LDX), yb = smem(Y) + mma_b_lane(n0, LDY).
// For m16n8k8 TF32 an ldmatrix.x4 (b16) of f32 rows gives a lane row lane / 4 and f32 column
// lane % 4 of each 8x4 f32 matrix, which is the A fragment (rows +0/+8 x columns +0/+4) and two
// n-tiles' B fragments (columns +0/+4); NT is even.
template <int MI, int NT, int K, int LDX, int LDY>
__device__ __forceinline__ void warp_mma_xyt(float (*acc)[NT][4], unsigned xa, unsigned yb) {
    static_assert(NT % 2 == 0, "B fragments come two n-tiles per ldmatrix");
    // Fragments of k step s + 1 are loaded before the products of step s (two register sets).
    unsigned a[2][MI][4], b[2][NT / 2][4];
    auto load = [&](int s, int k0) {
#pragma unroll
        for (int mi = 0; mi < MI; mi++) ldsm_x4(a[s][mi], xa + (mi * 16 * LDX + k0) * 4);
#pragma unroll
        for (int p = 0; p < NT / 2; p++) ldsm_x4(b[s][p], yb + (p * 16 * LDY + k0) * 4);
    };
    load(0, 0);
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 8) {
        const int s = (k0 / 8) & 1;
        if (k0 + 8 < K) load(s ^ 1, k0 + 8);
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) mma_tf32(acc[mi][nt], a[s][mi], b[s][nt / 2][2 * (nt & 1)], b[s][nt / 2][2 * (nt & 1) + 1]);
    }
}

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

// Calls f(row, col, v0, v1) for every pair of adjacent accumulator elements (col, col + 1).
template <int NT, typename F> __device__ __forceinline__ void each_acc2(float (*acc)[4], int r0, int n0, F f) {
    int lane = threadIdx.x & 31, g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) f(r0 + g + 8 * hf, n0 + nt * 8 + c2, acc[nt][2 * hf], acc[nt][2 * hf + 1]);
}

// Grid: (chunks, value_heads), 256 threads, dynamic shared memory (3 * 64 * GLD + 2 * 64 * GLA +
// 2 * 64) floats. Outputs per (chunk, head) ch = chunk * value_heads + head: wq + ch * 128 * 128
// (W and Q', TF32), kt + ch * 128 * 64 (K~^T, TF32), uo + ch * 128 * DV (U and O0, f32), decay[ch].
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
            kt[ch * GDK * GC + idx] = tf32r(kv * expf(c_last - cum[j]));
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
    each_acc<8>(accw[0], r0, half * 64, [&](int i, int d, float val) { ks[i * GLD + d] = wq_ch[i * GDK + d] = tf32r(val); });
    each_acc<DV / 16>(accu[0], r0, half * DV / 2, [&](int i, int d, float val) { vs[i * LV + d] = uo_ch[i * DV + d] = val; });
    __syncthreads();

    // Q' = q exp(c) - QK W and O0 = QK U.
    zero_acc<8>(accw[0]);
    zero_acc<DV / 16>(accu[0]);
    warp_mma_tf32<1, 8, GC, false>(accw, qk, GLA, ks, GLD, r0, half * 64);
    warp_mma_tf32<1, DV / 16, GC, false>(accu, qk, GLA, vs, LV, r0, half * DV / 2);
    each_acc<8>(accw[0], r0, half * 64,
                [&](int i, int d, float val) { wq_ch[(GC + i) * GDK + d] = tf32r(qs[i * GLD + d] * expf(cum[i]) - val); });
    each_acc<DV / 16>(accu[0], r0, half * DV / 2, [&](int i, int d, float val) { uo_ch[(GC + i) * DV + d] = val; });
}

#define GS_BV 32   // value columns per scan block
#define GS_LD 132  // row stride of [W; Q'] and S^T
#define GS_LK 68   // row stride of K~^T and v'^T

// Grid: (value_heads, DV / 32), 256 threads, dynamic shared memory (2 * 128 * GS_LD + 2 * 128 *
// GS_LK + 32 * GS_LD + 32 * GS_LK) floats: [W; Q'] and K~^T of two chunks (the next one's copy
// overlaps this one's work), S^T and v'^T (n-major, so that they are ldmatrix B operands).
// Reads and updates state[h][:, v0:v0+32]. Warp w owns rows 32 (w % 4) and columns 16 (w / 4) of
// both products: warps 0, 1, 4, 5 make v' = U - W S, warps 2, 3, 6, 7 the outputs Q' S + O0, and
// each keeps its 32 x 16 part of S in accumulators across the chunks. W, Q' and K~^T come
// TF32-rounded from gdn_chunk_prep; S and v' are rounded where they are stored.
template <int DV>
__device__ __forceinline__ void gdn_chunk_scan(bf16* out, float* state, const float* wq, const float* kt, const float* uo,
                                               const float* decay, int t, int value_heads) {
    extern __shared__ __align__(16) float gs_sh[];
    const unsigned s_wq = smem_addr(gs_sh), s_kt = s_wq + 2 * 2 * GC * GS_LD * 4, s_st = s_kt + 2 * GDK * GS_LK * 4;
    float* sts = gs_sh + 2 * 2 * GC * GS_LD + 2 * GDK * GS_LK;  // S^T [32][GS_LD]
    float* vpt = sts + GS_BV * GS_LD;                          // v'^T [32][GS_LK]
    const unsigned s_vp = s_st + GS_BV * GS_LD * 4;
    int h = blockIdx.x, v0 = blockIdx.y * GS_BV, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, c2 = (lane & 3) * 2, r0 = (warp & 3) * 32, n0 = (warp >> 2) * 16;
    int chunks = (t + GC - 1) / GC;
    float* st = state + (long long)h * GDK * DV + v0;
    // ldmatrix lane addresses: A tiles (rows r0.., first k step) and B tiles (columns n0..).
    const unsigned a_wq = s_wq + mma_a_lane(r0, GS_LD), a_kt = s_kt + mma_a_lane(r0, GS_LK);
    const unsigned b_st = s_st + mma_b_lane(n0, GS_LD), b_vp = s_vp + mma_b_lane(n0, GS_LK);

    // Chunk c's [W; Q'] and K~^T into buffer c % 2: 16 + 8 copies of 16 bytes per thread.
    auto load = [&](int c) {
        long long ch = (long long)c * value_heads + h;
        const float* w_src = wq + ch * 2 * GC * GDK + tid * 4;  // row tid / 32 + 8 i, chunk tid % 32
        const float* k_src = kt + ch * GDK * GC + tid * 4;      // row tid / 16 + 16 i, chunk tid % 16
        unsigned w_dst = s_wq + (c & 1) * 2 * GC * GS_LD * 4 + ((tid >> 5) * GS_LD + (tid & 31) * 4) * 4;
        unsigned k_dst = s_kt + (c & 1) * GDK * GS_LK * 4 + ((tid >> 4) * GS_LK + (tid & 15) * 4) * 4;
#pragma unroll
        for (int i = 0; i < 16; i++) cp_async16(w_dst + i * 8 * GS_LD * 4, w_src + i * 1024, true);
#pragma unroll
        for (int i = 0; i < 8; i++) cp_async16(k_dst + i * 16 * GS_LK * 4, k_src + i * 1024, true);
    };
    // This thread's U / O0 pairs (rows r0 + 16 mi + g + 8 hf, columns n0 + 8 nt + c2) of chunk c.
    auto load_uo = [&](int c, float2 (*u)[2][2]) {
        const float* src = uo + ((long long)c * value_heads + h) * 2 * GC * DV + v0;
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++)
                    u[mi][nt][hf] = *(const float2*)(src + (r0 + 16 * mi + g + 8 * hf) * DV + n0 + 8 * nt + c2);
    };
    // S (accumulators) -> S^T in shared memory, TF32-rounded.
    float sacc[2][2][4];
    auto store_st = [&]() {
#pragma unroll
        for (int mi = 0; mi < 2; mi++) each_acc<2>(sacc[mi], r0 + 16 * mi, n0, [&](int r, int col, float val) { sts[col * GS_LD + r] = tf32r(val); });
    };

    load(0);
    cp_async_commit();
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float2 s = *(const float2*)(st + (r0 + 16 * mi + g + 8 * hf) * DV + n0 + 8 * nt + c2);
                sacc[mi][nt][2 * hf] = s.x;
                sacc[mi][nt][2 * hf + 1] = s.y;
            }
    store_st();
    float2 u[2][2][2];
    load_uo(0, u);
    float dec = decay[h];

    for (int c = 0; c < chunks; c++) {
        cp_async_wait<0>();
        __syncthreads();  // chunk c is in, S^T is complete; every warp is done with chunk c - 1
        if (c + 1 < chunks) load(c + 1);
        cp_async_commit();
        int s0 = c * GC, len = min(GC, t - s0);
        // [W; Q'] S.
        float x[2][2][4];
        zero_acc<2>(x[0]);
        zero_acc<2>(x[1]);
        warp_mma_xyt<2, 2, GDK, GS_LD, GS_LD>(x, a_wq + (c & 1) * 2 * GC * GS_LD * 4, b_st);
        if (r0 < GC) {  // v' = U - W S
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        int r = r0 + 16 * mi + g + 8 * hf, col = n0 + 8 * nt + c2;
                        vpt[col * GS_LK + r] = tf32r(u[mi][nt][hf].x - x[mi][nt][2 * hf]);
                        vpt[(col + 1) * GS_LK + r] = tf32r(u[mi][nt][hf].y - x[mi][nt][2 * hf + 1]);
                    }
        } else {  // o = Q' S + O0
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        int r = r0 - GC + 16 * mi + g + 8 * hf;
                        if (r < len) {
                            unsigned o = pack_bf16(x[mi][nt][2 * hf] + u[mi][nt][hf].x, x[mi][nt][2 * hf + 1] + u[mi][nt][hf].y);
                            *(unsigned*)(out + ((long long)(s0 + r) * value_heads + h) * DV + v0 + n0 + 8 * nt + c2) = o;
                        }
                    }
        }
        float d = dec;
        if (c + 1 < chunks) {  // the next chunk's U / O0 and decay, in flight during the update
            load_uo(c + 1, u);
            dec = decay[(long long)(c + 1) * value_heads + h];
        }
        __syncthreads();  // v'^T is complete; every warp is done reading S^T
        // S = exp(c_L) S + K~^T v'.
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) sacc[mi][nt][e] *= d;
        warp_mma_xyt<2, 2, GC, GS_LK, GS_LK>(sacc, a_kt + (c & 1) * GDK * GS_LK * 4, b_vp);
        store_st();
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                *(float2*)(st + (r0 + 16 * mi + g + 8 * hf) * DV + n0 + 8 * nt + c2) = make_float2(sacc[mi][nt][2 * hf], sacc[mi][nt][2 * hf + 1]);
}

#define GDN_KERNELS(DV)                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep_v##DV(                                                         \
        float* wq, float* kt, float* uo, float* decay, const bf16* q, const bf16* k, const bf16* v, const bf16* a, const bf16* b,     \
        const void* a_log, int a_log_dt, const void* dt_bias, int dt_bias_dt, int t, int key_heads, int value_heads, float qmul) {   \
        gdn_chunk_prep<DV>(wq, kt, uo, decay, q, k, v, a, b, a_log, a_log_dt, dt_bias, dt_bias_dt, t, key_heads, value_heads, qmul); \
    }                                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan_v##DV(bf16* out, float* state, const float* wq, const float* kt, \
                                                                            const float* uo, const float* decay, int t,              \
                                                                            int value_heads) {                                       \
        gdn_chunk_scan<DV>(out, state, wq, kt, uo, decay, t, value_heads);                                                           \
    }
GDN_KERNELS(64)
GDN_KERNELS(128)
