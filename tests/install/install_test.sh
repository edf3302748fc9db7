#!/usr/bin/env bash
# Installs the client package from BUILD_DIR into a temporary prefix, builds a program
# outside the tree against it with find_package(kvferryClient), and runs it against a
# port where nothing listens: it must link, run and report UNAVAILABLE.
set -euo pipefail
build_dir=$1
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/kvferry/client/client.h"
cmake -S "$here/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
out=$("$work/build/consumer" 127.0.0.1:1)
echo "consumer says: $out"
[ "$out" = "UNAVAILABLE" ]
