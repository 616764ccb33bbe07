#!/usr/bin/env bash
# session 28, call 1: FP8 row trimming tests, GEMM alone on routed rows, fp8-train A / B
set -u
export EPMOE_SHA=1732616
timeout 300 bash bench/device.sh tests test_gpu_gemm_fp8_tiles test_gpu_fp8_dgrad_swiglu test_gpu_fp8_training test_gpu_gemm_fp8 2>&1 | tail -40
cmake --build build-gpu -j 16 --target bench_gemm_fp8 > $OUT/bench_build.log 2>&1 || tail -20 $OUT/bench_build.log
timeout 150 build-gpu/bench/bench_gemm_fp8 --rows routed --trim-rows both --iters 10 > $OUT/gemm-fp8-routed.txt 2>&1
grep -v JSON $OUT/gemm-fp8-routed.txt
EPMOE_AB_PRECISION=fp8-train timeout 240 bash bench/device.sh ab EPMOE_FP8_TRIM_ROWS=0 - EPMOE_FP8_TRIM_ROWS=0 2>&1 | grep -v "^  \(publish\|barrier\|plan_\|route \|grad_scores\)" | tail -80
ls $OUT
