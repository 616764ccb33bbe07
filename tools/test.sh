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
# A virtual environment in $EPMOE_BUILD_DIR/pyenv gets torch (PyPI; EPMOE_TORCH_VERSION, default
# the GPU machine's 2.11.0), pytest and scikit-build-core; the package is built from this tree
# with `pip install --no-build-isolation .` (CMake build dir $EPMOE_BUILD_DIR/py, incremental) and
# tests/python runs against it. The Python build leaves CUDA out where no GPU is present
# (EPMOE_PY_CUDA overrides: AUTO, ON, OFF); CUDA tests then skip with a message.
# EPMOE_PYTEST=0 skips this section.
if [ "${EPMOE_PYTEST:-1}" != 0 ] && [ -d "$EPMOE_ROOT/tests/python" ]; then
  epmoe_say "pytest: environment"
  pyenv_dir=$EPMOE_BUILD_DIR/pyenv
  if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    epmoe_apt_install python3-venv
  fi
  [ -x "$pyenv_dir/bin/python" ] || python3 -m venv "$pyenv_dir"
  py=$pyenv_dir/bin/python
  torch_version=${EPMOE_TORCH_VERSION:-2.11.0}
  if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null ||
    ! "$py" -c 'import pytest, scikit_build_core' 2>/dev/null; then
    # torch from PyPI brings its CUDA libraries: ~5 GB installed, ~3 GB more while downloading.
    # No pip cache, so the downloads do not stay on disk after the install.
    free_mib=$(df -Pm "$pyenv_dir" | awk 'NR == 2 { print $4 }')
    epmoe_say "pytest: installing torch==$torch_version ($free_mib MiB free in $pyenv_dir; ~8000 MiB needed)"
    if [ "${free_mib:-0}" -lt 8000 ]; then
      epmoe_say "pytest: warning: less than 8000 MiB free; the torch install may fail with 'No space left on device'"
    fi
    "$py" -m pip install -q --no-cache-dir --disable-pip-version-check "torch==$torch_version" pytest "scikit-build-core>=0.10"
  fi
  py_cuda=${EPMOE_PY_CUDA:-}
  if [ -z "$py_cuda" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then py_cuda=AUTO; else py_cuda=OFF; fi
  fi
  epmoe_say "pytest: pip install . (EPMOE_CUDA=$py_cuda)"
  if "$py" -m pip install -q --no-cache-dir --disable-pip-version-check --no-build-isolation \
    -C build-dir="$EPMOE_BUILD_DIR/py" -C cmake.define.EPMOE_CUDA="$py_cuda" "$EPMOE_ROOT"; then
    epmoe_say "pytest"
    (cd "$EPMOE_BUILD_DIR" && "$py" -m pytest -q -rs -p no:cacheprovider -c "$EPMOE_ROOT/pyproject.toml" \
      --rootdir "$EPMOE_ROOT" "$EPMOE_ROOT/tests/python") || status=$?
  else
    epmoe_say "pytest: the Python package did not build"
    status=1
  fi
else
  epmoe_say "pytest: skipped"
fi
# ---- end of Python tests --------------------------------------------------------------------

epmoe_say "tools/test.sh: $([ "$status" -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
exit "$status"
