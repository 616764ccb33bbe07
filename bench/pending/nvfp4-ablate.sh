#!/usr/bin/env bash
# NVFP4 decode kernel times under the switches of nvfp4-ablate.patch (EPMOE_NVFP4_ABLATE bits:
# 1 consumers skip the chunk math, 2 no loads, 4 no activation rows, 8 codes as one contiguous
# 8 KiB copy, 16 L2 cache hints, 64 early stage release). Apply the patch to 676e7b3, then on the
# GPU machine: bash bench/pending/nvfp4-ablate.sh (writes $OUT/prof<mode>-<time>.txt).
set -u
O=$OUT
export EPMOE_SHA=${EPMOE_SHA:-676e7b3-ablate} EPMOE_PACK_OUT=0 EPMOE_PROFILE_DECODE=1 EPMOE_PROFILE_PRECISION=nvfp4
# The first call also builds: give each profile 150 s; a shape cut off by the timeout is missing
# from its file (the summary says so).
for a in ${EPMOE_ABLATE_MODES:-0 8 16 64 1 9 2}; do
  mkdir -p /tmp/p$a; rm -f /tmp/p$a/profile.txt
  t0=$(date +%s)
  EPMOE_NVFP4_ABLATE=$a OUT=/tmp/p$a timeout 150 bash bench/device.sh profile mixtral-8x7b qwen3-30b-a3b gpt-oss-120b deepseek-v3 > /tmp/p$a/log 2>&1
  rc=$?
  echo "ablate $a ($(( $(date +%s) - t0 )) s, status $rc)"
  cp /tmp/p$a/profile.txt $O/prof$a-$t0.txt 2>/dev/null || continue
  # Each NVFP4 launch's device time (the table's fourth time column, Self CUDA), per shape.
  python3 - /tmp/p$a/profile.txt <<'PY'
import re, sys
for line in open(sys.argv[1]):
    if " nvfp4 T " in line:
        print(line.split()[0])
    m = re.search(r"nvfp4_gemm_kernel<([^>]*)>", line)
    if m:
        t = re.findall(r"([0-9.]+)(us|ms)", line.split("Params)")[-1])[3]
        print(f"  <{m.group(1)}> {t[0]} {t[1]}")
PY
done
