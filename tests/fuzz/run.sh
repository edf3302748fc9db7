#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS, growing CORPUS (kept between runs) from SEEDS.
# Usage: tests/fuzz/run.sh FUZZER SECONDS CORPUS [SEED_DIR...]
# Longer on demand, e.g. an hour per target:  tests/fuzz/run.sh build-asan/tests/fuzz/service_fuzz 3600 corpus/service
set -euo pipefail
fuzzer=$1 seconds=$2 corpus=$3
shift 3
mkdir -p "$corpus"
# Findings (crash, sanitizer report, leak, an input over 10 s) stop the run and fail it. The golden
# files are up to 40 KB: inputs may be as long.
# A finding is summed up at the end of the output, where a CI log's tail shows it: the
# target's own message (lines starting with its name), and the input that found it in
# base64 when it is small (else its path), to replay with `base64 -d > input && FUZZER input`.
name=$(basename "$fuzzer")
prefix="$corpus/../$name-"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
"$fuzzer" "$corpus" "$@" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
  -max_len=65536 -print_final_stats=1 -detect_leaks=1 -artifact_prefix="$prefix" \
  > >(tee "$log") 2>&1 || status=$?
wait
if [ "$status" -ne 0 ]; then
  echo "==== $name failed (exit $status)"
  grep -a -E "^($name: |SUMMARY: |==[0-9]+==ERROR)" "$log" | head -20 || true
  for artifact in "$prefix"*; do
    [ -f "$artifact" ] || continue
    if [ "$(stat -c %s "$artifact")" -le 8192 ]; then
      echo "input $artifact, base64:"
      base64 -w 0 "$artifact"
      echo
    else
      echo "input $artifact ($(stat -c %s "$artifact") bytes)"
    fi
  done
fi
exit "$status"
