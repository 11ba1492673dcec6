#!/usr/bin/env bash
# On the GPU machine, in the repository root with the folder of tools/gpu/build.sh's binaries
# carried: vt's prefill benchmark (crates/vt-cuda/examples/prefill_bench.rs) and its peers in the
# same call (tools/gpu/prefill_peers.py: torch grouped_mm, SDPA flash, flash-linear-attention from
# the carried wheels, `pip download --no-deps fla-core einops -d <folder>/wheels` here). Logs and
# JSON go to $OUT (or /tmp/vt-gpu); the table is printed last.
set -uo pipefail
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
bin=${VT_GPU_BIN:-.gpu/bin}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
pip install --quiet --no-index --no-deps --target /tmp/site "$(dirname "$bin")"/wheels/*.whl >"$logs/pip.log" 2>&1
timeout "${BENCH_TIMEOUT:-150}" "$bin/prefill_bench" "$logs" 2>"$logs/prefill_bench.log" || echo "prefill_bench: rc=$?"
grep -v '^{' "$logs/prefill_bench.log" | tail -5
PYTHONPATH=/tmp/site timeout "${PEERS_TIMEOUT:-200}" python3 tools/gpu/prefill_peers.py "$logs" 2>"$logs/prefill_peers.log" |
    tee "$logs/prefill_table.txt"
grep -iE 'error|failed' "$logs/prefill_peers.log" | tail -5
