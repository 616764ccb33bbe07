#!/usr/bin/env bash
# Nsight Compute on the grouped-GEMM kernels of one EP = 1 step (second step only, so nothing
# one-off is measured). Needs a build in build-gpu (bench/device.sh). Clocks are left alone.
#   bash bench/profile.sh <shape> [--unfused] [regex]
set -uo pipefail
shape=${1:-qwen3-30b-a3b}
extra=${2:-}
regex=${3:-grouped_gemm_kernel}
OUT=${OUT:-/tmp/epmoe-out}
launches=$([[ $extra == --unfused ]] && echo 6 || echo 6)
ncu --clock-control none -k "regex:$regex" --launch-skip "$launches" --launch-count "$launches" \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
    python3 bench/one_step.py --shape "$shape" $extra --steps 2 --lib build-gpu/src/libepmoe.so \
    > "$OUT/ncu-$shape$extra.txt" 2>&1
grep -E "grouped_gemm_kernel|Duration|Compute \(SM\) Throughput|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Registers Per|Stall|Warp Cycles Per Issued" "$OUT/ncu-$shape$extra.txt" \
  | sed -E 's/grouped_gemm_kernel<.*(Rows|Scatter|Swiglu|SwigluBackward|Wgrad|WgradTma)Epilogue.*/== \1Epilogue/' | cut -c1-110
