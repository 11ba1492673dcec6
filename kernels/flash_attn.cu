// Flash-style causal GQA attention for prefill (many queries per call): bf16 tensor cores for
// Q K^T and P V, online softmax in f32 (exp2 with the scale folded in), never materialising the
// score matrix. Same contract as `attention` (attention.cu): keys before `start` come from the
// cache (position p in row p, or row p % window for a sliding ring), this call's from k / v;
// kv_append runs afterwards. A query at position p sees keys p - window < j <= p (window 0: all).
//
// Block: 64 queries of one head, 4 warps of 16 query rows; key tiles of 64. Shared memory holds
// Q, one K and one V tile (bf16, rows XOR-swizzled in 16-byte chunks so ldmatrix is
// conflict-free): the V copy overlaps Q K^T and the next K copy overlaps P V.

#define FA_BM 64
#define FA_BN 64

// bf16 offset of 16-byte chunk `ch` of row `r` in a tile with D columns (D >= 64).
template <int D> __device__ __forceinline__ int fa_swz(int r, int ch) { return r * D + ((ch ^ (r & 7)) << 3); }

template <int D>
__device__ __forceinline__ void flash_attn(bf16* out, const bf16* q, const bf16* k, const bf16* v, const bf16* kc, const bf16* vc, int t,
                                           int q_heads, int kv_heads, int start, int window, float scale_log2) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
    extern __shared__ __align__(16) bf16 fa_sh[];
    bf16 *sq = fa_sh, *sk = fa_sh + FA_BM * D, *sv = sk + FA_BN * D;
    // Longest (latest) query tiles first: they have the most keys.
    int q0 = (gridDim.x - 1 - blockIdx.x) * FA_BM, h = blockIdx.y, kvh = h / (q_heads / kv_heads);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c2 = (lane & 3) * 2;
    long long kv_row = (long long)kv_heads * D;

    for (int c = tid; c < FA_BM * CH; c += 128) {
        int r = c / CH, ch = c % CH;
        bool ok = q0 + r < t;
        cp_async16(smem_addr(sq + fa_swz<D>(r, ch)), q + (ok ? ((long long)(q0 + r) * q_heads + h) * D + ch * 8 : 0), ok);
    }
    // Key positions this block can see.
    int hi = start + min(q0 + FA_BM, t) - 1;
    int lo = window > 0 ? max(0, start + q0 - window + 1) : 0;
    auto load_kv = [&](bf16* dst, const bf16* cur, const bf16* cache, int p0) {
        for (int c = tid; c < FA_BN * CH; c += 128) {
            int r = c / CH, ch = c % CH, p = p0 + r;
            const bf16* src = cur;
            bool ok = p <= hi;
            if (ok) src = p >= start ? cur + (p - start) * kv_row : cache + (long long)(window > 0 ? p % window : p) * kv_row;
            cp_async16(smem_addr(dst + fa_swz<D>(r, ch)), src + (ok ? kvh * D + ch * 8 : 0), ok);
        }
    };
    int p0 = lo / FA_BN * FA_BN;
    load_kv(sk, k, kc, p0);
    cp_async_commit();

    float o[D / 8][4];
    for (int j = 0; j < D / 8; j++)
        for (int x = 0; x < 4; x++) o[j][x] = 0.0f;
    const float neg_inf = __int_as_float(0xff800000);
    float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};
    int qpos[2] = {start + q0 + warp * 16 + g, start + q0 + warp * 16 + g + 8};

    for (; p0 <= hi; p0 += FA_BN) {
        cp_async_wait<0>();
        __syncthreads();  // K (and Q) in; every warp is done with the previous V
        load_kv(sv, v, vc, p0);
        cp_async_commit();

        float s[FA_BN / 8][4];
        for (int j = 0; j < FA_BN / 8; j++)
            for (int x = 0; x < 4; x++) s[j][x] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            unsigned a[4];
            ldsm_x4(a, smem_addr(sq + fa_swz<D>(warp * 16 + (lane & 15), ks * 2 + (lane >> 4))));
#pragma unroll
            for (int nb = 0; nb < FA_BN / 16; nb++) {
                unsigned b[4];
                ldsm_x4(b, smem_addr(sk + fa_swz<D>(nb * 16 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1))));
                mma_bf16(s[2 * nb], a, b[0], b[1]);
                mma_bf16(s[2 * nb + 1], a, b[2], b[3]);
            }
        }
        // Mask (not needed when every key of the tile is visible to every query of the block),
        // scale, online softmax per row (rows g and g + 8 of this warp; 4 lanes per row).
        bool interior = p0 + FA_BN - 1 <= start + q0 && (window == 0 || p0 > start + q0 + FA_BM - 1 - window);
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float mx = neg_inf;
#pragma unroll
            for (int j = 0; j < FA_BN / 8; j++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    float val = s[j][2 * hr + x] * scale_log2;
                    if (!interior) {
                        int p = p0 + j * 8 + c2 + x;
                        if (p > qpos[hr] || (window > 0 && p <= qpos[hr] - window)) val = neg_inf;
                    }
                    s[j][2 * hr + x] = val;
                    mx = fmaxf(mx, val);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mn = fmaxf(m[hr], mx);
            float base = mn == neg_inf ? 0.0f : mn;  // a row with nothing visible yet stays at zero
            float corr = exp2f(m[hr] - base);
            m[hr] = mn;
            l[hr] *= corr;
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                o[j][2 * hr] *= corr;
                o[j][2 * hr + 1] *= corr;
            }
#pragma unroll
            for (int j = 0; j < FA_BN / 8; j++)
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    float e = exp2f(s[j][2 * hr + x] - base);
                    s[j][2 * hr + x] = e;
                    l[hr] += e;
                }
        }
        cp_async_wait<0>();
        __syncthreads();  // V in; every warp is done with K
        if (p0 + FA_BN <= hi) load_kv(sk, k, kc, p0 + FA_BN);
        cp_async_commit();
        // O += P V: the score accumulators are already the A fragments of the next product.
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; kk++) {
            unsigned a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int db = 0; db < D / 16; db++) {
                unsigned b[4];
                ldsm_x4_trans(b, smem_addr(sv + fa_swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), db * 2 + (lane >> 4))));
                mma_bf16(o[2 * db], a, b[0], b[1]);
                mma_bf16(o[2 * db + 1], a, b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        float sum = l[hr];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        int tok = q0 + warp * 16 + g + 8 * hr;
        if (tok >= t) continue;
        float inv = 1.0f / sum;
        unsigned* dst = (unsigned*)(out + ((long long)tok * q_heads + h) * D + c2);
#pragma unroll
        for (int j = 0; j < D / 8; j++) dst[j * 4] = pack_bf16(o[j][2 * hr] * inv, o[j][2 * hr + 1] * inv);
    }
}

// Grid: (ceil(t / 64), q_heads), 128 threads, (64 + 2 * 64) * D bf16 of dynamic shared memory.
#define FA_KERNEL(D)                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) flash_attn_d##D(bf16* out, const bf16* q, const bf16* k, const bf16* v, \
                                                                      const bf16* kc, const bf16* vc, int t, int q_heads,      \
                                                                      int kv_heads, int start, int window, float scale_log2) {  \
        flash_attn<D>(out, q, k, v, kc, vc, t, q_heads, kv_heads, start, window, scale_log2);                                  \
    }
FA_KERNEL(64)
FA_KERNEL(128)
FA_KERNEL(256)
