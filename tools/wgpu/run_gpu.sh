#!/usr/bin/env bash
# On the GPU machine, in the repository root with .gpu/xz and .gl carried and .gpu/wgpu unpacked
# (tools/wgpu/build_gpu.sh prints the command): vt-wgpu on the GPU's Vulkan driver
# (VT_WGPU_ADAPTER, default "nvidia"): its op tests, fixture parity against vt-cpu and its
# out-of-memory test, then `vt bench` on Qwen3.5-35B-A3B (random weights at its config's shapes,
# every layer unless VT_LAYERS says how many; prompt 512, 32 tokens, batch VT_BATCH, default 1)
# on CUDA and on wgpu, and wgpu's speed as a fraction of CUDA's. Each step has its own time limit
# (under 5 minutes in all) and the next runs whatever the last did. Full logs go to $OUT (or
# /tmp/vt-wgpu); a summary is printed last.
set -uo pipefail
logs=${OUT:-/tmp/vt-wgpu}
mkdir -p "$logs"
bin=.gpu/wgpu
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if [ -z "${VK_DRIVER_FILES:-}" ]; then
    for j in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
        /etc/vulkan/icd.d/nvidia_icd.json; do
        [ -f "$j" ] && export VK_DRIVER_FILES=$j && break
    done
fi
# NVIDIA's ICD (libGLX_nvidia) needs glvnd's dispatch libraries beside the loader (.gl has them).
export __EGL_VENDOR_LIBRARY_FILENAMES=${__EGL_VENDOR_LIBRARY_FILENAMES:-/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json}
echo "Vulkan ICD: ${VK_DRIVER_FILES:-none found}; loader: $(ldconfig -p | grep -c libvulkan) entries"
export VT_WGPU_ADAPTER=${VT_WGPU_ADAPTER:-nvidia}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
# The test binaries find fixtures/ through the repository path they were built in.
root=$(strings "$bin/parity" | grep -o '/[^ ]*/crates/vt-test-support' | head -1 | sed 's,/crates/vt-test-support$,,')
if [ -n "$root" ] && [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"; fi
summary=()
run() {  # name, seconds it may take, then the command
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name (at most $limit s): $*"
    timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1; local rc=$?
    [ $rc -eq 124 ] && echo "$name: stopped after $limit s" >>"$logs/$name.log"
    summary+=("== $name: rc=$rc ($((SECONDS - t0)) s): $(grep -E '^test result|^batch|^weights|adapter|wgpu:|stopped after|^Error|panicked' "$logs/$name.log" | head -8 | tr '\n' ' ')")
    echo "${summary[-1]}"
}
run ops 45 "$bin/ops" --nocapture
grep -E '^op ' "$logs/ops.log" | sort -t= -k2 -g | tail -5
grep -E '^test .*FAILED' "$logs/ops.log"
run parity 45 "$bin/parity" --nocapture
grep -E '^test .*FAILED' "$logs/parity.log"
run out_of_memory 30 "$bin/out_of_memory" --nocapture
model=tools/gpu/configs/qwen3_5_35b_a3b
args=(--model "$model" --load-format dummy --batch "${VT_BATCH:-1}" --prompt-len 512 --gen-len 32)
[ -n "${VT_LAYERS:-}" ] && args+=(--num-layers "$VT_LAYERS")
run bench-cuda 60 "$bin/vt" bench --backend cuda "${args[@]}"
run bench-wgpu 90 "$bin/vt" bench --backend wgpu "${args[@]}"
grep -hE '^weights|^batch' "$logs/bench-cuda.log" "$logs/bench-wgpu.log"
python3 - "$logs/bench-cuda.log" "$logs/bench-wgpu.log" <<'PY'
import re, sys
def rates(path):
    out = {}
    for l in open(path):
        m = re.match(r"batch\s+(\d+):.*prefill\s+([\d.]+) tok/s.*decode\s+([\d.]+) tok/s", l)
        if m:
            out[int(m[1])] = (float(m[2]), float(m[3]))
    return out
cuda, wgpu = rates(sys.argv[1]), rates(sys.argv[2])
if not cuda.keys() & wgpu.keys():
    print(f"no ratio: batches measured on cuda {sorted(cuda)}, on wgpu {sorted(wgpu)} (see the logs)")
for n in sorted(cuda.keys() & wgpu.keys()):
    (pc, dc), (pw, dw) = cuda[n], wgpu[n]
    print(f"batch {n}: prefill wgpu/cuda {pw:.0f}/{pc:.0f} tok/s = {pw / pc:.3f}; decode {dw:.1f}/{dc:.1f} tok/s = {dw / dc:.3f}")
PY
printf '%s\n' "${summary[@]}"
