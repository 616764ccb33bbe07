#!/usr/bin/env bash
# The Python binding's checks on a GPU machine (run from the repository root; nothing is fetched):
# builds and installs the package with CUDA (and the NCCL transport where NCCL >= 2.28 is found)
# into the interpreter that holds torch, runs tests/python (CUDA tests included; the two-GPU ones
# need 2 GPUs), then the per-call overhead benchmark. Needs third_party/cutlass-include (carried).
#   bash tests/python/gpu_check.sh            # logs under $OUT when set, else build/py-gpu
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
logs=${OUT:-$root/build/py-gpu}
mkdir -p "$logs" "$root/build"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
echo "== torch $("$py" -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "GPU(s)")')"
echo "== pip install . (CUDA)"
"$py" -m pip install -q --no-build-isolation --no-deps -C build-dir="$root/build/py-gpu-cmake" \
  -C cmake.define.EPMOE_CUDA=ON "$root" > "$logs/pip.log" 2>&1 || { tail -40 "$logs/pip.log"; exit 1; }
"$py" -c 'import torch, epmoe; print("== epmoe", epmoe.library_path(), "cuda devices", torch.ops.epmoe._cuda_device_count(), "nccl", torch.ops.epmoe._has_nccl())'
echo "== pytest"
(cd "$root/build" && "$py" -m pytest -q -rs -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$root" \
  "$root/tests/python" 2>&1 | tee "$logs/pytest.log") || status=1
echo "== bench/bench_python_overhead.py"
"$py" "$root/bench/bench_python_overhead.py" 2>&1 | tee "$logs/bench.log" || status=1
echo "== gpu_check: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
