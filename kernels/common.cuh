// Shared prelude of every kernels/*.cu file: vt-cuda (and tools/gpu/check_kernels.py) compile
// each file as `common.cuh` + the file, so no file needs an include path or the CUDA headers.
//
// Storage: activations are bf16 (raw `unsigned short`), accumulation is f32. Small weights
// (norms, conv taps, biases) come in their stored dtype, read through `ld`.
//
// Numbers the kernels share with vt-cuda (the dtype codes DT_*, SEQ_MAX, ROUTE_MAX_*, GEMV_*, ...)
// are not defined here or in any kernel file: vt-cuda passes each as `-D NAME=value`, from its one
// source, crates/vt-cuda/src/limits.rs.

typedef unsigned short bf16;
typedef unsigned long long u64;

// Values of a row each of a row kernel's 256 threads keeps in registers (rows of up to 4096; longer
// rows re-read the rest). The row kernels issue every load of the kept part before any store: a
// store could alias an input as far as the compiler knows, so interleaving them would serialise
// one memory latency per value (docs/performance.md).
#define NORM_KEEP 16

// Per-sequence values of a batched decode kernel (one token of each of up to SEQ_MAX sequences),
// passed by value: device addresses of each sequence's state.
struct SeqPtrs { u64 p[SEQ_MAX]; };

// Sequence z's address: from `at` where it is not null (device memory a recorded step's replays
// fill), else the launch's own.
__device__ __forceinline__ u64 seq_ptr(const SeqPtrs& ptrs, const u64* at, int z) { return at ? at[z] : ptrs.p[z]; }

__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned)h) << 16); }

// Round to nearest even, NaN stays NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float f16tof(unsigned short h) {
    unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
    if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        float m = (float)mant * 5.9604644775390625e-8f;  // 2^-24
        return sign ? -m : m;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Element `i` of a float tensor stored as f32, bf16 or f16.
__device__ __forceinline__ float ld(const void* p, int dt, long long i) {
    if (dt == DT_BF16) return bf2f(((const bf16*)p)[i]);
    if (dt == DT_F16) return f16tof(((const unsigned short*)p)[i]);
    return ((const float*)p)[i];
}

__device__ __forceinline__ float e2m1(unsigned code) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float m = mag[code & 7u];
    return (code & 8u) ? -m : m;
}

// fp8 e4m3fn: bias 7, subnormals at exponent 0, NaN at S.1111.111, no infinity.
__device__ __forceinline__ float f8e4m3(unsigned char b) {
    unsigned e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 15u && m == 7u) v = __int_as_float(0x7fc00000);
    else if (e == 0u) v = (float)m * 0.001953125f;  // m/8 * 2^-6
    else v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---- Programmatic dependent launch (sm_90): a kernel launched with vt-cuda's `Overlapped`
// (launch.rs) may start while the previous kernel on the stream is finishing. Before
// `grid_dep_wait` it may only read what no kernel writes (weights); the wait returns once the
// previous kernel has finished and its writes are visible. Some block of every launch must wait,
// so that a kernel's end still means its predecessors' ends. `grid_dep_trigger` lets the next such
// kernel start early. Both are no-ops in a kernel launched the ordinary way.
__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_dep_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }
// The wait, then the trigger: the next kernel starts only once every block of this one has waited,
// so the kernel before this one has ended, and before its own wait the next kernel may also read
// (through L2: __ldcg) what that one wrote (moe_decode.cu's down kernels read the routing so).
__device__ __forceinline__ void grid_dep_wait_then_trigger() {
    grid_dep_wait();
    grid_dep_trigger();
}
// The first statement of an overlapped kernel that reads nothing before its predecessor ends: the
// next kernel may launch (and start its own weight loads) while this one runs.
__device__ __forceinline__ void grid_dep_begin() {
    grid_dep_trigger();
    grid_dep_wait();
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Max (or sum) over the block of one value per thread (blockDim.x a multiple of 32); every
// thread gets the result. red: 32 floats of shared memory.
template <bool MAX> __device__ float block_reduce(float v, float* red) {
    v = MAX ? warp_max(v) : warp_sum(v);
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : (MAX ? __int_as_float(0xff800000) : 0.0f);
    return MAX ? warp_max(v) : warp_sum(v);
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float red[32];
    return block_reduce<false>(v, red);
}

// One matrix `[n, k]` in its stored form; mirrors vt-cuda's `WeightDesc` (#[repr(C)]).
// NVFP4: `data` holds e2m1 codes and `scales` one fp8 e4m3 per 16 inputs, both in the tiled
// layout of nvfp4.cuh; every row is scaled by `global[0]`.
// FP8: `data` holds e4m3 values, `scales` one f32 per block of `block[0]` rows and `block[1]`
// inputs, ceil(k / block[1]) a scale row (the last block of a dimension may be partial).
struct WeightDesc {
    u64 data;
    u64 scales;
    // NVFP4: the per-tensor multiplier in global[0]. FP8 has none: the slots hold its block, rows
    // and inputs per scale. Sharing them keeps the struct at 32 bytes, which the decode kernels'
    // shared-memory tables and occupancy are sized for.
    union {
        float global[2];
        int block[2];
    };
    int kind;
    int k;
};

// The bit of an NVFP4 code word (nvfp4.cuh's layout) that holds element e's sign: bit 7 of byte e
// for e < 4, bit 3 of byte e - 4 for the others (its magnitude is bits 4e .. 4e + 2).
__device__ __forceinline__ int nv4_sign_bit(int e) { return e < 4 ? 8 * e + 7 : 8 * (e - 4) + 3; }

// Weight element (row, j) as f32, for a weight of kind KIND.
template <int KIND> __device__ __forceinline__ float w_at(const WeightDesc& w, long long row, int j) {
    if constexpr (KIND == DT_NVFP4) {
        // Tile (row / 16, j / 64) of nvfp4.cuh's layout; in it, step s, lane 4 g + c, element e.
        long long tile = (row >> 4) * ((w.k + NV4_K - 1) / NV4_K) + j / NV4_K;
        int r = row & 15, g = r & 7, h = r >> 3, jj = j % NV4_K, s = jj >> 4, kk = jj & 15;
        int c = (kk >> 1) & 3, e = 4 * h + 2 * (kk >> 3) + (kk & 1);
        unsigned word = ((const unsigned*)w.data)[tile * (NV4_ROWS * NV4_K / 8) + (4 * g + c) * 4 + s];
        unsigned code = ((word >> (4 * e)) & 7u) | (((word >> nv4_sign_bit(e)) & 1u) << 3);
        unsigned char sc = ((const unsigned char*)w.scales)[tile * (NV4_ROWS * NV4_K / 16) + 8 * g + 4 * h + s];
        return e2m1(code) * (f8e4m3(sc) * w.global[0]);
    } else if constexpr (KIND == DT_FP8) {
        // The f32 product transformers dequantizes to (and vt-cpu computes).
        int scale_cols = (w.k + w.block[1] - 1) / w.block[1];
        float s = ((const float*)w.scales)[(row / w.block[0]) * scale_cols + j / w.block[1]];
        return f8e4m3(((const unsigned char*)w.data)[row * w.k + j]) * s;
    } else {
        return ld((const void*)w.data, KIND, row * (long long)w.k + j);
    }
}

// Dot of weight row `row` with the f32 vector `x` across one warp (lane l takes j = l + 32 i, in
// order); all lanes get it. Each lane has 8 weight loads in flight before their products: one at
// a time, a row of 2048 paid 64 round trips to memory.
template <int KIND> __device__ float warp_row_dot_of(const WeightDesc& w, long long row, const float* x) {
    float acc = 0.0f;
    int j = threadIdx.x & 31;
    for (; j + 32 * 7 < w.k; j += 32 * 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = w_at<KIND>(w, row, j + 32 * u);
#pragma unroll
        for (int u = 0; u < 8; u++) acc += v[u] * x[j + 32 * u];
    }
    for (; j < w.k; j += 32) acc += w_at<KIND>(w, row, j) * x[j];
    return warp_sum(acc);
}

__device__ float warp_row_dot(const WeightDesc& w, long long row, const float* x) {
    switch (w.kind) {
        case DT_BF16: return warp_row_dot_of<DT_BF16>(w, row, x);
        case DT_F16: return warp_row_dot_of<DT_F16>(w, row, x);
        case DT_NVFP4: return warp_row_dot_of<DT_NVFP4>(w, row, x);
        case DT_FP8: return warp_row_dot_of<DT_FP8>(w, row, x);
        default: return warp_row_dot_of<DT_F32>(w, row, x);
    }
}

// ---- Tensor-core building blocks (sm_80+): cp.async, ldmatrix, mma.sync ----
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k8"): with g = lane / 4
// and c = lane % 4, a thread holds C/D elements (g, 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1).

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, bypassing L1; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// The block's threads issue n contiguous 16-byte copies, all in flight at once (a load-then-store
// loop would wait on L2 once an iteration); the caller commits them.
__device__ __forceinline__ void cp_async_block(void* dst, const void* src, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) cp_async16(smem_addr((uint4*)dst + i), (const uint4*)src + i, true);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// A STAGES-deep cp.async pipeline over kt_n k-tiles: load(stage, kt) issues tile kt's copies into
// shared-memory stage `stage`; compute(stage) consumes a stage once its copies have landed. Every
// thread of the block calls it (it synchronises the block).
template <int STAGES, typename Load, typename Compute>
__device__ __forceinline__ void cp_async_pipeline(int kt_n, Load load, Compute compute) {
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < kt_n) load(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < kt_n; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage kt is in; every warp is done with the stage refilled next
        if (kt + STAGES - 1 < kt_n) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_async_commit();
        compute(kt % STAGES);
    }
    cp_async_wait<0>();
}

// Byte offset of 16-byte chunk `ch` of row `r` in a shared tile with D bf16 columns (D >= 64),
// rows XOR-swizzled in 16-byte chunks so that ldmatrix is conflict-free (flash_attn.cu,
// attn_decode.cu).
template <int D> __device__ __forceinline__ unsigned fa_swz(int r, int ch) { return r * D * 2 + ((ch ^ (r & 7)) << 4); }

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c += a (16x16 bf16, row) * b (16x8 bf16, col), f32 accumulation. Not volatile: a pure register
// op the compiler may schedule between the (volatile, memory-reading) ldmatrix loads.
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a (16x8 tf32, row) * b (8x8 tf32, col), f32 accumulation.
__device__ __forceinline__ void mma_tf32(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// Two floats as a bf16 pair, `lo` in the low half (the lower column of a fragment); rounded to
// nearest even as f2bf does, in one instruction.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---- 16-byte loads of bf16 rows (decode kernels: gemv.cu, attn_decode.cu) ----

// 16 bytes of weights, streamed (not kept in L1: each is read once per step).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void bf16x2(unsigned u, float& lo, float& hi) {
    lo = __uint_as_float(u << 16);
    hi = __uint_as_float(u & 0xffff0000u);
}

// x[0..8) as f32, from bf16 activations or f32 intermediates.
__device__ __forceinline__ void load_x8(const bf16* x, float* f) {
    uint4 v = *(const uint4*)x;
    bf16x2(v.x, f[0], f[1]); bf16x2(v.y, f[2], f[3]); bf16x2(v.z, f[4], f[5]); bf16x2(v.w, f[6], f[7]);
}
__device__ __forceinline__ void load_x8(const float* x, float* f) {
    float4 a = *(const float4*)x, b = *(const float4*)(x + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
