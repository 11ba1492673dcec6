// How fast one kernel launch can stream a decode layer's weights into the SMs: the floor under a
// MoE decode block's expert phase, which no arithmetic or dependency of vt's kernels can beat.
// Each case reads a MoE layer's bf16 or NVFP4 experts and router at one token (as vt-cuda's
// decode_bench counts them; the rings read its whole 32 KB items) from one of 12 buffers in turn,
// so that no read hits L2; one launch per read, 100 launches in a CUDA graph (as vt replays decode
// steps):
// - a ring of bulk copies (cp.async.bulk on mbarriers, 4 stages of 32 KB, one block per SM);
// - a ring of every thread's cp.async (4 stages of 32 KB, one block per SM);
// - register loads as vt's MoE gate/up kernel issues them (8 KB per warp, 4 rounds of 4 loads);
// - the 9 slots' down rows as vt's down kernel reads them at one token (a warp per output row, its
//   1 KB of each slot's [2048, 512] matrix), the experts drawn at random from a layer's 256 (a
//   12-layer, 6.4 GB buffer), beside the same bytes read contiguously.
// Run on the GPU machine (nvcc is there):
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/stream_bench tools/gpu/stream_bench.cu && /tmp/stream_bench
#include <cuda_runtime.h>

#include <cstdio>

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned bar) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory"); }
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes),
                 "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

const int ITEM = 32768, STAGES = 4;

// Items b, b + G, ... of `total` bytes, each one bulk copy into the next stage of the ring.
__global__ void bulk_ring(const char* src, long long total, unsigned* sink) {
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) unsigned long long full[STAGES];
    int n_items = (int)(total / ITEM), count = blockIdx.x < n_items ? (n_items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    unsigned bar0 = smem_addr(full);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbar_init(bar0 + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int k) {
        unsigned bar = bar0 + 8 * (k % STAGES);
        mbar_expect(bar, ITEM);
        bulk_copy(smem_addr(ring + (k % STAGES) * ITEM), src + (long long)(blockIdx.x + gridDim.x * k) * ITEM, ITEM, bar);
    };
    if (threadIdx.x == 0)
        for (int k = 0; k < min(count, STAGES); k++) issue(k);
    unsigned acc = 0;
    for (int k = 0; k < count; k++) {
        mbar_wait(bar0 + 8 * (k % STAGES), (k / STAGES) & 1);
        acc += ((const unsigned*)(ring + (k % STAGES) * ITEM))[threadIdx.x];
        __syncthreads();
        if (threadIdx.x == 0 && k + STAGES < count) issue(k + STAGES);
    }
    if (acc == 0x12345678u) *sink = acc;
}

// The same ring filled by every thread's 16-byte cp.async, a commit group per item.
__global__ void cp_async_ring(const char* src, long long total, unsigned* sink) {
    extern __shared__ __align__(128) char ring[];
    int n_items = (int)(total / ITEM), count = blockIdx.x < n_items ? (n_items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    auto issue = [&](int k) {
        if (k < count) {
            const char* s = src + (long long)(blockIdx.x + gridDim.x * k) * ITEM;
            for (int f = threadIdx.x; f < ITEM / 16; f += blockDim.x) cp_async16(smem_addr(ring + (k % STAGES) * ITEM + 16 * f), s + 16 * f);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    for (int k = 0; k < STAGES; k++) issue(k);
    unsigned acc = 0;
    for (int k = 0; k < count; k++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1) : "memory");
        __syncthreads();
        acc += ((const unsigned*)(ring + (k % STAGES) * ITEM))[threadIdx.x];
        __syncthreads();
        issue(k + STAGES);
    }
    if (acc == 0x12345678u) *sink = acc;
}

// Warps take 8 KB rows in turn (a gate row and an up row of vt's gate/up kernel), 4 rounds of
// 4 loads a lane.
__global__ void register_rows(const char* src, long long total, unsigned* sink) {
    int warps = gridDim.x * (blockDim.x / 32), w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    unsigned acc = 0;
    for (long long r = w; r < total / 8192; r += warps) {
        const uint4* p = (const uint4*)(src + r * 8192);
        for (int round = 0; round < 4; round++) {
            uint4 v[4];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = ld_stream(p + round * 128 + j * 32 + lane);
#pragma unroll
            for (int j = 0; j < 4; j++) acc += v[j].x ^ v[j].w;
        }
    }
    if (acc == 0x12345678u) *sink = acc;
}

// Output row w (a warp) of 9 down matrices [2048, 512] bf16, experts[0..9) of 256 in `layer`: each
// row's 1 KB of every matrix, 18 loads a lane in flight.
const int EXPERTS = 256, SLOTS = 9;
const long long DOWN = 2048LL * 512 * 2;
__global__ void expert_rows(const char* layer, const int* experts, unsigned* sink) {
    int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    uint4 v[2 * SLOTS];
#pragma unroll
    for (int k = 0; k < SLOTS; k++) {
        const uint4* row = (const uint4*)(layer + experts[k] * DOWN + w * 1024LL);
        v[2 * k] = ld_stream(row + lane);
        v[2 * k + 1] = ld_stream(row + 32 + lane);
    }
    unsigned acc = 0;
#pragma unroll
    for (int k = 0; k < 2 * SLOTS; k++) acc += v[k].x ^ v[k].w;
    if (acc == 0x12345678u) *sink = acc;
}

int main() {
    // Qwen3.5-35B-A3B at one token: router [256, 2048] + shared-expert gate [1, 2048] bf16, and
    // 8 + 1 experts of gate/up [512, 2048] and down [2048, 512], bf16 or NVFP4 (0.5 + 1/16 bytes).
    const long long bf16 = 256 * 2048 * 2 + 2048 * 2 + 9LL * 3 * 512 * 2048 * 2;
    const long long nvfp4 = 256 * 2048 * 2 + 2048 * 2 + 9LL * 3 * 512 * 2048 * 9 / 16;
    const int bufs = 12;
    char* buf;
    unsigned* sink;
    if (cudaMalloc(&buf, bf16 * bufs) != cudaSuccess || cudaMalloc(&sink, 4) != cudaSuccess) return 1;
    cudaMemset(buf, 1, bf16 * bufs);
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaFuncSetAttribute(bulk_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, ITEM * STAGES);
    cudaFuncSetAttribute(cp_async_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, ITEM * STAGES);
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    // Microseconds a launch: the best of 3 replays of a graph of 100 launches.
    auto time = [&](const char* name, long long bytes, auto launch) {
        const int reps = 100;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
        for (int i = 0; i < reps; i++) launch(buf + (i % bufs) * bf16, bytes);
        cudaStreamEndCapture(st, &g);
        cudaGraphInstantiate(&ge, g, 0);
        float best = 1e30f;
        for (int r = 0; r < 4; r++) {
            cudaEventRecord(e0, st);
            cudaGraphLaunch(ge, st);
            cudaEventRecord(e1, st);
            cudaEventSynchronize(e1);
            float ms;
            cudaEventElapsedTime(&ms, e0, e1);
            if (r > 0 && ms < best) best = ms;  // the first replay warms up
        }
        double us = best * 1000.0 / reps;
        printf("%-36s %6.1f MB  %7.2f us  %5.2f TB/s  %s\n", name, bytes / 1e6, us, bytes / us / 1e6, cudaGetErrorString(cudaGetLastError()));
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
    };
    for (long long bytes : {bf16, nvfp4}) {
        time("bulk-copy ring, 4 x 32 KB", bytes, [&](const char* s, long long n) { bulk_ring<<<sms, 256, ITEM * STAGES, st>>>(s, n, sink); });
        time("cp.async ring, 4 x 32 KB", bytes, [&](const char* s, long long n) { cp_async_ring<<<sms, 256, ITEM * STAGES, st>>>(s, n, sink); });
        int blocks = (int)(bytes / 8192 / 4);
        time("register loads, a warp per 8 KB", bytes, [&](const char* s, long long n) { register_rows<<<blocks, 128, 0, st>>>(s, n, sink); });
    }
    // The down rows: random experts against the same bytes in one run.
    char* layers;
    int* experts;
    if (cudaMalloc(&layers, bufs * EXPERTS * DOWN) != cudaSuccess || cudaMalloc(&experts, SLOTS * sizeof(int)) != cudaSuccess) return 1;
    cudaMemset(layers, 1, bufs * EXPERTS * DOWN);
    int picked[SLOTS] = {201, 7, 133, 58, 250, 19, 96, 171, 240};
    cudaMemcpy(experts, picked, sizeof picked, cudaMemcpyHostToDevice);
    long long rows = SLOTS * DOWN;
    time("down rows, 9 random experts of 256", rows, [&](const char*, long long) {
        static int layer = 0;
        expert_rows<<<2048 / 16, 512, 0, st>>>(layers + (layer++ % bufs) * EXPERTS * DOWN, experts, sink);
    });
    time("register loads, the same bytes", rows, [&](const char* s, long long n) { register_rows<<<(int)(n / 8192 / 4), 128, 0, st>>>(s, n, sink); });
    return 0;
}
