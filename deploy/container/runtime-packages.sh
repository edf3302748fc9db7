#!/usr/bin/env bash
# Prints, one a line, the packages that hold the shared libraries the given binaries load
# (found with ldd and dpkg -S), so that the container's runtime stage installs exactly
# those whatever the distribution names them. Left out: the C library and the CUDA
# libraries, which the CUDA runtime base image and the host's driver provide.
# Libraries of kvferry's own UCX build (/opt/kvferry, deploy/ucx.sh) are not packages: the
# image copies that directory, and the packages its libraries and the UCX transport modules
# it loads at run time need are listed instead.
# Fails when a library is not found, or no package holds it.
# Usage: runtime-packages.sh BINARY...
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: runtime-packages.sh BINARY..." >&2; exit 2; }
own=/opt/kvferry/
objects=("$@")
if [[ "$(ldd "$@")" == *" => $own"* ]]; then
  for module in "$own"ucx/lib/ucx/*.so.0; do
    [ -e "$module" ] && objects+=("$module")
  done
fi
libraries=$(ldd "${objects[@]}" | awk '$2 == "=>" && $3 == "not" { print "MISSING " $1; next }
                                      $2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u)
if grep -q '^MISSING' <<<"$libraries"; then
  grep '^MISSING' <<<"$libraries" | sed 's/^MISSING /runtime-packages: not found: /' >&2
  exit 1
fi
for library in $libraries; do
  case "$(basename "$library")" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libcuda.so*|libcudart.so*) continue ;;
  esac
  case "$library" in "$own"*) continue ;; esac
  # Merged /usr: the package may have registered the /lib or the /usr/lib path.
  real=$(readlink -f "$library")
  package=""
  for path in "$library" "$real" "${real#/usr}" "/usr${real}"; do
    if package=$(dpkg -S "$path" 2>/dev/null | head -n 1 | cut -d: -f1) && [ -n "$package" ]; then
      break
    fi
  done
  [ -n "$package" ] || { echo "runtime-packages: no package holds $library" >&2; exit 1; }
  echo "$package"
done | sort -u
