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
exec "$fuzzer" "$corpus" "$@" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
  -max_len=65536 -print_final_stats=1 -detect_leaks=1 -artifact_prefix="$corpus/../$(basename "$fuzzer")-"
