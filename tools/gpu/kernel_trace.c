// A CUPTI injection library (tools/gpu/trace_decode.sh builds and loads it on the GPU machine):
// the driver calls InitializeInjection at cuInit when CUDA_INJECTION64_PATH names this library,
// and from then on every kernel's GPU start and end and every driver call's host start and end
// go to VT_TRACE_OUT as CSV, in one clock. Unlike ncu, the kernels run as they do in production
// (recorded steps, programmatic dependent launch overlapping neighbours), so the trace shows the
// step's real timeline: which kernel's end moves the step's end, and how long the GPU idles
// between steps while the host reads the picks back and launches the next.
//
// Records:  K,start_ns,end_ns,graph_id,grid_x,grid_y,grid_z,block_x,name
//           D,start_ns,end_ns,api_name
// KERNEL_RECORD is the newest CUpti_ActivityKernelN of the installed header (the script greps it).
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef KERNEL_RECORD
#error "build with -DKERNEL_RECORD=CUpti_ActivityKernelN (tools/gpu/trace_decode.sh)"
#endif

#define BUFFER_BYTES (16u << 20)

static FILE *trace;

static void check(CUptiResult r, const char *what) {
    if (r == CUPTI_SUCCESS) return;
    const char *msg = "?";
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "kernel_trace: %s: %s\n", what, msg);
    exit(3);
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const KERNEL_RECORD *k = (const KERNEL_RECORD *)rec;
            fprintf(trace, "K,%llu,%llu,%u,%d,%d,%d,%d,%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                    (unsigned)k->graphId, k->gridX, k->gridY, k->gridZ, k->blockX, k->name ? k->name : "?");
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
            const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)rec;
            const char *name = "?";
            cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
            fprintf(trace, "D,%llu,%llu,%s\n", (unsigned long long)a->start, (unsigned long long)a->end, name);
        }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(NULL, stream, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
    free(buffer);
}

static void finish(void) {
    cuptiActivityFlushAll(1);
    if (trace) fclose(trace);
    trace = NULL;
}

int InitializeInjection(void) {
    const char *path = getenv("VT_TRACE_OUT");
    trace = fopen(path ? path : "kernel_trace.csv", "w");
    if (!trace) {
        perror("kernel_trace: VT_TRACE_OUT");
        exit(3);
    }
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel records");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "enable driver records");
    atexit(finish);
    return 1;
}
