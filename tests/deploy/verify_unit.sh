#!/usr/bin/env bash
# The systemd unit, with ExecStart pointed at the built kvferryd, passes `systemd-analyze
# verify` without a single complaint, and `systemd-analyze security` rates its sandbox at
# exposure 2.0 or better (0 best, 10 worst). Neither needs a running systemd.
# Usage: verify_unit.sh UNIT KVFERRYD [SYSTEMD_ANALYZE]; exit 77 (skip) where the tool is
# not installed.
set -euo pipefail
unit=$1 daemon=$2 analyze=${3:-}
if [ -z "$analyze" ] || [ "${analyze%-NOTFOUND}" != "$analyze" ] || [ ! -x "$analyze" ]; then
  echo "SKIPPED: systemd-analyze is not installed (Debian package systemd)"
  exit 77
fi
[ -x "$daemon" ] || { echo "kvferryd '$daemon' is not an executable"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
copy=$tmp/kvferryd.service
sed "s|/usr/local/bin/kvferryd|$daemon|g" "$unit" > "$copy"
grep -q "^ExecStart=$daemon " "$copy" || { echo "the unit's ExecStart is not /usr/local/bin/kvferryd"; exit 1; }

# verify exits 0 on some findings (an unknown directive is only a warning): any line about
# the unit fails the test.
status=0
output=$("$analyze" verify "$copy" 2>&1) || status=$?
echo "$output"
if [ "$status" -ne 0 ] || grep -q "kvferryd.service" <<<"$output"; then
  echo "FAILED: systemd-analyze verify (exit $status)"
  exit 1
fi
if ! "$analyze" security --offline=true --threshold=20 "$copy" > "$tmp/security" 2>&1; then
  grep -v "^✓" "$tmp/security" || true
  echo "FAILED: systemd-analyze security rates the unit above exposure 2.0"
  exit 1
fi
tail -n 1 "$tmp/security"
echo "PASSED: systemd-analyze verify and security"
