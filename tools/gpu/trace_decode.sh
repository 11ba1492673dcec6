#!/usr/bin/env bash
# On the GPU machine, with the folder of tools/gpu/build.sh's binaries carried: the timeline of
# `vt bench`'s recorded decode steps as they run (CUPTI activity records through
# tools/gpu/kernel_trace.c, loaded with CUDA_INJECTION64_PATH), summarized by kernel_trace.py:
# the GPU's idle time between steps and what each kernel adds to a step. ncu (profile_decode.sh)
# times each kernel alone; this keeps the overlap of programmatic dependent launch.
#   LOAD_FORMAT=dummy|dummy-nvfp4 BATCH=1 GEN_LEN=48 [SPEC=K] [KERNELS=1] bash tools/gpu/trace_decode.sh
# With SPEC=K each step verifies K drafts: the step's window then holds the recorded verification
# and the drafter's launches after it.
# The CSV and the bench's output go to $OUT (or /tmp/vt-gpu).
set -euo pipefail
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
bin=${VT_GPU_BIN:-.gpu/bin}
cfg=${DECODE_CONFIG:-tools/gpu/configs/qwen3_5_35b_a3b}
fmt=${LOAD_FORMAT:-dummy}
# CUPTI comes with the toolkit (extras/CUPTI) or with torch's nvidia wheels.
roots="/usr/local/cuda/ $(python3 -c 'import nvidia; print(*nvidia.__path__)' 2>/dev/null || true)"
header=$(find $roots -name cupti.h -path '*include*' 2>/dev/null | head -1)
[ -n "$header" ] || { echo "trace_decode: no cupti.h under $roots" >&2; exit 2; }
inc=$(dirname "$header")
cupti=$(find $roots -name 'libcupti.so*' 2>/dev/null | sort | head -1)
[ -n "$cupti" ] || { echo "trace_decode: no libcupti.so under $roots" >&2; exit 2; }
lib=$(dirname "$cupti")
record=$(grep -o 'CUpti_ActivityKernel[0-9]*' "$inc/cupti_activity.h" | sort -V | tail -1)
so=$logs/libkernel_trace.so
gcc -O2 -shared -fPIC -DKERNEL_RECORD="$record" -I"$inc" -I/usr/local/cuda/include tools/gpu/kernel_trace.c \
    -L"$lib" -Wl,-rpath,"$lib" -l:"$(basename "$cupti")" -o "$so"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:$lib:${LD_LIBRARY_PATH:-}
name=trace_${fmt}_b${BATCH:-1}${SPEC:+_k$SPEC}
csv=$logs/$name.csv
CUDA_INJECTION64_PATH=$so VT_TRACE_OUT=$csv "$bin/vt" bench --backend cuda --model "$cfg" --load-format "$fmt" \
    --batch "${BATCH:-1}" --prompt-len "${PROMPT_LEN:-512}" --gen-len "${GEN_LEN:-48}" ${SPEC:+--speculative-tokens $SPEC} >"$logs/$name.log" 2>&1
grep -h "batch\|k ${SPEC:-0}" "$logs/$name.log" | head -3
python3 tools/gpu/kernel_trace.py "$csv" ${KERNELS:+--kernels}
