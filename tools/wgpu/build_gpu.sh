#!/usr/bin/env bash
# Builds here, where there is no GPU, what tools/wgpu/run_gpu.sh runs on the GPU machine: `vt`
# with both GPU backends and vt-wgpu's op, parity and out-of-memory test binaries (into
# .gpu/wgpu, ignored by git), fetches the Vulkan loader's Debian packages into .gl (the GPU
# machine has NVIDIA's Vulkan driver, not always the loader) and compresses the binaries into
# .gpu/xz (tools/gpu/pack.sh). Prints the one device command; carry [".gpu/xz", ".gl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu/wgpu
rm -rf "$out" && mkdir -p "$out"
cargo build --release -p vt-cli --features cuda,wgpu
cp target/release/vt "$out/vt"
for t in ops parity out_of_memory; do
    cargo test --release -p vt-wgpu --test "$t" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' | while read -r path; do cp "$path" "$out/$t"; done
done
strip "$out"/*
if ! ls .gl/libglvnd0_*.deb >/dev/null 2>&1; then
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.gl/' "$exclude" 2>/dev/null || echo /.gl/ >>"$exclude"
    mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq && (cd .gl && apt-get $o download libvulkan1 libglvnd0 libegl1 libglx0 libgl1 libopengl0)
fi
ls -la "$out" .gl
# Compressed: the binaries (about 52 MB) and the tracked tree do not fit the call's carry limit.
bash tools/gpu/pack.sh "$out" >/dev/null
echo
echo 'device command (carry [".gpu/xz", ".gl"]):'
echo "  bash tools/gpu/unpack.sh && bash tools/wgpu/run_gpu.sh"
