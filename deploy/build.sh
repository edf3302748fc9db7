#!/usr/bin/env bash
# Configures and builds kvferry into ./build (CUDA when nvcc is found, else cpu only).
# Usage: deploy/build.sh [extra cmake configure args...]
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${KVFERRY_JOBS:-2}
cmake --preset default "$@"
cmake --build build -j"$jobs"
