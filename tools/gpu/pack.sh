#!/usr/bin/env bash
# Here: compresses binary folders under .gpu (tools/gpu/build.sh's .gpu/bin, build_rev.sh's DIRs)
# into .gpu/xz/NAME/*.xz, about a third of their size, so that they fit the device call's carry
# limit beside the tracked tree (build.sh's binaries alone are near it). Carry .gpu/xz and start
# the device command with `bash tools/gpu/unpack.sh`, which restores .gpu/NAME there.
#   bash tools/gpu/pack.sh .gpu/bin .gpu/a
set -euo pipefail
[ $# -gt 0 ] || { sed -n '2,6p' "$0"; exit 2; }
cd "$(dirname "$0")/../.."
rm -rf .gpu/xz
for dir in "$@"; do
    name=$(basename "$dir")
    mkdir -p ".gpu/xz/$name"
    for f in "$dir"/*; do xz -T0 -6 -c "$f" >".gpu/xz/$name/$(basename "$f").xz"; done
done
du -sh .gpu/xz
echo "carry [\".gpu/xz\"]; device command: bash tools/gpu/unpack.sh && ..."
