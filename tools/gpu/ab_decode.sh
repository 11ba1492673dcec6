#!/usr/bin/env bash
# On the GPU machine, in the repository root: two builds' decode timings in one call, interleaved
# A B A B, so that the drift between device calls (one binary's TPOT has moved 2.94-3.20 ms from
# call to call) does not pass for a difference. Each folder holds a `decode_bench` and a `vt`
# (tools/gpu/build.sh's output, or those two copied from another build). Per round: decode_bench's
# rows matching AB_ROWS (grep -E; default the MoE layer and attention decode rows; AB_CASES, e.g.
# `moe,attention`, runs only those benchmark families: decode_bench's VT_BENCH_CASES) and `vt bench`
# at batch 1 on each config of AB_CONFIGS. Logs go to $OUT (or /tmp/vt-gpu); the table
# (tools/gpu/ab_table.py: per-side medians over AB_ROUNDS rounds, and B / A) is printed last.
#   bash tools/gpu/ab_decode.sh .gpu/base .gpu/bin      (carry [".gpu"])
set -uo pipefail
[ $# -eq 2 ] || { sed -n '2,9p' "$0"; exit 2; }
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
rows=${AB_ROWS:-moe layer.*fused|attention decode}
configs=${AB_CONFIGS:-tools/gpu/configs/qwen3_5_35b_a3b tools/gpu/configs/laguna_xs_2}
: >"$logs/ab.txt"
for round in $(seq "${AB_ROUNDS:-2}"); do
    for side in A B; do
        dir=$1; [ $side = B ] && dir=$2
        env ${AB_CASES:+VT_BENCH_CASES="$AB_CASES"} timeout "${BENCH_TIMEOUT:-120}" "$dir/decode_bench" >"$logs/ab_decode_bench_${side}_$round.log" 2>&1 ||
            echo "decode_bench $side: rc=$?"
        grep -E "$rows" "$logs/ab_decode_bench_${side}_$round.log" | sed "s/^/$side | /" >>"$logs/ab.txt"
        for cfg in $configs; do
            timeout "${VT_TIMEOUT:-150}" "$dir/vt" bench --backend cuda --model "$cfg" --load-format dummy --batch 1 \
                --prompt-len 32 --gen-len "${AB_GEN_LEN:-64}" >"$logs/ab_vt_$(basename "$cfg")_${side}_$round.log" 2>&1 || echo "vt bench $side: rc=$?"
            grep -E '^batch' "$logs/ab_vt_$(basename "$cfg")_${side}_$round.log" | sed "s#^#$side | e2e $(basename "$cfg") | #" >>"$logs/ab.txt"
        done
    done
done
python3 tools/gpu/ab_table.py "$logs/ab.txt"
