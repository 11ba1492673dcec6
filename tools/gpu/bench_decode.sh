#!/usr/bin/env bash
# On the GPU machine, in the repository root with the folder of tools/gpu/build.sh's binaries
# carried (and `pip download --no-deps fla-core -d <folder>/wheels` made here): the decode peers
# (tools/gpu/decode_peers.py: HF MoE block, flash-linear-attention, cuBLAS, SDPA), vt's decode
# kernel benchmark beside them (crates/vt-cuda/examples/decode_bench.rs) and the MoE layer's
# streaming floor (tools/gpu/stream_bench.cu, built with the machine's nvcc), then end to end on
# Qwen3.5-35B-A3B with dummy weights (DECODE_CONFIG=tools/gpu/configs/laguna_xs_2 for Laguna-XS.2):
# `vt bench` and HF transformers' eager decode, in that order (each needs most of the GPU's
# memory). Logs go to $OUT (or /tmp/vt-gpu); the tables print last. DECODE_E2E=0 skips the
# end-to-end part, HF_E2E=0 only its transformers half.
set -uo pipefail
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
bin=${VT_GPU_BIN:-.gpu/bin}
cfg=${DECODE_CONFIG:-tools/gpu/configs/qwen3_5_35b_a3b}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
pip install --quiet --no-index --no-deps --target /tmp/site "$(dirname "$bin")"/wheels/*.whl >"$logs/pip.log" 2>&1
PYTHONPATH=/tmp/site timeout "${PEERS_TIMEOUT:-150}" python3 tools/gpu/decode_peers.py "$logs" >"$logs/decode_peers.log" 2>&1 ||
    echo "decode_peers: rc=$?"
timeout "${BENCH_TIMEOUT:-150}" "$bin/decode_bench" "$logs/peers.txt" >"$logs/decode_bench.log" 2>&1 || echo "decode_bench: rc=$?"
# The one-launch streaming floor of a MoE layer's bytes (tools/gpu/stream_bench.cu), beside the
# MoE rows it bounds.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
    { PATH=$PATH:/usr/local/cuda/bin nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/stream_bench tools/gpu/stream_bench.cu &&
        timeout 60 /tmp/stream_bench; } >"$logs/stream_bench.log" 2>&1 || echo "stream_bench: rc=$?"
fi
if [ "${DECODE_E2E:-1}" = 1 ]; then
    timeout "${VT_TIMEOUT:-200}" "$bin/vt" bench --backend cuda --model "$cfg" --load-format dummy \
        --batch "${DECODE_BATCH:-1,1,4,16,64}" --prompt-len 32 --gen-len 32 >"$logs/vt_bench.log" 2>&1 || echo "vt bench: rc=$?"
    if [ "${HF_E2E:-1}" = 1 ]; then
        PYTHONPATH=/tmp/site timeout "${HF_TIMEOUT:-200}" python3 tools/gpu/hf_decode.py "$cfg" >"$logs/hf_decode.log" 2>&1 ||
            echo "hf_decode: rc=$?"
    fi
fi
echo "---- decode kernels (vt | ceiling | peer) ----"
cat "$logs/decode_bench.log"
echo "---- one launch streaming a MoE layer's bytes ----"
cat "$logs/stream_bench.log" 2>/dev/null
grep -E 'failed' "$logs/decode_peers.log" | head -5
if [ "${DECODE_E2E:-1}" = 1 ]; then
    echo "---- end to end, $(basename "$cfg") dummy bf16 ----"
    tail -8 "$logs/vt_bench.log"
    tail -3 "$logs/hf_decode.log" 2>/dev/null
fi
