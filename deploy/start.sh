#!/usr/bin/env bash
# One command for a fresh Debian 12 machine (as root): install what kvferry needs to build
# and run (not the test packages: deploy/test.sh adds those), build kvferryd and the kvferry
# command (not the tests and benchmarks), and start kvferryd in the foreground. Arguments
# are passed to kvferryd.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --build
deploy/build.sh -DKVFERRY_BUILD_TESTS=OFF -DKVFERRY_BUILD_BENCH=OFF
exec build/server/kvferryd "$@"
