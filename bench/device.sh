#!/usr/bin/env bash
# One call on the GPU machine: build from source, GPU tests, compute-sanitizer memcheck on a small
# case, then the benchmarks. Logs and JSON go under $OUT (the device tool brings them back).
#   bash bench/device.sh [all|test|bench] [bench args...]
#   bash bench/device.sh ep [bench_ep args...]   EP = 2 on 2 GPUs (EPMOE_EP_SIZE=4 or 8 on those machines): builds only what it needs
#       (libepmoe, libepmoe_nccl, ep_peer_store, the C ABI test), runs the C ABI test, then
#       bench/bench_ep.py under torchrun: $OUT/bench_ep.json, $OUT/bench_ep.log
#   bash bench/device.sh slots [bench_slots args...]   activation slots, EP = 1: builds libepmoe
#       and the C ABI test, runs it, then bench/bench_slots.py: $OUT/bench_slots.json, .log, .md
#   bash bench/device.sh profile [shape...]   kernel times of one fwd+bwd step per shape (torch
#       profiler, bench/one_step.py --profile; EPMOE_PROFILE_PRECISION, default fp8-train;
#       EPMOE_PROFILE_DECODE=1: the forward at the shape's decode T): $OUT/profile.txt; with
#       EPMOE_NCU_KERNEL=<regex> also Nsight Compute on that kernel's launches of the second step
#       (EPMOE_NCU_SKIP / EPMOE_NCU_COUNT, default 4 / 4; SourceCounters gives the top stall
#       locations in SASS; EPMOE_NCU_METRICS=<list> collects those metrics instead, the ones this
#       ncu knows; EPMOE_NCU_DENSE=1 also on cuBLAS's dense 8192^3 bf16 matmul): $OUT/ncu.txt
#   bash bench/device.sh nvfp4 [bench_moe args...]   NVFP4 weight-only inference: builds libepmoe
#       and its tests, runs them (measured errors, memcheck), then bench_moe.py --nvfp4-only:
#       $OUT/nvfp4_*.log, $OUT/bench_nvfp4.json; then once per n in EPMOE_NVFP4_SPLITK_SWEEP
#       (default "auto") with EPMOE_NVFP4_SPLITK=n on EPMOE_NVFP4_SPLITK_SHAPES (default
#       mixtral-8x7b, the shape whose W2 the heuristic splits): $OUT/bench_nvfp4_splitk<n>.json
#   bash bench/device.sh fp8wgrad [shape...]   the FP8 WGRAD on CTA pairs multicasting B against
#       single CTAs: builds libepmoe and test_gpu_wgrad_fp8, runs it (and the pairs' test under
#       memcheck), then bench_moe.py --epmoe-only (fp8-train, balanced) with
#       EPMOE_FP8_WGRAD_MULTICAST=0 and =1: $OUT/fp8wgrad{0,1}.json, stage ms side by side
#       (bench/compare_stages.py) in $OUT/fp8wgrad_compare.txt
#   bash bench/device.sh timeline [shape...]   the grouped GEMMs' per-tile clock stamps: builds
#       libepmoe with -DEPMOE_GEMM_TIMELINE=ON in build-tl (src/cuda/gemm/tile_timeline.cuh), runs
#       one bf16 step per shape (default deepseek-v3 gpt-oss-120b; bench/one_step.py):
#       $OUT/timeline_<shape>.txt, per-launch medians (bench/timeline_summary.py) in
#       $OUT/timeline_summary.txt
#   bash bench/device.sh tests <test binary>[:<gtest filter>] ...   builds libepmoe and those test
#       targets only, runs each (EPMOE_TEST_TIMEOUT s each, default 300) into $OUT/<binary>.log and
#       prints its summary: the cheap check of a change to a few kernels, e.g.
#       `tests test_gpu_wgrad_fp8 test_gpu_context:GpuContext.Wgrad*`
#   bash bench/device.sh abpatch <patch> [pairs]   A / B of two builds at EP = 1: a copy of this tree
#       with <patch> (a `git diff <base> <this>` of the tree, an untracked file here so that it
#       travels) applied in reverse, built in build-base/, against this tree's libepmoe, in
#       alternating processes (base first; pairs default 3; EPMOE_AB_PRECISION, EPMOE_AB_SHAPES as
#       for ab): $OUT/abpatch<i>.json (even: base), stage ms against abpatch0 in
#       $OUT/abpatch_compare.txt
#   bash bench/device.sh ab [NAME=value[+NAME=value] ...]   A / B of run-time switches at EP = 1:
#       builds libepmoe, then bench_moe.py --epmoe-only (EPMOE_AB_ROUTINGS, default balanced;
#       EPMOE_AB_PRECISION, default bf16; EPMOE_AB_SHAPES, default the four) once as is and once
#       per setting with its variables set: $OUT/ab0.json, $OUT/ab<i>.json, stage ms of each against ab0
#       (bench/compare_stages.py) in $OUT/ab_compare.txt. EPMOE_AB_DECODE=1: bench_moe.py
#       --decode-only instead (the bf16 decode forward, eager and graph, at each shape's decode T);
#       EPMOE_AB_NVFP4=1: --nvfp4-only (the NVFP4 decode forward beside the bf16 one); both also
#       for abpatch
# Every mode but test and profile also logs SM clocks, power and temperature every 500 ms to
# $OUT/clocks.csv and prints their summary per GPU (bench/clock_summary.py).
# CUTLASS headers and GoogleTest sources travel in third_party/ (git-ignored; name it in carry).
# The JSON files record EPMOE_SHA when set: the device machine's copy of .git can be older than the
# working tree it runs, so pass the commit from the calling machine (EPMOE_SHA=<sha> bash ...).
# The device tool brings back at most 8 files from $OUT: on exit every file this run left there is
# packed into $OUT/out-<mode>-<HHMMSS>.tgz and removed (archives of earlier runs in the same call
# stay); EPMOE_PACK_OUT=0 leaves them as they are.
set -uo pipefail
mode=${1:-all}
shift || true
OUT=${OUT:-/tmp/epmoe-out}
mkdir -p "$OUT"
pack_out() {
  [[ ${EPMOE_PACK_OUT:-1} == 0 ]] && return
  local archive files
  archive="out-$mode-$(date +%H%M%S).tgz"
  mapfile -t files < <(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name 'out-*.tgz' -printf '%P\n')
  (( ${#files[@]} == 0 )) && return
  if tar czf "$OUT/$archive" -C "$OUT" "${files[@]}"; then
    (cd "$OUT" && rm -rf -- "${files[@]}")
    echo "packed ${#files[@]} files into \$OUT/$archive"
  fi
}
trap pack_out EXIT
# EPMOE_AB_SHAPES, comma- or space-separated (bench_moe.py takes commas).
ab_shapes() {
  local s=${EPMOE_AB_SHAPES:-qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b}
  s=${s// /,}
  echo "${s//,,/,}"
}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
build=build-gpu
timeline_flag=OFF
if [[ $mode == timeline ]]; then
  build=build-tl
  timeline_flag=ON
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
# The NCCL transport is built against the NCCL that PyTorch loads (its nvidia-nccl wheel), which
# the benchmarks' processes run: the device API's structures differ between NCCL releases, so a
# build against the system's 2.28.3 falls back to CUDA IPC under PyTorch's 2.28.9.
# EPMOE_NCCL_SYSTEM=1 keeps whatever CMake finds (NCCL_HOME, the toolkit, the system).
nccl_args=()
torch_nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2> /dev/null)
if [[ -z ${EPMOE_NCCL_SYSTEM:-} && -n $torch_nccl && -f $torch_nccl/include/nccl_device.h ]]; then
  nccl_lib=$(ls "$torch_nccl"/lib/libnccl.so* 2> /dev/null | head -1)
  [[ -n $nccl_lib ]] &&
    nccl_args=(-DEPMOE_NCCL_INCLUDE_DIR="$torch_nccl/include" -DEPMOE_NCCL_LIBRARY="$nccl_lib")
fi
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPMOE_CUDA=ON \
    -DEPMOE_GEMM_CONFIGS=ALL -DEPMOE_GEMM_TIMELINE=$timeline_flag "${nccl_args[@]}" \
    > "$OUT/configure.log" 2>&1; then
  tail -40 "$OUT/configure.log"; exit 1
fi
grep -E "NCCL transport|NCCL >= 2.28 not found" "$OUT/configure.log"
# EPMOE_BUILD_TARGETS (space-separated) builds only those targets; default: everything.
targets=()
if [[ $mode == ep ]]; then
  EPMOE_BUILD_TARGETS=${EPMOE_BUILD_TARGETS:-epmoe epmoe_nccl ep_peer_store test_gpu_capi_nccl}
elif [[ $mode == slots ]]; then
  EPMOE_BUILD_TARGETS=${EPMOE_BUILD_TARGETS:-epmoe test_c_api}
elif [[ $mode == profile ]]; then
  EPMOE_BUILD_TARGETS=${EPMOE_BUILD_TARGETS:-epmoe}
elif [[ $mode == ab || $mode == abpatch || $mode == timeline ]]; then
  EPMOE_BUILD_TARGETS=${EPMOE_BUILD_TARGETS:-epmoe}
elif [[ $mode == fp8wgrad ]]; then
  EPMOE_BUILD_TARGETS=${EPMOE_BUILD_TARGETS:-epmoe test_gpu_wgrad_fp8}
elif [[ $mode == tests ]]; then
  (( $# > 0 )) || { echo "device.sh tests: name at least one test binary"; exit 2; }
  EPMOE_BUILD_TARGETS="epmoe $(for a in "$@"; do printf '%s ' "${a%%:*}"; done)"
elif [[ $mode == nvfp4 ]]; then
  EPMOE_BUILD_TARGETS=${EPMOE_BUILD_TARGETS:-epmoe test_gpu_gemm_nvfp4 test_gpu_nvfp4_forward \
    test_gpu_prepared_weights test_c_api test_formats}
fi
for t in ${EPMOE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
if ! cmake --build "$build" -j "$(nproc)" "${targets[@]}" > "$OUT/build.log" 2>&1; then
  grep -E "error|Error" -A4 "$OUT/build.log" | head -100; exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"

# bench_moe.py --epmoe-only (EPMOE_AB_ROUTINGS, default balanced), once per setting ("-" = none, else NAME=value exported for
# that run; several joined by +, e.g. A=1+B=1; EPMOE_AB_LIB=<path> runs that libepmoe instead of
# this build's): $OUT/<prefix><i>.json, each compared with the first in $OUT/<prefix>_compare.txt.
# Usage: ab_runs <prefix> <precision> <shapes> <setting>...
ab_runs() {
  local prefix=$1 precision=$2 shapes=$3 i=0 setting label
  shift 3
  : > "$OUT/${prefix}_compare.txt"
  for setting in "$@"; do
    label=$([[ $setting == - ]] && echo default || echo "$setting")
    echo "== $prefix$i: $label" | tee -a "$OUT/${prefix}_compare.txt"
    (
      if [[ $setting != - ]]; then
        IFS=+ read -ra assignments <<< "$setting"
        for assignment in "${assignments[@]}"; do export "$assignment"; done
      fi
      what=(--epmoe-only "epmoe-$prefix$i" --epmoe-only-precision "$precision")
      [[ ${EPMOE_AB_DECODE:-0} == 1 ]] && what=(--decode-only)
      [[ ${EPMOE_AB_NVFP4:-0} == 1 ]] && what=(--nvfp4-only)
      PYTHONUNBUFFERED=1 timeout -k 10 "${EPMOE_AB_TIMEOUT:-300}" python3 bench/bench_moe.py \
        --routings "${EPMOE_AB_ROUTINGS:-balanced}" --shapes "$shapes" "${what[@]}" \
        --lib "${EPMOE_AB_LIB:-$build/src/libepmoe.so}" \
        --out "$OUT/$prefix$i.json" > "$OUT/$prefix$i.log" 2>&1
    ) || status=1
    tail -2 "$OUT/$prefix$i.log"
    if (( i > 0 )); then
      python3 bench/compare_stages.py "$OUT/${prefix}0.json" "$OUT/$prefix$i.json" \
        >> "$OUT/${prefix}_compare.txt" || status=1
    fi
    i=$((i + 1))
  done
}

status=0
# SM clock, power and temperature of every GPU every 500 ms while the benchmarks run
# ($OUT/clocks.csv): step times that differ between machines or grow faster than the work
# (mixtral under skew) can be read against the clocks they ran at.
clock_log=""
if [[ $mode != test && $mode != profile ]] && command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu \
      --format=csv,noheader -lms 500 > "$OUT/clocks.csv" 2>/dev/null &
  clock_log=$!
fi
if [[ $mode == all || $mode == test ]]; then
  t0=$(date +%s)
  ctest --test-dir "$build" --output-on-failure -j 4 --timeout 600 > "$OUT/ctest.log" 2>&1 || status=1
  grep -E "tests passed|tests failed|\(Failed\)|\(SEGFAULT\)|\(Timeout\)|Skipped" "$OUT/ctest.log" | tail -40
  # Tolerance evidence: measured errors of the GPU layer tests.
  EPMOE_REPORT_ERRORS=1 "$build/tests/gpu/test_gpu_context" > "$OUT/gpu_context.log" 2>&1 || status=1
  grep -E "gpu vs|FAILED|PASSED" "$OUT/gpu_context.log" | head -40
  compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/gpu/test_gpu_context" \
      --gtest_filter='GpuContext.RepeatRunsAreBitwiseEqual:GpuContext.OverflowIsReported*' \
      > "$OUT/memcheck.log" 2>&1 || status=1
  tail -5 "$OUT/memcheck.log"
  # The fp8_block forward: measured CUDA-vs-CPU errors (kBackendTolerances evidence), and its
  # kernels (E4M3 dispatch, counted quantization, FP8 GEMMs) under memcheck on a small case.
  EPMOE_REPORT_ERRORS=1 "$build/tests/gpu/test_gpu_fp8_forward" > "$OUT/gpu_fp8_forward.log" 2>&1 || status=1
  grep -E "rel-L2|FAILED|PASSED" "$OUT/gpu_fp8_forward.log" | head -20
  compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/gpu/test_gpu_fp8_forward" \
      --gtest_filter='GpuFp8Forward.OverflowIsReported*' > "$OUT/memcheck_fp8.log" 2>&1 || status=1
  tail -3 "$OUT/memcheck_fp8.log"
  # The nvfp4 forward: measured CUDA-vs-CPU errors (kBackendTolerances evidence).
  EPMOE_REPORT_ERRORS=1 "$build/tests/gpu/test_gpu_nvfp4_forward" > "$OUT/gpu_nvfp4_forward.log" 2>&1 || status=1
  grep -E "rel-L2|FAILED|PASSED" "$OUT/gpu_nvfp4_forward.log" | head -20
  # The format codec kernels (partial blocks, odd packed rows) under memcheck.
  compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/gpu/test_gpu_formats" \
      --gtest_filter='GpuFormats.*BitwiseVsCpu' > "$OUT/memcheck_formats.log" 2>&1 || status=1
  tail -3 "$OUT/memcheck_formats.log"
  echo "tests: $(( $(date +%s) - t0 )) s, status $status"
fi
if [[ $mode == all || $mode == bench ]]; then
  PYTHONUNBUFFERED=1 python3 bench/bench_moe.py --out "$OUT/bench.json" \
      --lib "$build/src/libepmoe.so" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^ceilings" | tail -80
fi
if [[ $mode == ep ]]; then
  timeout -k 10 180 "$build/tests/gpu/test_gpu_capi_nccl" > "$OUT/capi_nccl.log" 2>&1 || status=1
  grep -E "reaches its peer|OK \]|FAILED|PASSED|SKIPPED" "$OUT/capi_nccl.log" | head -20
  t0=$(date +%s)
  # EPMOE_EP_TIMEOUT (s): a hang still returns the log and the JSON of the shapes that ran.
  PYTHONUNBUFFERED=1 timeout -k 10 "${EPMOE_EP_TIMEOUT:-480}" \
    python3 -m torch.distributed.run --standalone --nproc-per-node "${EPMOE_EP_SIZE:-2}" \
      bench/bench_ep.py --out "$OUT/bench_ep.json" --lib "$build/src/libepmoe.so" \
      --nccl-lib "$build/src/cuda/comm/libepmoe_nccl.so" --peer-store "$build/bench/ep_peer_store" \
      "$@" > "$OUT/bench_ep.log" 2>&1 || status=1
  tail -120 "$OUT/bench_ep.log"
  [[ -f $OUT/bench_ep.json ]] && python3 bench/results_table.py "$OUT/bench_ep.json" > "$OUT/bench_ep.md"
  echo "bench_ep: $(( $(date +%s) - t0 )) s, status $status"
fi
if [[ $mode == slots ]]; then
  "$build/tests/cpp/test_c_api" > "$OUT/c_api.log" 2>&1 || status=1
  grep -E "PASSED|FAILED" "$OUT/c_api.log" | head -10
  t0=$(date +%s)
  PYTHONUNBUFFERED=1 timeout -k 10 "${EPMOE_SLOTS_TIMEOUT:-420}" python3 bench/bench_slots.py \
      --out "$OUT/bench_slots.json" --lib "$build/src/libepmoe.so" "$@" > "$OUT/bench_slots.log" 2>&1 ||
    status=1
  tail -60 "$OUT/bench_slots.log"
  [[ -f $OUT/bench_slots.json ]] &&
    python3 bench/results_table.py "$OUT/bench_slots.json" > "$OUT/bench_slots.md"
  echo "bench_slots: $(( $(date +%s) - t0 )) s, status $status"
fi
if [[ $mode == profile ]]; then
  precision=${EPMOE_PROFILE_PRECISION:-fp8-train}
  decode=()
  [[ -n ${EPMOE_PROFILE_DECODE:-} ]] && decode=(--decode)
  for shape in "${@:-deepseek-v3}"; do
    python3 bench/one_step.py --shape "$shape" --precision "$precision" "${decode[@]}" --profile \
        --lib "$build/src/libepmoe.so" 2>&1 | grep -v -i warn >> "$OUT/profile.txt" || status=1
  done
  python3 bench/kernel_table.py "$OUT/profile.txt"
  if [[ -n ${EPMOE_NCU_KERNEL:-} ]]; then
    # EPMOE_NCU_METRICS=<m1,m2,...>: those metrics (e.g. the shared-memory wavefronts
    # l1tex__data_pipe_lsu_wavefronts_mem_shared.sum, smsp__inst_executed_op_shared_st.sum) instead
    # of the sections.
    what=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats
          --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis
          --section Occupancy --section SourceCounters)
    if [[ -n ${EPMOE_NCU_METRICS:-} ]]; then
      # Only the metrics this ncu knows (an unknown name fails the whole run): each name's base
      # (before the first '.') is looked up in --query-metrics; the dropped ones are printed.
      ncu --query-metrics > "$OUT/ncu_metrics.txt" 2>&1
      known=()
      IFS=, read -ra asked <<< "$EPMOE_NCU_METRICS"
      for m in "${asked[@]}"; do
        if grep -q "^${m%%.*} " "$OUT/ncu_metrics.txt"; then known+=("$m"); else echo "ncu: no metric ${m%%.*}"; fi
      done
      what=(--metrics "$(IFS=,; echo "${known[*]}")")
    fi
    ncu --clock-control none -k "regex:$EPMOE_NCU_KERNEL" --launch-skip "${EPMOE_NCU_SKIP:-4}" \
        --launch-count "${EPMOE_NCU_COUNT:-4}" "${what[@]}" \
        python3 bench/one_step.py --shape "${1:-deepseek-v3}" --precision "$precision" \
        "${decode[@]}" --steps 2 \
        --lib "$build/src/libepmoe.so" > "$OUT/ncu.txt" 2>&1 || status=1
    if [[ -n ${EPMOE_NCU_DENSE:-} ]]; then
      # The same counters on the dense bf16 matmul the ceilings are measured with (cuBLAS,
      # 8192^3), as a reference for what a GEMM at that rate loads: $OUT/ncu_dense.txt.
      ncu --clock-control none -k "regex:gemm|nvjet|xmma|cutlass" --launch-skip 1 --launch-count 1 \
          "${what[@]}" python3 -c \
          "import torch; a, b = (torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16) for _ in range(2)); [a @ b for _ in range(4)]; torch.cuda.synchronize()" \
          > "$OUT/ncu_dense.txt" 2>&1 || status=1
      grep -E "gemm|Kernel|__" "$OUT/ncu_dense.txt" | head -30
    fi
    if grep -q "No kernels were profiled" "$OUT/ncu.txt"; then
      echo "ncu profiled no launch of /$EPMOE_NCU_KERNEL/: EPMOE_NCU_SKIP=${EPMOE_NCU_SKIP:-4} may skip" \
           "them all (a step of mixtral's NVFP4 decode has 2 GEMM launches: SKIP=2 COUNT=2)"
      status=1
    fi
    grep -E "grouped_gemm|nvfp4_gemm|Duration|DRAM Throughput|Compute \(SM\) Throughput|No Eligible|Registers Per|Warp Cycles Per Issued|Stall|Issue Slots|Achieved Occupancy|Spilling|L2 Cache Throughput|L1/TEX Hit|__" "$OUT/ncu.txt" | head -100
  fi
fi
if [[ $mode == tests ]]; then
  for a in "$@"; do
    name=${a%%:*}
    filter=()
    [[ $a == *:* ]] && filter=(--gtest_filter="${a#*:}")
    bin=$(find "$build/tests" -name "$name" -type f -perm -u+x | head -1)
    if [[ -z $bin ]]; then echo "$name: no such test binary under $build/tests"; status=1; continue; fi
    t1=$(date +%s)
    timeout -k 10 "${EPMOE_TEST_TIMEOUT:-300}" "$bin" "${filter[@]}" > "$OUT/$name.log" 2>&1 || status=1
    echo "$name ($(( $(date +%s) - t1 )) s): $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/$name.log" | head -10
  done
fi
if [[ $mode == fp8wgrad ]]; then
  timeout -k 10 300 "$build/tests/gpu/test_gpu_wgrad_fp8" > "$OUT/wgrad_fp8.log" 2>&1 || status=1
  grep -E "pairs ==|OK \]|FAILED|PASSED|SKIPPED" "$OUT/wgrad_fp8.log" | head -30
  timeout -k 10 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$build/tests/gpu/test_gpu_wgrad_fp8" --gtest_filter='GpuWgradFp8.CtaPairs*' \
      > "$OUT/memcheck_wgrad_fp8.log" 2>&1 || status=1
  tail -3 "$OUT/memcheck_wgrad_fp8.log"
  shapes=$(IFS=,; echo "${*:-qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b}")
  ab_runs fp8wgrad fp8-train "$shapes" EPMOE_FP8_WGRAD_MULTICAST=0 EPMOE_FP8_WGRAD_MULTICAST=1
  cat "$OUT/fp8wgrad_compare.txt"
fi
if [[ $mode == ab ]]; then
  ab_runs ab "${EPMOE_AB_PRECISION:-bf16}" \
    "$(ab_shapes)" - "$@"
  cat "$OUT/ab_compare.txt"
fi
if [[ $mode == abpatch ]]; then
  patch_path=$(realpath "${1:?abpatch needs a patch file}")
  pairs=${2:-3}
  base_tree=build-base/tree
  t0=$(date +%s)
  rm -rf "$base_tree" && mkdir -p "$base_tree"
  tar --exclude='./build*' --exclude=./.git --exclude=./third_party -cf - . | tar -xf - -C "$base_tree"
  ln -s "$PWD/third_party" "$base_tree/third_party"
  if ! (cd "$base_tree" && patch -R -p1 --quiet < "$patch_path") > "$OUT/abpatch_patch.log" 2>&1; then
    cat "$OUT/abpatch_patch.log"; exit 1
  fi
  if ! { cmake -S "$base_tree" -B build-base/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPMOE_CUDA=ON \
           -DEPMOE_GEMM_CONFIGS=ALL && cmake --build build-base/build -j "$(nproc)" --target epmoe; } \
       > "$OUT/abpatch_build.log" 2>&1; then
    grep -E "error|Error" -A4 "$OUT/abpatch_build.log" | head -60; exit 1
  fi
  echo "base build: $(( $(date +%s) - t0 )) s"
  settings=()
  for (( p = 0; p < pairs; ++p )); do settings+=("EPMOE_AB_LIB=$PWD/build-base/build/src/libepmoe.so" -); done
  ab_runs abpatch "${EPMOE_AB_PRECISION:-bf16}" \
    "$(ab_shapes)" "${settings[@]}"
  cat "$OUT/abpatch_compare.txt"
fi
if [[ $mode == timeline ]]; then
  for shape in "${@:-deepseek-v3 gpt-oss-120b}"; do
    for s in $shape; do
      timeout -k 10 120 python3 bench/one_step.py --shape "$s" --precision bf16 \
          --lib "$build/src/libepmoe.so" > "$OUT/timeline_$s.txt" 2>&1 || status=1
    done
  done
  python3 bench/timeline_summary.py "$OUT"/timeline_*.txt | tee "$OUT/timeline_summary.txt"
fi
if [[ $mode == nvfp4 ]]; then
  t0=$(date +%s)
  for t in tests/cpp/test_formats tests/cpp/test_c_api tests/gpu/test_gpu_prepared_weights; do
    "$build/$t" > "$OUT/nvfp4_$(basename "$t").log" 2>&1 || status=1
    grep -E "FAILED|PASSED" "$OUT/nvfp4_$(basename "$t").log" | head -10
  done
  for t in test_gpu_gemm_nvfp4 test_gpu_nvfp4_forward; do
    EPMOE_REPORT_ERRORS=1 "$build/tests/gpu/$t" > "$OUT/nvfp4_$t.log" 2>&1 || status=1
    grep -E "rel-L2|worst|FAILED|PASSED|Failure" "$OUT/nvfp4_$t.log" | head -30
  done
  compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/gpu/test_gpu_gemm_nvfp4" \
      > "$OUT/nvfp4_memcheck_gemm.log" 2>&1 || status=1
  tail -3 "$OUT/nvfp4_memcheck_gemm.log"
  compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/gpu/test_gpu_nvfp4_forward" \
      --gtest_filter='GpuNvfp4Forward.OverflowIsReported*' > "$OUT/nvfp4_memcheck_forward.log" 2>&1 ||
    status=1
  tail -3 "$OUT/nvfp4_memcheck_forward.log"
  echo "nvfp4 tests: $(( $(date +%s) - t0 )) s, status $status"
  PYTHONUNBUFFERED=1 timeout -k 10 "${EPMOE_NVFP4_BENCH_TIMEOUT:-360}" python3 bench/bench_moe.py \
      --nvfp4-only --out "$OUT/bench_nvfp4.json" --lib "$build/src/libepmoe.so" "$@" \
      > "$OUT/bench_nvfp4.log" 2>&1 || status=1
  grep -v "^ceilings" "$OUT/bench_nvfp4.log" | tail -40
  # Split-K against fixed split counts (EPMOE_NVFP4_SPLITK; 1 = the single-kernel path, the default) on the
  # shapes where the heuristic splits: $OUT/bench_nvfp4_splitk<n>.json / .log.
  for n in ${EPMOE_NVFP4_SPLITK_SWEEP-auto}; do
    EPMOE_NVFP4_SPLITK=$n PYTHONUNBUFFERED=1 timeout -k 10 "${EPMOE_NVFP4_BENCH_TIMEOUT:-360}" \
      python3 bench/bench_moe.py --nvfp4-only --routings balanced \
      --shapes "${EPMOE_NVFP4_SPLITK_SHAPES:-mixtral-8x7b}" --out "$OUT/bench_nvfp4_splitk$n.json" \
      --lib "$build/src/libepmoe.so" > "$OUT/bench_nvfp4_splitk$n.log" 2>&1 || status=1
    grep -E "epmoe-nvfp4" "$OUT/bench_nvfp4_splitk$n.log" | tail -8
  done
fi
if [[ -n $clock_log ]]; then
  kill "$clock_log" 2>/dev/null
  python3 bench/clock_summary.py "$OUT/clocks.csv" || true
fi
exit $status
