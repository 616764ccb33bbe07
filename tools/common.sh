# shellcheck shell=bash
# Sourced by tools/run.sh and tools/test.sh: prerequisites, configure, build.
#
# Environment (all optional):
#   EPMOE_CUDA          AUTO (default): build the CUDA backend when nvcc is found; ON; OFF
#   EPMOE_GEMM_CONFIGS  CI (default here: one GEMM configuration per kernel family) or ALL
#   EPMOE_BUILD_DIR     build directory (default: build/ in the repository)
#   EPMOE_JOBS          parallel build and test jobs (default: all cores)

EPMOE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EPMOE_BUILD_DIR=${EPMOE_BUILD_DIR:-$EPMOE_ROOT/build}
EPMOE_JOBS=${EPMOE_JOBS:-$(nproc 2>/dev/null || echo 2)}

epmoe_say() { printf '== %s\n' "$*"; }
epmoe_die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# GoogleTest: installed headers, or sources in third_party/googletest (tests/CMakeLists.txt).
epmoe_have_gtest() {
  local dir
  for dir in /usr/include /usr/local/include ${GTEST_ROOT:+"$GTEST_ROOT/include"}; do
    [ -f "$dir/gtest/gtest.h" ] && return 0
  done
  [ -f "$EPMOE_ROOT/third_party/googletest/CMakeLists.txt" ]
}

# epmoe_apt_install PACKAGE...: apt-get install as root, or through sudo when it needs no password.
epmoe_apt_install() {
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo)
    else
      epmoe_die "missing $*; install them as root: apt-get install -y $*"
    fi
  fi
  command -v apt-get >/dev/null 2>&1 || epmoe_die "missing $* and no apt-get to install them with"
  epmoe_say "installing $*"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

# Installs what is missing of cmake, ninja, g++ and GoogleTest (Debian/Ubuntu: apt-get).
epmoe_prereqs() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  epmoe_have_gtest || missing+=(libgtest-dev)
  [ ${#missing[@]} -eq 0 ] || epmoe_apt_install "${missing[@]}"
  local version
  version=$(cmake --version | sed -n 's/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')
  printf '3.25\n%s\n' "$version" | sort -V -C ||
    epmoe_die "cmake $version is too old; epmoe needs 3.25 or newer"
  # CMake finds nvcc on PATH or through CUDACXX; the toolkit's default location is not on PATH
  # everywhere.
  if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 &&
    [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
}

# The CUDA backend needs CUTLASS/CuTe headers (DESIGN.md §7: pip nvidia-cutlass==4.2.0.0, headers
# under cutlass_library/source/include). When CUDA will be built and third_party/cutlass-include
# is missing, download that wheel (no install) and unpack its headers there.
EPMOE_CUTLASS_WHEEL=nvidia-cutlass==4.2.0.0
epmoe_cutlass() {
  [ "${EPMOE_CUDA:-AUTO}" = OFF ] && return 0
  command -v nvcc >/dev/null 2>&1 || [ -n "${CUDACXX:-}" ] || return 0
  local dest=$EPMOE_ROOT/third_party/cutlass-include
  [ -f "$dest/cutlass/cutlass.h" ] && return 0
  epmoe_say "fetching CUTLASS headers ($EPMOE_CUTLASS_WHEEL) into third_party/cutlass-include"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    epmoe_apt_install python3-pip
  fi
  local wheels=$EPMOE_ROOT/.whl
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "$EPMOE_CUTLASS_WHEEL"
  python3 - "$wheels" "$dest" <<'PY'
import glob, os, sys, zipfile
wheels, dest = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(sorted(glob.glob(os.path.join(wheels, "nvidia_cutlass-*.whl")))[-1]) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(dest, name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                dst.write(src.read())
PY
  [ -f "$dest/cutlass/cutlass.h" ] || epmoe_die "no cutlass/cutlass.h in $EPMOE_CUTLASS_WHEEL"
}

# Release build in $EPMOE_BUILD_DIR with Ninja.
epmoe_configure() {
  epmoe_cutlass
  local cache=$EPMOE_BUILD_DIR/CMakeCache.txt
  if [ -f "$cache" ] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$cache"; then
    epmoe_say "$EPMOE_BUILD_DIR was configured with another generator; starting it afresh"
    rm -rf "$cache" "$EPMOE_BUILD_DIR/CMakeFiles"
  fi
  epmoe_say "configure ($EPMOE_BUILD_DIR, EPMOE_CUDA=${EPMOE_CUDA:-AUTO})"
  cmake -S "$EPMOE_ROOT" -B "$EPMOE_BUILD_DIR" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DEPMOE_CUDA="${EPMOE_CUDA:-AUTO}" \
    -DEPMOE_GEMM_CONFIGS="${EPMOE_GEMM_CONFIGS:-CI}"
}

# epmoe_build [target...]: builds everything, or the given targets.
epmoe_build() {
  local targets=()
  [ $# -gt 0 ] && targets=(--target "$@")
  epmoe_say "build (${EPMOE_JOBS} jobs)"
  cmake --build "$EPMOE_BUILD_DIR" -j "$EPMOE_JOBS" "${targets[@]}"
}
