#!/usr/bin/env bash
# Here, without a GPU: builds `vt`, the decode and prefill kernel benchmarks and the GPU ops tests
# of a git revision (a commit or branch) into DIR, stripped, from a temporary worktree, leaving this
# checkout alone. Two revisions built this way make an A/B pair for tools/gpu/ab_decode.sh, and DIR/ops
# checks the revision's kernels on the device (e.g. `DIR/ops moe`). Carry the folder above DIR.
#   bash tools/gpu/build_rev.sh main .gpu/a && bash tools/gpu/build_rev.sh experiment/x .gpu/b
set -euo pipefail
[ $# -eq 2 ] || { sed -n '2,7p' "$0"; exit 2; }
root=$(cd "$(dirname "$0")/../.." && pwd)
rev=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
tree=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$tree"' EXIT
git -C "$root" worktree add --detach --quiet "$tree" "$rev"
# The checkout's target folder: dependencies are built once; the workspace's crates rebuild per tree.
export CARGO_TARGET_DIR="$root/target/rev"
cd "$tree"
cargo build --release -p vt-cli --features cuda
cargo build --release -p vt-cuda --features cuda --example decode_bench --example prefill_bench
ops=$(cargo test --release -p vt-cuda --features cuda --test ops --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "ops":
        print(m["executable"])')
cp "$CARGO_TARGET_DIR/release/vt" "$CARGO_TARGET_DIR/release/examples/decode_bench" \
    "$CARGO_TARGET_DIR/release/examples/prefill_bench" "$ops" "$out/"
mv "$out/$(basename "$ops")" "$out/ops"
strip "$out"/vt "$out"/decode_bench "$out"/prefill_bench "$out"/ops
echo "$rev ($(git rev-parse --short HEAD)) -> $out: $(ls "$out" | tr '\n' ' ')"
