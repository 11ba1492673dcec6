#!/usr/bin/env bash
# Builds vt-cuda's GPU test binaries (and their mutation arm) and `vt` with CUDA here, where there
# is no GPU, strips them into .gpu/bin (ignored by git) and prints the one device command that
# runs them all (tools/gpu/run_suite.sh). Carry `.gpu` with the call.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${VT_GPU_BIN:-.gpu/bin}  # another folder keeps concurrent sessions' binaries apart
rm -rf "$out" && mkdir -p "$out"

# Test executables of a cargo invocation, as "name path" lines.
executables() {
    cargo test --release -p vt-cuda "$@" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])'
}

cargo test --release -p vt-cuda --features cuda --no-run
executables --features cuda | while read -r name path; do cp "$path" "$out/$name"; done
cargo test --release -p vt-cuda --features cuda,mutation-address-keyed-cache --test lifetime --no-run
executables --features cuda,mutation-address-keyed-cache --test lifetime | while read -r _ path; do cp "$path" "$out/lifetime-mutation"; done
cargo build --release -p vt-cli --features cuda
cp target/release/vt "$out/vt"
cargo build --release -p vt-cuda --features cuda --example prefill_bench  # tools/gpu/bench_prefill.sh
cp target/release/examples/prefill_bench "$out/prefill_bench"
cargo build --release -p vt-cuda --features cuda --example decode_bench  # tools/gpu/bench_decode.sh
cp target/release/examples/decode_bench "$out/decode_bench"
strip "$out"/*
ls -la "$out"
du -sh "$(dirname "$out")"
echo
echo "device command (carry [\"$(dirname "$out")\"], or, past the carry limit, [\".gpu/xz\"] after"
echo "\`bash tools/gpu/pack.sh $out\` and with \`bash tools/gpu/unpack.sh &&\` in front):"
echo "  VT_GPU_BIN=$out bash tools/gpu/run_suite.sh"
