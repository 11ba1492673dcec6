#!/usr/bin/env bash
# On the GPU machine, in the repository root with .gpu/bin carried (tools/gpu/build.sh): runs every
# GPU test binary, the mutation arm (which must fail) and `vt --backend cuda`; full logs go to
# $OUT (or /tmp/vt-gpu), a summary is printed last.
set -uo pipefail
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
bin=${VT_GPU_BIN:-.gpu/bin}
# The binaries find fixtures/ through the repository path they were built in.
root=$(strings "$bin/parity" | grep -o '/[^ ]*/crates/vt-test-support' | head -1 | sed 's,/crates/vt-test-support$,,')
if [ -n "$root" ] && [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"; fi
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader

status=0
results=()  # each run's one-line result, printed again last (a device call returns only its output's tail)
say() {  # prints a result line now and keeps it for the end
    results+=("$1")
    echo "$1"
}
run() {  # name, then the command
    local name=$1; shift
    local t0=$SECONDS
    # A hang (a kernel waiting on a shuffle or a barrier that never comes) ends here, not at the
    # device call's limit with nothing reported.
    timeout "${RUN_TIMEOUT:-240}" "$@" >"$logs/$name.log" 2>&1; local rc=$?
    local hung=""; [ $rc = 124 ] && hung=" TIMED OUT after ${RUN_TIMEOUT:-240} s"
    say "== $name: rc=$rc ($((SECONDS - t0)) s)$hung: $(grep -E '^test result' "$logs/$name.log" | tr '\n' ' ')"
    return $rc
}
run ops "$bin/ops" --nocapture --test-threads=4 || status=1
if ! run parity "$bin/parity" --nocapture; then
    status=1
    run parity-serial "$bin/parity" --nocapture --test-threads=1  # tells a race from a plain bug
fi
# In parallel: other threads' backends open, run and drop while a step's capture is open.
if ! run recorded "$bin/recorded" --nocapture; then
    status=1
    run recorded-serial "$bin/recorded" --nocapture --test-threads=1
fi
run speculative "$bin/speculative" --nocapture || status=1
run lifetime "$bin/lifetime" --nocapture --test-threads=1 || status=1
if run lifetime-mutation "$bin/lifetime-mutation" --test-threads=1; then
    say "mutation arm: PASSED with the original bug compiled in (must fail)"; status=1
else
    for t in sequential_engines_in_reused_memory_compute_as_alone build_run_drop_cycles_give_all_memory_back; do
        if grep -q "^test $t \.\.\. FAILED" "$logs/lifetime-mutation.log"; then
            say "mutation arm: $t failed as required"
        else
            say "mutation arm: $t did not fail"; status=1
        fi
    done
fi
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    run parallel "$bin/parallel" --nocapture --test-threads=1 || status=1
    run vt-generate-tp2 "$bin/vt" generate --backend cuda --tensor-parallel 2 --model fixtures/qwen35moe_text --prompt-ids 1,2,3,4 --max-new-tokens 8 --json || status=1
else
    say "== parallel: skipped (one GPU; tensor parallelism needs two)"
fi
run vt-generate "$bin/vt" generate --backend cuda --model fixtures/qwen35moe_text --prompt-ids 1,2,3,4 --max-new-tokens 8 --json || status=1
run vt-logits "$bin/vt" logits --backend cuda --model fixtures/laguna_nvfp4 --prompt-ids 1,2,3,4 --out "$logs/logits.safetensors" || status=1
tail -2 "$logs/vt-generate.log"

echo "---- summary ----"
grep -hE '^(op |fixture |.*cycles:|speculative: )' "$logs"/ops.log "$logs"/parity.log "$logs"/recorded.log "$logs"/speculative.log "$logs"/lifetime.log | grep -vE "^op .*e-3 \(bound"
grep -hE '^.* over [0-9]+ ranks' "$logs"/parallel.log 2>/dev/null
grep -hE 'panicked|FAILED' "$logs"/{ops,parity,recorded,speculative,lifetime}.log | head -20
grep -hE "^thread '.*' panicked|^test .* FAILED" "$logs/lifetime-mutation.log" | head -8
echo "---- results ----"
printf '%s\n' "${results[@]}"
echo "suite status: $status"
exit $status
