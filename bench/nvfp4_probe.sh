#!/usr/bin/env bash
# One GPU call for the NVFP4 GEMM: `device.sh nvfp4` (build, tests, decode bench), then Nsight
# Compute pipe utilizations and stall reasons of the two GEMM launches of one decode forward per
# shape (PROBE_SHAPES, default deepseek-v3), then the static SASS instruction counts of the
# 1-group and 8-group SwiGLU kernels (cuobjdump). SWEEP: EPMOE_NVFP4_SPLITK_SWEEP for device.sh.
#   EPMOE_SHA=<sha> [PROBE_SHAPES="deepseek-v3 mixtral-8x7b"] bash bench/nvfp4_probe.sh
cd "$(dirname "$0")/.."
EPMOE_NVFP4_SPLITK_SWEEP="${SWEEP-auto}" bash bench/device.sh nvfp4 2>&1 | grep -v "^R=1" | tail -40
M=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active
for r in long_scoreboard barrier short_scoreboard math_pipe_throttle wait not_selected mio_throttle \
    lg_throttle sleeping no_instruction dispatch_stall selected; do
  M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.sum,gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
for shape in ${PROBE_SHAPES:-deepseek-v3}; do
  EPMOE_PROFILE_PRECISION=nvfp4 EPMOE_PROFILE_DECODE=1 EPMOE_NCU_KERNEL=nvfp4_gemm EPMOE_NCU_SKIP=2 \
    EPMOE_NCU_COUNT=2 EPMOE_NCU_METRICS=$M bash bench/device.sh profile "$shape" 2>&1 | grep -v "==PROF" | tail -70
done
cuobjdump -sass build-gpu/src/CMakeFiles/epmoe.dir/cuda/gemm/grouped_gemm_nvfp4.cu.o > /tmp/nvfp4_sass.txt
python3 - <<'PY'
import collections, re
cur, counts = None, collections.OrderedDict()
for line in open("/tmp/nvfp4_sass.txt"):
    m = re.search(r"Function : (\S+)", line)
    if m:
        cur = m.group(1)
        counts[cur] = collections.Counter()
        continue
    m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
    if m and cur:
        counts[cur][m.group(2).split(".")[0]] += 1
for name, c in counts.items():
    if "ILi1ELb1ELb0" in name or "ILi8ELb1ELb0" in name:
        print(name[-40:], sum(c.values()), c.most_common(32))
PY
