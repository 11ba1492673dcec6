// Which calls, made by another thread, invalidate a step capture open on the same device: one
// thread captures in relaxed mode (as vt-cuda's recorder does), another makes the call named on
// the command line, and the first ends its capture (docs/architecture.md, "The invariant").
// Run on the GPU machine (nvcc is there):
//   nvcc -O1 -o /tmp/capture_probe tools/gpu/capture_probe.c -lcuda -lcublasLt -lpthread
//   for op in $(/tmp/capture_probe); do /tmp/capture_probe $op; done
// (with no argument it lists the ops: the branches of `other` below).
#include <cuda.h>
#include <cublasLt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x) do { CUresult r_ = (x); if (r_) { const char* s; cuGetErrorName(r_, &s); printf("  [%s] %s -> %s\n", op, #x, s); } } while (0)

static const char* op;
static CUdevice dev;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int phase = 0;
static const char* PTX =
  ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k() { ret; }\n";

static void wait_phase(int p) { pthread_mutex_lock(&mu); while (phase < p) pthread_cond_wait(&cv, &mu); pthread_mutex_unlock(&mu); }
static void set_phase(int p) { pthread_mutex_lock(&mu); phase = p; pthread_cond_broadcast(&cv); pthread_mutex_unlock(&mu); }

static void* other(void* _) {
  CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUmodule m = 0; CUfunction f = 0; CUdeviceptr p = 0, q = 0; CUstream s2 = 0;
  CUgraph g = 0; CUgraphExec ge = 0; cublasLtHandle_t lt = 0;
  char host[4096];
  if (!strcmp(op, "module_unload") || !strcmp(op, "func_attr") || !strcmp(op, "launch")) {
    CK(cuModuleLoadData(&m, PTX)); CK(cuModuleGetFunction(&f, m, "k"));
  }
  if (!strcmp(op, "mem_free") || !strcmp(op, "memcpy_htod_sync") || !strcmp(op, "memcpy_htod_async") || !strcmp(op, "memcpy_dtoh_async"))
    CK(cuMemAlloc(&p, 1 << 20));
  if (!strcmp(op, "stream_destroy")) CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  if (!strcmp(op, "graph_instantiate") || !strcmp(op, "graph_launch") || !strcmp(op, "graph_exec_destroy") || !strcmp(op, "graph_destroy")) {
    CK(cuMemAlloc(&q, 1 << 20));
    CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    CK(cuMemsetD32Async(q, 7, 1 << 18, s));
    CK(cuStreamEndCapture(s, &g));
    if (strcmp(op, "graph_instantiate")) CK(cuGraphInstantiate(&ge, g, 0));
  }
  if (!strcmp(op, "cublaslt_destroy")) { if (cublasLtCreate(&lt)) printf("  lt create failed\n"); }
  set_phase(1);
  wait_phase(2);
  if (!strcmp(op, "none")) {}
  else if (!strcmp(op, "module_load")) { CK(cuModuleLoadData(&m, PTX)); }
  else if (!strcmp(op, "module_unload")) { CK(cuModuleUnload(m)); }
  else if (!strcmp(op, "func_attr")) { CK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100000)); }
  else if (!strcmp(op, "launch")) { CK(cuLaunchKernel(f, 1,1,1, 32,1,1, 0, s, NULL, NULL)); CK(cuStreamSynchronize(s)); }
  else if (!strcmp(op, "mem_alloc")) { CK(cuMemAlloc(&p, 64 << 20)); }
  else if (!strcmp(op, "mem_free")) { CK(cuMemFree(p)); }
  else if (!strcmp(op, "alloc_async")) { CK(cuMemAllocAsync(&p, 64 << 20, s)); CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s)); }
  else if (!strcmp(op, "stream_create")) { CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING)); }
  else if (!strcmp(op, "stream_destroy")) { CK(cuStreamDestroy(s2)); }
  else if (!strcmp(op, "stream_sync")) { CK(cuStreamSynchronize(s)); }
  else if (!strcmp(op, "ctx_sync")) { CK(cuCtxSynchronize()); }
  else if (!strcmp(op, "memcpy_htod_sync")) { CK(cuMemcpyHtoD(p, host, sizeof host)); }
  else if (!strcmp(op, "memcpy_htod_async")) { CK(cuMemcpyHtoDAsync(p, host, sizeof host, s)); CK(cuStreamSynchronize(s)); }
  else if (!strcmp(op, "memcpy_dtoh_async")) { CK(cuMemcpyDtoHAsync(host, p, sizeof host, s)); CK(cuStreamSynchronize(s)); }
  else if (!strcmp(op, "mem_get_info")) { size_t a, b; CK(cuMemGetInfo(&a, &b)); }
  else if (!strcmp(op, "primary_retain_release")) { CUcontext c2; CK(cuDevicePrimaryCtxRetain(&c2, dev)); CK(cuDevicePrimaryCtxRelease(dev)); }
  else if (!strcmp(op, "event")) { CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING)); CK(cuEventRecord(e, s)); CK(cuEventSynchronize(e)); CK(cuEventDestroy(e)); }
  else if (!strcmp(op, "graph_capture")) {
    CK(cuMemAlloc(&q, 1 << 20)); CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    CK(cuMemsetD32Async(q, 7, 1 << 18, s)); CK(cuStreamEndCapture(s, &g)); }
  else if (!strcmp(op, "graph_instantiate")) { CK(cuGraphInstantiate(&ge, g, 0)); }
  else if (!strcmp(op, "graph_launch")) { CK(cuGraphLaunch(ge, s)); CK(cuStreamSynchronize(s)); }
  else if (!strcmp(op, "graph_exec_destroy")) { CK(cuGraphExecDestroy(ge)); }
  else if (!strcmp(op, "graph_destroy")) { CK(cuGraphDestroy(g)); }
  else if (!strcmp(op, "cublaslt_create")) { if (cublasLtCreate(&lt)) printf("  lt create failed\n"); }
  else if (!strcmp(op, "cublaslt_destroy")) { if (cublasLtDestroy(lt)) printf("  lt destroy failed\n"); }
  else if (!strcmp(op, "pool_trim")) { CUmemoryPool pool; CK(cuDeviceGetDefaultMemPool(&pool, dev)); CK(cuMemPoolTrimTo(pool, 0)); }
  else printf("  unknown op %s\n", op);
  set_phase(3);
  return NULL;
}

static const char* OPS =
  "none module_load module_unload func_attr launch mem_alloc mem_free alloc_async stream_create stream_destroy "
  "stream_sync ctx_sync memcpy_htod_sync memcpy_htod_async memcpy_dtoh_async mem_get_info primary_retain_release "
  "event graph_capture graph_instantiate graph_launch graph_exec_destroy graph_destroy cublaslt_create "
  "cublaslt_destroy pool_trim";

int main(int argc, char** argv) {
  if (argc < 2) { puts(OPS); return 0; }
  op = argv[1];
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0));
  CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr b; CK(cuMemAlloc(&b, 1 << 20));
  pthread_t t; pthread_create(&t, NULL, other, NULL);
  wait_phase(1);
  CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  CK(cuMemsetD32Async(b, 1, 1 << 18, s));
  set_phase(2);
  wait_phase(3);
  CK(cuMemsetD32Async(b, 2, 1 << 18, s));
  CUstreamCaptureStatus st; CK(cuStreamIsCapturing(s, &st));
  CUgraph g = 0; CUresult r = cuStreamEndCapture(s, &g);
  const char* name; cuGetErrorName(r, &name);
  printf("%-24s status after other: %s  end capture: %s\n", op,
         st == CU_STREAM_CAPTURE_STATUS_ACTIVE ? "active" : st == CU_STREAM_CAPTURE_STATUS_INVALIDATED ? "INVALIDATED" : "none", name);
  pthread_join(t, NULL);
  return 0;
}
