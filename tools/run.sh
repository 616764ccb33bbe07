#!/usr/bin/env bash
# Sets up, builds and runs the main job: build/apps/epmoe_run with the given arguments (default:
# shape ci-tiny on 2 ranks; GPUs when epmoe has its CUDA backend and one is visible, else thread
# ranks on the CPU). `bash tools/run.sh --help` lists the options.
# Environment: see tools/common.sh.
set -euo pipefail
# shellcheck source=tools/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

epmoe_prereqs
epmoe_configure
epmoe_build epmoe_run
epmoe_say "build/apps/epmoe_run $*"
exec "$EPMOE_BUILD_DIR/apps/epmoe_run" "$@"
