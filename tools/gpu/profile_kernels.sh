#!/usr/bin/env bash
# On the GPU machine, with the folder of tools/gpu/build.sh's binaries carried: where the warps of
# the kernels that KERNELS names (an ncu filter, e.g. 'regex:moe_dec_') wait while the command
# given as arguments runs: ncu's occupancy, scheduler, speed-of-light and warp-state sections, then
# its warp samples per SASS instruction read by tools/gpu/kernel_stalls.py. LAUNCH_SKIP launches
# of those kernels (30 by default: warm-up) are passed over, LAUNCH_COUNT (3) profiled. The report
# and the source CSV go to $OUT (or /tmp/vt-gpu).
#   KERNELS='regex:moe_dec_(route|gate_up_bf16|down_bf16)' bash tools/gpu/profile_kernels.sh .gpu/bin/decode_bench
set -uo pipefail
[ $# -gt 0 ] || { sed -n '2,8p' "$0"; exit 2; }
logs=${OUT:-/tmp/vt-gpu}
mkdir -p "$logs"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none -k "${KERNELS:?an ncu kernel filter}" \
    --launch-skip "${LAUNCH_SKIP:-30}" --launch-count "${LAUNCH_COUNT:-3}" \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section SourceCounters \
    --import-source no -o "$logs/kernels" -f "$@" >"$logs/ncu_kernels.log" 2>&1 || echo "ncu: rc=$?"
ncu -i "$logs/kernels.ncu-rep" --page details >"$logs/kernels_details.txt" 2>&1
grep -E '^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Achieved Active Warps|Issued Warp Per Scheduler|Warp Cycles Per Issued' \
    "$logs/kernels_details.txt"
ncu -i "$logs/kernels.ncu-rep" --page source --csv --print-source sass >"$logs/kernels_source.csv" 2>&1
python3 tools/gpu/kernel_stalls.py "$logs/kernels_source.csv"
