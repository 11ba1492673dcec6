#!/usr/bin/env bash
# On the GPU machine, with tools/gpu/build.sh's binaries carried: Nsight Compute's per-kernel
# summary (device time of every launch, grouped by kernel and grid) of `vt bench` decoding a few
# tokens on Qwen3.5-35B-A3B shapes cut to NUM_LAYERS layers (default 4: three GDN layers and one
# attention layer), dummy weights (their fill kernels are left out). The kernel list of one decode
# step and what each costs: where the time per token goes. ncu locks clocks to base and flushes
# caches between kernels by default, so its times are upper bounds; compare kernels, not totals.
set -uo pipefail
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
bin=${VT_GPU_BIN:-.gpu/bin}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
timeout "${NCU_TIMEOUT:-300}" ncu --print-summary per-kernel -k 'regex:^(?!fill_random)' --metrics gpu__time_duration.sum \
    "$bin/vt" bench --backend cuda --model tools/gpu/configs/qwen3_5_35b_a3b --load-format "${LOAD_FORMAT:-dummy}" \
    --num-layers "${NUM_LAYERS:-4}" --batch 1 --prompt-len 8 --gen-len 8 >"$logs/ncu_decode.txt" 2>&1
echo "ncu: rc=$?"
grep -E "^  [a-z_]|gpu__time_duration" "$logs/ncu_decode.txt" | paste - - | sed -E "s/, Device [^,]*, CC [^,]*, Invocations +/ x/; s/\\s+gpu__time_duration.sum +us +/  us min\/max\/mean /"
