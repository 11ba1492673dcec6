#!/usr/bin/env bash
# On the GPU machine, in the repository root: two builds' prefill timings in one call, interleaved
# A B A B (as tools/gpu/ab_decode.sh does for decode). Each folder holds a `prefill_bench` and a `vt`
# (tools/gpu/build.sh's or build_rev.sh's output). Per round: every prefill_bench row (MoE, attention,
# GDN, dense linear) and `vt bench` prefill and decode at batch 1 and 64 (prompt 512) on each config
# of AB_CONFIGS. Logs go to $OUT (or /tmp/vt-gpu); tools/gpu/ab_table.py's table is printed last.
#   bash tools/gpu/ab_prefill.sh .gpu/base .gpu/bin      (carry [".gpu"])
set -uo pipefail
[ $# -eq 2 ] || { sed -n '2,7p' "$0"; exit 2; }
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
configs=${AB_CONFIGS:-tools/gpu/configs/qwen3_5_35b_a3b}
: >"$logs/ab_prefill.txt"
for round in $(seq "${AB_ROUNDS:-2}"); do
    for side in A B; do
        dir=$1; [ $side = B ] && dir=$2
        mkdir -p "$logs/prefill_${side}_$round"
        timeout "${BENCH_TIMEOUT:-150}" "$dir/prefill_bench" "$logs/prefill_${side}_$round" 2>"$logs/ab_prefill_bench_${side}_$round.log" ||
            echo "prefill_bench $side: rc=$?"
        python3 -c 'import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        row = json.loads(line)
        print(sys.argv[2], "| prefill", row["name"], " %.2f µs" % (row["ms"] * 1000))' \
            "$logs/ab_prefill_bench_${side}_$round.log" "$side" >>"$logs/ab_prefill.txt"
        for cfg in $configs; do
            timeout "${VT_TIMEOUT:-200}" "$dir/vt" bench --backend cuda --model "$cfg" --load-format dummy --batch 1,64 \
                --prompt-len 512 --gen-len 16 >"$logs/ab_prefill_vt_$(basename "$cfg")_${side}_$round.log" 2>&1 || echo "vt bench $side: rc=$?"
            grep -E '^batch' "$logs/ab_prefill_vt_$(basename "$cfg")_${side}_$round.log" |
                sed "s#^#$side | e2e $(basename "$cfg") | #" >>"$logs/ab_prefill.txt"
        done
    done
done
python3 tools/gpu/ab_table.py "$logs/ab_prefill.txt"
