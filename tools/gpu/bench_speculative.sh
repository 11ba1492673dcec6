#!/usr/bin/env bash
# On the GPU machine, with the folder of tools/gpu/build.sh's binaries carried: issue #32's figures
# in one call. First the recorded-step and speculative GPU tests (a wrong replay must not be
# timed), then `vt bench` on Qwen3.5-35B-A3B dummy bf16 (its MTP layer drafts): plain decode, and
# verification of K = SPEC_K drafts (default 1,2,3,4) at SPEC_BATCH (default 1,32), each printing
# the drafting and verification time per step and the tok/s at acceptance 0.6/0.7/0.8. With
# PROFILE=1, ncu's per-kernel times of a few verification steps of the first NUM_LAYERS (4) layers
# at K = 3, batch PROFILE_BATCH (1 and 32; $OUT/ncu_verify_b*.csv), beside `vt bench`'s own times
# of those layers. Logs go to $OUT.
set -uo pipefail
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
bin=${VT_GPU_BIN:-.gpu/bin}
cfg=${DECODE_CONFIG:-tools/gpu/configs/qwen3_5_35b_a3b}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
root=$(strings "$bin/recorded" | grep -o '/[^ ]*/crates/vt-test-support' | head -1 | sed 's,/crates/vt-test-support$,,')
if [ -n "$root" ] && [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"; fi
if [ "${SPEC_TESTS:-1}" = 1 ]; then
    for t in recorded speculative; do
        timeout 240 "$bin/$t" --nocapture >"$logs/$t.log" 2>&1; echo "== $t: rc=$? $(grep -E '^test result' "$logs/$t.log")"
        grep -hE '^(fixture |speculative: )|panicked|FAILED' "$logs/$t.log" | head -30
    done
fi
bench() {  # log name, then vt bench's arguments
    local name=$1; shift
    timeout "${BENCH_TIMEOUT:-200}" "$bin/vt" bench --backend cuda --model "$cfg" --load-format dummy --prompt-len 512 \
        --gen-len "${SPEC_GEN:-32}" "$@" >"$logs/$name.log" 2>&1 || echo "$name: rc=$?"
    grep -E 'tok/s|drafting|^speculation' "$logs/$name.log"
}
bench plain --batch "${SPEC_BATCH:-1,32}"
for k in ${SPEC_K:-1 2 3 4}; do
    bench "spec_k$k" --batch "${SPEC_BATCH:-1,32}" --speculative-tokens "$k"
done
if [ "${PROFILE:-0}" = 1 ]; then
    for n in ${PROFILE_BATCH:-1 32}; do
        timeout "${NCU_TIMEOUT:-240}" ncu --csv -k 'regex:^(?!fill_random)' --metrics gpu__time_duration.sum \
            --clock-control none --cache-control none \
            "$bin/vt" bench --backend cuda --model "$cfg" --load-format dummy --num-layers "${NUM_LAYERS:-4}" \
            --batch "$n" --prompt-len 32 --gen-len 6 --speculative-tokens 3 >"$logs/ncu_verify_b$n.csv" \
            2>"$logs/ncu_verify_b$n.log" || echo "ncu batch $n: rc=$?"
        timeout 120 "$bin/vt" bench --backend cuda --model "$cfg" --load-format dummy --num-layers "${NUM_LAYERS:-4}" \
            --batch "$n" --prompt-len 32 --gen-len 32 --speculative-tokens 3 >"$logs/verify_layers_b$n.log" 2>&1
        grep -E 'tok/s|drafting' "$logs/verify_layers_b$n.log"
    done
fi
