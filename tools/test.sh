#!/usr/bin/env bash
# Sets up and runs every test: installs missing prerequisites, builds (Release, build/), runs the
# C++ tests with CTest. CUDA sources are compiled when nvcc exists; GPU tests skip without a GPU.
# Environment: see tools/common.sh (EPMOE_CUDA=OFF skips the CUDA backend).
set -euo pipefail
# shellcheck source=tools/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start=$SECONDS

epmoe_prereqs
epmoe_configure
# shellcheck disable=SC2119  # no targets: build everything
epmoe_build

if ! nvidia-smi -L > /dev/null 2>&1; then
  epmoe_say "no GPU on this machine: the GPU tests (Gpu*) run and report 'Skipped' (no CUDA device)"
fi
epmoe_say "ctest"
status=0
ctest --test-dir "$EPMOE_BUILD_DIR" --output-on-failure -j "$EPMOE_JOBS" || status=$?

# ---- Python tests (pytest) ------------------------------------------------------------------
# The binding's stage goes here: build/install the Python package, then run pytest over
# tests/python. Skipped while there is no tests/python.
if [ -d "$EPMOE_ROOT/tests/python" ]; then
  epmoe_say "pytest"
  python3 -m pytest -q "$EPMOE_ROOT/tests/python" || status=$?
else
  epmoe_say "pytest: skipped (no tests/python yet)"
fi
# ---- end of Python tests --------------------------------------------------------------------

epmoe_say "tools/test.sh: $([ "$status" -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
exit "$status"
