#!/usr/bin/env bash
# On the GPU machine, with the folder of tools/gpu/build.sh's binaries carried: ncu's time for every
# kernel of a few decode steps of `vt bench` (LOAD_FORMAT dummy weights, fill kernels left out; the
# first NUM_LAYERS layers, 4 by default: Qwen3.5's three Gated DeltaNet layers and one attention
# layer), then the last step's kernels in launch order and summed by name
# (tools/gpu/decode_profile.py). ncu runs each kernel alone, so the sum is the step without launch
# overlap. DECODE_CONFIG picks the model (tools/gpu/configs/*). The CSV goes to $OUT (or /tmp/vt-gpu).
set -uo pipefail
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
bin=${VT_GPU_BIN:-.gpu/bin}
cfg=${DECODE_CONFIG:-tools/gpu/configs/qwen3_5_35b_a3b}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
timeout "${NCU_TIMEOUT:-300}" ncu --csv -k 'regex:^(?!fill_random)' --metrics gpu__time_duration.sum \
    --clock-control none --cache-control none \
    "$bin/vt" bench --backend cuda --model "$cfg" --load-format "${LOAD_FORMAT:-dummy}" --num-layers "${NUM_LAYERS:-4}" \
    --batch 1 --prompt-len 32 --gen-len 3 >"$logs/ncu_decode.csv" 2>"$logs/ncu_decode.log" || echo "ncu: rc=$?"
python3 tools/gpu/decode_profile.py "$logs/ncu_decode.csv"
