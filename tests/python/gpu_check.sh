#!/usr/bin/env bash
# The Python binding's checks on a GPU machine (run from the repository root; nothing is fetched):
# builds and installs the package with CUDA (and the NCCL transport where NCCL >= 2.28 is found)
# into the interpreter that holds torch, runs tests/python (CUDA tests included; the two-GPU ones
# need 2 GPUs), then the per-call overhead benchmark. Needs third_party/cutlass-include (carried).
#   bash tests/python/gpu_check.sh            # logs under $OUT when set, else build/py-gpu
#   EPMOE_PYTEST_ARGS="tests/python/test_cuda.py" bash tests/python/gpu_check.sh   # a subset
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
logs=${OUT:-$root/build/py-gpu}
mkdir -p "$logs" "$root/build"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
echo "== torch $("$py" -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "GPU(s)")')"
echo "== pip install . (CUDA)"
"$py" -m pip install --no-build-isolation --no-deps -C build-dir="$root/build/py-gpu-cmake" \
  -C cmake.define.EPMOE_CUDA=ON "$root" -v > "$logs/pip.log" 2>&1 || { tail -40 "$logs/pip.log"; exit 1; }
"$py" -c 'import torch, epmoe; print("== epmoe", epmoe.library_path(), "cuda devices", torch.ops.epmoe._cuda_device_count(), "nccl", torch.ops.epmoe._has_nccl())'
# Smoke: one op that takes and returns strings. On failure, the native backtrace (cuda-gdb runs
# host-only programs; the GPU machine has no gdb) and the ABI facts that usually explain it.
smoke='import sys; sys.path.insert(0, "'"$root"'/tests/python"); import conftest, epmoe; print(epmoe.plan_memory(conftest.tiny_config(), 1).explain().splitlines()[0])'
if ! "$py" -c "$smoke" > "$logs/smoke.log" 2>&1; then
  status=1
  echo "== smoke FAILED:"; tail -5 "$logs/smoke.log"
  "$py" -c 'import torch; print("torch CXX11 ABI", torch._C._GLIBCXX_USE_CXX11_ABI, torch.__file__)'
  c++ --version | head -1
  grep -E "epmoe: torch|CXX_COMPILER|_GLIBCXX" "$logs/pip.log" | head
  lib=$("$py" -c 'import os, epmoe; print(os.path.dirname(epmoe.library_path()))' 2>/dev/null)
  ls -la "$lib"; ldd "$lib/libepmoe_torch.so" | grep -E "epmoe|stdc|torch|nccl|c10"
  if command -v cuda-gdb >/dev/null; then
    cuda-gdb -batch -ex run -ex bt --args "$py" -c "$smoke" 2>&1 | grep -E "^#|signal|Program" | head -40
  fi
else
  cat "$logs/smoke.log"
fi
echo "== pytest"
(cd "$root/build" && "$py" -m pytest -q -rs -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$root" \
  ${EPMOE_PYTEST_ARGS:-"$root/tests/python"} 2>&1 | tee "$logs/pytest.log") || status=1
echo "== bench/bench_python_overhead.py"
"$py" "$root/bench/bench_python_overhead.py" 2>&1 | tee "$logs/bench.log" || status=1
echo "== gpu_check: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
