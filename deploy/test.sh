#!/usr/bin/env bash
# One command for a fresh Debian 12 machine (as root): install what kvferry needs, build it
# with its tests, and run the whole suite. GPU tests skip cleanly where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
ctest --test-dir build --output-on-failure -j"${KVFERRY_JOBS:-2}" "$@"
