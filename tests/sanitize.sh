#!/usr/bin/env bash
# Builds a sanitizer preset (asan: AddressSanitizer + UBSan + the fuzz targets; tsan:
# ThreadSanitizer) and runs the unit and integration suites (and, for asan, a bounded run
# of every fuzz target) under it. Every process a test starts — the kvferryd daemons too —
# writes its sanitizer reports to one folder; any report fails the run, even one from a
# daemon the test then killed.
# Usage: tests/sanitize.sh asan|tsan [extra ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=$1
shift
jobs=${KVFERRY_JOBS:-2}
build=build-$preset
cmake --preset "$preset" -DKVFERRY_FUZZ_SECONDS="${KVFERRY_FUZZ_SECONDS:-30}" >/dev/null
cmake --build "$build" -j"$jobs"

reports=$PWD/$build/sanitizer-reports
rm -rf "$reports" && mkdir -p "$reports"
suppressions=$PWD/tests/sanitizer-suppressions
# Only the preset's own runtimes are configured: the runtimes share their common flags
# (log_path among them), so another runtime's options would override these.
if [ "$preset" = asan ]; then
  export ASAN_OPTIONS="log_path=$reports/asan:strict_string_checks=1"
  export UBSAN_OPTIONS="log_path=$reports/ubsan:print_stacktrace=1:halt_on_error=1"
  export LSAN_OPTIONS="suppressions=$suppressions/lsan.txt"
  labels='unit|integration|fuzz'
  exclude='python_client_test|ClientPackage'
else
  export TSAN_OPTIONS="log_path=$reports/tsan:suppressions=$suppressions/tsan.txt:second_deadlock_stack=1:history_size=4"
  labels='unit|integration'
  # The exhaustive per-value numerics start no thread (ThreadSanitizer has nothing to find
  # there) and take over a minute under it; the plain and ASan runs keep them.
  exclude='python_client_test|ClientPackage|CpuExhaustiveTest'
fi
# UCX's memory hooks patch mmap/munmap and friends, which the sanitizers intercept too;
# the transports the tests use (tcp, cma) do not need them.
export UCX_MEM_EVENTS=no
status=0
# The Python client test drives the same daemon through pytest (no new server code), and
# the install test builds outside the tree without the sanitizer runtime: left to the
# plain build.
ctest --test-dir "$build" --output-on-failure -j"$jobs" -L "$labels" \
  -E "$exclude" --timeout 900 "$@" || status=$?
# A report is a file with something in it: a process killed while its runtime opened the
# log leaves an empty one. LeakSanitizer's "Unable to get registers from thread N" (a thread
# that exited while the leak check stopped the world) is a notice, not a finding: that
# thread's stack is then scanned whole, so leaks are still reported on their own lines.
notice='^==[0-9]+==Unable to get registers from thread [0-9]+\.$'
found=""
for f in $(find "$reports" -type f -size +0 | sort); do
  if grep -qvE "$notice" "$f"; then
    found="$found $f"
  else
    echo "sanitizer notice only ($preset), not a report: $f: $(head -1 "$f")" >&2
  fi
done
if [ -n "$found" ]; then
  echo "sanitizer reports ($preset):" >&2
  for f in $found; do echo "== $f" >&2; head -60 "$f" >&2; done
  status=1
fi
exit $status
