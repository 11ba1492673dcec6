#!/usr/bin/env bash
# On the GPU machine: restores the folders tools/gpu/pack.sh compressed (.gpu/xz/NAME/*.xz ->
# .gpu/NAME/*, executable), with Python's lzma, which needs nothing installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 - <<'PY'
import collections, glob, lzma, os
restored = collections.Counter()
for path in sorted(glob.glob(".gpu/xz/*/*.xz")):
    out = os.path.join(".gpu", os.path.basename(os.path.dirname(path)), os.path.basename(path)[:-3])
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with lzma.open(path) as src, open(out, "wb") as dst:
        dst.write(src.read())
    os.chmod(out, 0o755)
    restored[os.path.dirname(out)] += 1
print("unpack:", ", ".join(f"{d} ({n} files)" for d, n in sorted(restored.items())) or "nothing under .gpu/xz")
PY
