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
// Every tensor-core operand is rounded to TF32 once, where it is stored (tf32r), and read with
// ldmatrix: W, Q' and K~^T leave prep rounded (the scan only multiplies them), U and O0 leave it
// in full f32 (the scan adds them). The products are those of rounding at every read.

// GC: tokens per chunk; GDK: key dim.
#define GLD 132  // row stride (floats) of [64][128] tiles: ldmatrix rows hit distinct banks
#define GLA 68   // row stride of [.][64] tiles

// x rounded to TF32 (to nearest, ties away: cvt.rna), as an f32: cvt.rna.tf32.f32 clears the low
// 13 bits, so a stored operand is exact for the tensor cores and rounding it again changes nothing.
__device__ __forceinline__ float tf32r(float x) { return __uint_as_float(tf32(x)); }

// keep ? x : 0 without a branch (the masked-off x may be inf or NaN; it is computed either way).
__device__ __forceinline__ float keep_if(bool keep, float x) { return __uint_as_float(__float_as_uint(x) & (keep ? ~0u : 0u)); }

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

// A is stored in shared memory with its columns permuted, j -> a_perm(j): column class q = j % 4
// at 16 q + 4 (q / 2) (columns j = 4 m + q at + m), so that a thread of class q reads its row's
// terms with 16-byte loads, and the four classes' 16-byte chunks of a row hit distinct banks.
__device__ __forceinline__ int a_perm(int j) { return 16 * (j & 3) + 4 * ((j >> 1) & 1) + (j >> 2); }

// Column col of T = (I + A)^-1 by forward substitution, four threads per column (consecutive
// lanes, q = lane % 4): x[i] = T[i][col] = (i == col) - ((p0 + p1) + (p2 + p3)) with p_q the
// fused multiply-add sum, j ascending, of A[i][j] x[j] over j < i, j % 4 == q. Thread q forms p_q
// and keeps xm[m] = x[4 m + q]; xor shuffles give every thread of the four (p0 + p1) + (p2 + p3),
// added in that pairing (f32 addition is commutative, so all four lanes get the same bits).
// That is bit for bit the one-thread-per-column loop with p[j & 3] += A[i][j] x[j].
// The terms j = 4 m + q >= i that a row's last m adds are A[i][j] x[j] = (+0)(+0): A is +0 on and
// above the diagonal and x[j] is still +0. A p_q is never -0 (it starts +0, and an exactly zero
// fused sum is +0 unless both parts are -0), so adding a zero leaves it unchanged. For a warp whose
// columns are all >= J0 (J0 a multiple of 16), x[j] = +0 for j < J0 (rows before col give 0 - (+0)),
// so rows i < J0 and terms j < J0 are skipped: the same bits while A is finite.
// amq = am + a_perm(q): A[i][4 m + q] is amq[i * GLA + m].
template <int J0> __device__ __forceinline__ void fwd_subst(float* xm, const float* amq, int col, int q) {
    static_assert(J0 % 16 == 0, "16-byte loads of A start at m = J0 / 4");
#pragma unroll
    for (int m = 0; m < GC / 4; m++) xm[m] = 0.0f;
#pragma unroll
    for (int i = J0; i < GC; i++) {
        float p = 0.0f;
        float4 a4;
#pragma unroll
        for (int m = J0 / 4; m < (i + 3) / 4; m++) {
            if (m % 4 == 0) a4 = *(const float4*)(amq + i * GLA + m);
            float a = m % 4 == 0 ? a4.x : m % 4 == 1 ? a4.y : m % 4 == 2 ? a4.z : a4.w;
            p = fmaf(a, xm[m], p);
        }
        // The other classes' sums, three independent shuffles (one shuffle latency on the row's
        // critical path): lane q gets p_q^1, p_q^2, p_q^3, so (p_q + p_q^1) + (p_q^2 + p_q^3) is
        // (p0 + p1) + (p2 + p3) up to the order of operands of each addition.
        float p1 = __shfl_xor_sync(0xffffffffu, p, 1), p2 = __shfl_xor_sync(0xffffffffu, p, 2), p3 = __shfl_xor_sync(0xffffffffu, p, 3);
        float s = (p + p1) + (p2 + p3);
        float xi = (i == col ? 1.0f : 0.0f) - s;
        if ((i & 3) == q) xm[i >> 2] = xi;
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

// Shared memory of gdn_chunk_prep (floats): a region R of (128 + 128) * GLA, then am and qk
// ([64][GLA] each), then cum, beta, 1/|q| and 1/|k| ([64] each). R holds q and k (TF32, [64][GLD]
// each) for A and QK, then (beta k exp(c))^T [128][GLA] and (beta v)^T [DV][GLA], then W^T and
// U^T in their place. am holds A (f32, columns permuted), then T (TF32); qk holds QK (TF32). 26368 floats, 103 KiB:
// two blocks fit an SM.
#define GP_R ((GDK + 128) * GLA)
#define GP_SHARED (GP_R + 2 * GC * GLA + 4 * GC)

// Grid: (chunks, value_heads), 256 threads, 2 blocks per SM, dynamic shared memory GP_SHARED
// floats. Outputs per (chunk, head) ch = chunk * value_heads + head: wq + ch * 128 * 128 (W and Q',
// TF32), kt + ch * 128 * 64 (K~^T, TF32), uo + ch * 128 * DV (U and O0, f32), decay[ch].
template <int DV>
__device__ __forceinline__ void gdn_chunk_prep(float* wq, float* kt, float* uo, float* decay, const bf16* q, const bf16* k, const bf16* v,
                                               const bf16* a, const bf16* b, const void* a_log, int a_log_dt, const void* dt_bias,
                                               int dt_bias_dt, int t, int key_heads, int value_heads, float qmul) {
    static_assert(DV <= 128 && GP_R >= 2 * GC * GLD, "R holds q and k, then (beta k exp(c))^T and (beta v)^T");
    extern __shared__ __align__(16) float gp_sh[];
    float *qs = gp_sh, *ks = qs + GC * GLD, *kbt = gp_sh, *vbt = gp_sh + GDK * GLA;
    float *am = gp_sh + GP_R, *qk = am + GC * GLA, *cum = qk + GC * GLA, *beta = cum + GC, *iqs = beta + GC, *iks = iqs + GC;
    const unsigned s_q = smem_addr(gp_sh), s_k = s_q + GC * GLD * 4, s_kb = s_q, s_vb = s_q + GDK * GLA * 4;
    const unsigned s_am = s_q + GP_R * 4, s_qk = s_am + GC * GLA * 4;
    int chunk = blockIdx.x, h = blockIdx.y, s0 = chunk * GC, len = min(GC, t - s0);
    int kh = h / (value_heads / key_heads), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c2 = (lane & 3) * 2;
    long long ch = (long long)chunk * value_heads + h;
    // Row r of this chunk's q or k (recomputed where used: cheaper than keeping 64-bit bases live).
    auto row = [&](const bf16* x, int r) { return x + ((long long)(s0 + r) * key_heads + kh) * GDK; };

    if (tid < GC) {
        long long ab = (long long)(s0 + tid) * value_heads + h;
        bool in = tid < len;
        float gv = in ? -expf(ld(a_log, a_log_dt, h)) * softplusf(bf2f(a[ab]) + ld(dt_bias, dt_bias_dt, h)) : 0.0f;
        beta[tid] = in ? sigmoidf(bf2f(b[ab])) : 0.0f;
        cum[tid] = gv;
    }
    // q, k l2-normalised (q also times 1/sqrt(dk)), TF32, for A and QK; rows past the chunk are
    // zero. The norms stay for the f32 uses of q and k, which re-read them.
    {
        uint2 rq[GC / 8], rk[GC / 8];
#pragma unroll
        for (int m = 0; m < GC / 8; m++) {
            int r = warp + 8 * m;
            rq[m] = rk[m] = make_uint2(0, 0);
            if (r < len) {
                rq[m] = *(const uint2*)(row(q, r) + lane * 4);
                rk[m] = *(const uint2*)(row(k, r) + lane * 4);
            }
        }
#pragma unroll
        for (int m = 0; m < GC / 8; m++) {
            int r = warp + 8 * m;
            float xq[4], xk[4], sq = 0.0f, sk = 0.0f;
            bf16x2(rq[m].x, xq[0], xq[1]);
            bf16x2(rq[m].y, xq[2], xq[3]);
            bf16x2(rk[m].x, xk[0], xk[1]);
            bf16x2(rk[m].y, xk[2], xk[3]);
            for (int i = 0; i < 4; i++) {
                sq += xq[i] * xq[i];
                sk += xk[i] * xk[i];
            }
            float iq = 1.0f / sqrtf(warp_sum(sq) + 1e-6f), ik = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
            *(float4*)(qs + r * GLD + lane * 4) = make_float4(tf32r(xq[0] * iq * qmul), tf32r(xq[1] * iq * qmul), tf32r(xq[2] * iq * qmul), tf32r(xq[3] * iq * qmul));
            *(float4*)(ks + r * GLD + lane * 4) = make_float4(tf32r(xk[0] * ik), tf32r(xk[1] * ik), tf32r(xk[2] * ik), tf32r(xk[3] * ik));
            if (lane == 0) {
                iqs[r] = iq;
                iks[r] = ik;
            }
        }
    }
    __syncthreads();

    // A (warps 0-3, from k) and QK (warps 4-7, from q): 32 x 32 tiles; warps 0 and 4 have the tile
    // above the diagonal (all zero), so thread 0 computes the cumsum meanwhile.
    {
        int mat = warp >> 2, tt = warp & 3, rb = tt >> 1, cb = rb ^ (tt & 1) ^ 1;
        float acc[2][4][4];
        zero_acc<4>(acc[0]);
        zero_acc<4>(acc[1]);
        if (cb <= rb) warp_mma_xyt<2, 4, GDK, GLD, GLD>(acc, (mat ? s_q : s_k) + mma_a_lane(32 * rb, GLD), s_k + mma_b_lane(32 * cb, GLD));
        if (tid == 0) {  // as torch's CPU cumsum: f64 accumulation, each prefix rounded to f32
            double sum = 0.0;
            for (int i = 0; i < GC; i++) {
                sum += cum[i];
                cum[i] = (float)sum;
            }
        }
        __syncthreads();  // cum is complete; every warp is done reading q and k
        // A = beta_i (k_i . k_j) G_ij below the diagonal (f32, columns permuted: a_perm), QK = (q_i .
        // k_j) G_ij on and below it (TF32, adjacent column pairs stored together).
        float* dst = mat ? qk : am;
        float cj[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            float2 cc = *(const float2*)(cum + 32 * cb + 8 * nt + c2);
            cj[nt][0] = cc.x;
            cj[nt][1] = cc.y;
        }
        auto tile = [&](auto f) {
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    int i = 32 * rb + 16 * mi + g + 8 * hf;
                    float ci = cum[i], bi = beta[i];
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) {
                        int j = 32 * cb + 8 * nt + c2;
                        float o0 = f(i, j, ci, bi, cj[nt][0], acc[mi][nt][2 * hf]);
                        float o1 = f(i, j + 1, ci, bi, cj[nt][1], acc[mi][nt][2 * hf + 1]);
                        if (mat == 0) {  // A, columns permuted for the substitution
                            dst[i * GLA + a_perm(j)] = o0;
                            dst[i * GLA + a_perm(j + 1)] = o1;
                        } else {
                            *(float2*)(dst + i * GLA + j) = make_float2(o0, o1);
                        }
                    }
                }
        };
        if (cb > rb) tile([](int, int, float, float, float, float) { return 0.0f; });  // above the diagonal
        else if (mat == 0) tile([](int i, int j, float ci, float bi, float cj, float val) { return keep_if(j < i, bi * val * expf(ci - cj)); });
        else tile([](int i, int j, float ci, float, float cj, float val) { return keep_if(j <= i, tf32r(val * expf(ci - cj))); });
    }
    __syncthreads();

    // T = (I + A)^-1 by forward substitution, four threads per column (all warps); then K~^T,
    // (beta k exp(c))^T and (beta v)^T (TF32) from k and v, one token per thread (four column
    // groups): a lane's 16-byte reads of a row are 8 columns of the transpose, stored
    // conflict-free. The k and v rows are read before the substitution, which hides their latency.
    const int tj = tid % GC, tgrp = tid / GC;  // token tj, column groups tgrp, tgrp + 4, ...
    uint4 rkv[GDK / 32 + DV / 32];
    {
        const bf16* krow = row(k, tj);
        const bf16* vrow = v + ((long long)(s0 + tj) * value_heads + h) * DV;
#pragma unroll
        for (int n = 0; n < GDK / 32; n++) rkv[n] = tj < len ? *(const uint4*)(krow + (tgrp + 4 * n) * 8) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int n = 0; n < DV / 32; n++) rkv[GDK / 32 + n] = tj < len ? *(const uint4*)(vrow + (tgrp + 4 * n) * 8) : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();  // A is complete

    float xm[GC / 4];  // T[4 m + q][col]
    {
        const int col = tid >> 2, q = tid & 3;
        const float* amq = am + a_perm(q);
        switch (warp >> 1) {  // warp w has columns 8 w.. 8 w + 7
            case 0: fwd_subst<0>(xm, amq, col, q); break;
            case 1: fwd_subst<16>(xm, amq, col, q); break;
            case 2: fwd_subst<32>(xm, amq, col, q); break;
            default: fwd_subst<48>(xm, amq, col, q); break;
        }
    }
    __syncthreads();  // every thread is done reading A
#pragma unroll
    for (int m = 0; m < GC / 4; m++) am[(4 * m + (tid & 3)) * GLA + (tid >> 2)] = tf32r(xm[m]);  // T, upper triangle zero
    {
        float c_last = cum[GC - 1], ik = iks[tj], bj = beta[tj], fj = expf(c_last - cum[tj]), ej = expf(cum[tj]);
        float* kt_j = kt + ch * GDK * GC + tj;
#pragma unroll
        for (int n = 0; n < GDK / 32; n++) {
            int dg = tgrp + 4 * n;
            float kv[8];
            bf16x2(rkv[n].x, kv[0], kv[1]);
            bf16x2(rkv[n].y, kv[2], kv[3]);
            bf16x2(rkv[n].z, kv[4], kv[5]);
            bf16x2(rkv[n].w, kv[6], kv[7]);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float kn = kv[e] * ik;
                kt_j[(dg * 8 + e) * GC] = tf32r(kn * fj);
                kbt[(dg * 8 + e) * GLA + tj] = tf32r(kn * bj * ej);
            }
        }
#pragma unroll
        for (int n = 0; n < DV / 32; n++) {
            int dg = tgrp + 4 * n;
            float vv[8];
            bf16x2(rkv[GDK / 32 + n].x, vv[0], vv[1]);
            bf16x2(rkv[GDK / 32 + n].y, vv[2], vv[3]);
            bf16x2(rkv[GDK / 32 + n].z, vv[4], vv[5]);
            bf16x2(rkv[GDK / 32 + n].w, vv[6], vv[7]);
#pragma unroll
            for (int e = 0; e < 8; e++) vbt[(dg * 8 + e) * GLA + tj] = tf32r(vv[e] * bj);
        }
        if (tid == 0) decay[ch] = expf(c_last);
    }
    __syncthreads();

    // Warp tiles of the next two steps: row blocks rb[0] = 16 (warp & 1) and rb[1] = 48 - rb[0] (16
    // rows each), W / Q' columns 32 (warp / 2), U / O0 columns DV / 4 (warp / 2). T and QK are lower
    // triangular, so row block r takes k < r + 16 only: each warp's two blocks sum to 80 of k.
    constexpr int NU = DV / 32;
    const int pair = warp & 1, nw = 32 * (warp >> 1), nu = (DV / 4) * (warp >> 1);
    const int rb[2] = {16 * pair, 48 - 16 * pair};
    float* wq_ch = wq + ch * 2 * GC * GDK;
    float* uo_ch = uo + ch * 2 * GC * DV;
    float aw[2][4][4], au[2][NU][4];
    // aw[b] += X[rb[b] rows, :K] (W^T or its source)^T, au[b] likewise with (U^T or its source).
    auto products = [&](unsigned x, unsigned yw, unsigned yu) {
        zero_acc<4>(aw[0]);
        zero_acc<4>(aw[1]);
        zero_acc<NU>(au[0]);
        zero_acc<NU>(au[1]);
        unsigned x0 = x + mma_a_lane(rb[0], GLA), x1 = x + mma_a_lane(rb[1], GLA);
        yw += mma_b_lane(nw, GLA);
        yu += mma_b_lane(nu, GLA);
        if (pair == 0) {
            warp_mma_xyt<1, 4, 16, GLA, GLA>(aw, x0, yw);
            warp_mma_xyt<1, NU, 16, GLA, GLA>(au, x0, yu);
            warp_mma_xyt<1, 4, 64, GLA, GLA>(aw + 1, x1, yw);
            warp_mma_xyt<1, NU, 64, GLA, GLA>(au + 1, x1, yu);
        } else {
            warp_mma_xyt<1, 4, 32, GLA, GLA>(aw, x0, yw);
            warp_mma_xyt<1, NU, 32, GLA, GLA>(au, x0, yu);
            warp_mma_xyt<1, 4, 48, GLA, GLA>(aw + 1, x1, yw);
            warp_mma_xyt<1, NU, 48, GLA, GLA>(au + 1, x1, yu);
        }
    };

    // W = T (beta k exp(c)), U = T (beta v).
    products(s_am, s_kb, s_vb);
#pragma unroll
    for (int bl = 0; bl < 2; bl++) {
        each_acc2<4>(aw[bl], rb[bl], nw, [&](int i, int d, float v0, float v1) { *(float2*)(wq_ch + i * GDK + d) = make_float2(tf32r(v0), tf32r(v1)); });
        each_acc2<NU>(au[bl], rb[bl], nu, [&](int i, int d, float v0, float v1) { *(float2*)(uo_ch + i * DV + d) = make_float2(v0, v1); });
    }
    __syncthreads();  // every warp is done reading (beta k exp(c))^T and (beta v)^T
#pragma unroll
    for (int bl = 0; bl < 2; bl++) {
        each_acc<4>(aw[bl], rb[bl], nw, [&](int i, int d, float val) { kbt[d * GLA + i] = tf32r(val); });
        each_acc<NU>(au[bl], rb[bl], nu, [&](int i, int d, float val) { vbt[d * GLA + i] = tf32r(val); });
    }
    __syncthreads();

    // Q' = q exp(c) - QK W and O0 = QK U; q in f32 again from its bf16 rows and norms.
    products(s_qk, s_kb, s_vb);
#pragma unroll
    for (int bl = 0; bl < 2; bl++) {
        unsigned qr[4][2];  // q[i][d, d + 1] as bf16 pairs
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                int i = rb[bl] + g + 8 * hf;
                qr[nt][hf] = i < len ? *(const unsigned*)(row(q, i) + nw + 8 * nt + c2) : 0u;
            }
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            int i = rb[bl] + g + 8 * hf;
            float iq = iqs[i], ei = expf(cum[i]);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                float x0, x1;
                bf16x2(qr[nt][hf], x0, x1);
                *(float2*)(wq_ch + (GC + i) * GDK + nw + 8 * nt + c2) =
                    make_float2(tf32r(x0 * iq * qmul * ei - aw[bl][nt][2 * hf]), tf32r(x1 * iq * qmul * ei - aw[bl][nt][2 * hf + 1]));
            }
        }
        each_acc2<NU>(au[bl], rb[bl], nu, [&](int i, int d, float v0, float v1) { *(float2*)(uo_ch + (GC + i) * DV + d) = make_float2(v0, v1); });
    }
}

// p, through an asm the compiler cannot see into (so it keeps p in registers of its own).
__device__ __forceinline__ const float* opaque_ptr(const float* p) {
    const float* r;
    asm volatile("mov.b64 %0, %1;" : "=l"(r) : "l"(p));
    return r;
}

// GS_BV: value columns per scan block.
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

    // The next chunk's [W; Q'] and K~^T (chunk c into buffer c % 2): 16 + 8 copies of 16 bytes per
    // thread. Each copy has its own source pointer, kept across the chunks and advanced at the end
    // of a chunk (advance), long after the copy has read it: a copy reads its address registers
    // late, and an instruction that overwrote them right after the copies (as the per-chunk
    // address arithmetic and the first ldmatrix did) waited for it. They advance only to chunks
    // that exist.
    const long long w_step = (long long)value_heads * 2 * GC * GDK, k_step = (long long)value_heads * GDK * GC;
    const float* w_src[16];  // row tid / 32 + 8 i, chunk tid % 32
    const float* k_src[8];   // row tid / 16 + 16 i, chunk tid % 16
    // (opaque: the compiler would otherwise derive them all from one base, with an add per copy.)
#pragma unroll
    for (int i = 0; i < 16; i++) w_src[i] = opaque_ptr(wq + (long long)h * 2 * GC * GDK + tid * 4 + i * 1024);
#pragma unroll
    for (int i = 0; i < 8; i++) k_src[i] = opaque_ptr(kt + (long long)h * GDK * GC + tid * 4 + i * 1024);
    // Likewise the destinations: w_dst, k_dst are this thread's in the buffer of the next copies,
    // flipped between the two buffers (xor w_flip, k_flip) at the end of a chunk.
    unsigned w_dst = s_wq + ((tid >> 5) * GS_LD + (tid & 31) * 4) * 4, k_dst = s_kt + ((tid >> 4) * GS_LK + (tid & 15) * 4) * 4;
    const unsigned w_flip = w_dst ^ (w_dst + 2 * GC * GS_LD * 4), k_flip = k_dst ^ (k_dst + GDK * GS_LK * 4);
    auto load = [&]() {
#pragma unroll
        for (int i = 0; i < 16; i++) cp_async16(w_dst + i * 8 * GS_LD * 4, w_src[i], true);
#pragma unroll
        for (int i = 0; i < 8; i++) cp_async16(k_dst + i * 16 * GS_LK * 4, k_src[i], true);
    };
    auto advance = [&]() {
        w_dst ^= w_flip;
        k_dst ^= k_flip;
#pragma unroll
        for (int i = 0; i < 16; i++) w_src[i] += w_step;
#pragma unroll
        for (int i = 0; i < 8; i++) k_src[i] += k_step;
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

    load();
    if (chunks > 1) advance();
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
        if (c + 1 < chunks) load();
        cp_async_commit();
        // The next chunk's decay, loaded a whole product before its first use (after the update).
        float d = dec;
        if (c + 1 < chunks) dec = decay[(long long)(c + 1) * value_heads + h];
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
        if (c + 1 < chunks) load_uo(c + 1, u);  // the next chunk's U / O0, in flight during the update
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
        if (c + 2 < chunks) advance();  // the copies of chunk c + 2, into buffer c % 2
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
        each_acc2<2>(sacc[mi], r0 + 16 * mi, n0, [&](int r, int col, float s0, float s1) { *(float2*)(st + r * DV + col) = make_float2(s0, s1); });
}

#define GDN_KERNELS(DV)                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_v##DV(                                                      \
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
