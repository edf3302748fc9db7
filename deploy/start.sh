#!/usr/bin/env bash
# One command for a fresh Debian 12 machine (as root): install what kvferry needs, build it,
# and start kvferryd in the foreground. Arguments are passed to kvferryd.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
exec build/server/kvferryd "$@"
