#!/usr/bin/env bash
# One command for a fresh Debian 12 machine (as root): install what kvferry needs, build it
# with its tests, and run the whole suite — the plain build first (GPU tests skip cleanly
# where there is no GPU; it includes the checks of the deployment files: promtool,
# systemd-analyze, the container entrypoint, and a real Prometheus scraping a real kvferryd),
# then the unit and integration suites again under AddressSanitizer + UBSan, with a bounded
# run of every fuzz target, and under ThreadSanitizer.
# KVFERRY_SANITIZERS=0 runs the plain build only; KVFERRY_TSAN=0 leaves out the
# ThreadSanitizer run; KVFERRY_FUZZ_SECONDS sets each fuzz target's run (default 30 s;
# tests/fuzz/run.sh runs one for longer).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh -DKVFERRY_BUILD_TESTS=ON -DKVFERRY_BUILD_BENCH=ON
ctest --test-dir build --output-on-failure -j"${KVFERRY_JOBS:-2}" "$@"
if [ "${KVFERRY_SANITIZERS:-1}" != 0 ]; then
  tests/sanitize.sh asan
fi
if [ "${KVFERRY_SANITIZERS:-1}" != 0 ] && [ "${KVFERRY_TSAN:-1}" != 0 ]; then
  tests/sanitize.sh tsan
fi
