#!/usr/bin/env bash
# Installs, idempotently, every Debian 12 package kvferry needs to build, test and run
# (clang and its runtimes: the sanitizer, thread-safety and fuzz builds; prometheus, systemd
# and python3-yaml: the checks of the deployment files).
# Run as root. The CUDA toolkit (nvcc) is not a Debian package here: when it is on the
# PATH (or in /usr/local/cuda/bin) the build uses it, otherwise it builds cpu-only.
# Where kvferry carries fixes for the distribution's UCX version (deploy/patches/ucx/<major.
# minor>/: Debian 12's 1.13), it then builds that UCX with them into /opt/kvferry/ucx
# (deploy/ucx.sh, once; again when the patches change), which the build links kvferryd with.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

# What building kvferryd and the kvferry command needs (the container's build stage
# installs only these: `install-deps.sh --build`).
build_packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates libucx-dev
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libspdlog-dev libfmt-dev
  libcpp-httplib-dev libxxhash-dev nlohmann-json3-dev libhwy-dev libssl-dev openssl
  libtomlplusplus-dev
)
# The tests, benchmarks, sanitizer builds and the checks of the deployment files.
test_packages=(
  ucx-utils
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  clang libclang-rt-14-dev
  prometheus curl python3 procps systemd shellcheck
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-xxhash python3-yaml
  python3-pip python3-venv python3-setuptools python3-wheel
)
case "${1:-}" in
  --build) packages=("${build_packages[@]}") ;;
  "") packages=("${build_packages[@]}" "${test_packages[@]}") ;;
  *) echo "usage: install-deps.sh [--build]" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
elif [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing ${missing[*]}; run this script as root" >&2
  exit 1
else
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
  echo "install-deps: installed ${missing[*]}"
fi

# UCX with kvferry's fixes for the distribution's version, where it has some.
ucx_version="$(dpkg-query -W -f='${Version}' libucx0 2>/dev/null |
  sed -E 's/^([0-9]+:)?([0-9]+\.[0-9]+).*/\2/' || true)"
ucx_patches="$here/patches/ucx/$ucx_version"
ucx_prefix="${KVFERRY_UCX_PREFIX:-/opt/kvferry/ucx}"
if [ -n "$ucx_version" ] && [ -d "$ucx_patches" ]; then
  want="$(cat "$ucx_patches"/*.patch | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$ucx_prefix/kvferry-patches" 2>/dev/null)" = "$want" ]; then
    echo "install-deps: UCX $ucx_version with kvferry's fixes present in $ucx_prefix"
  elif [ "$(id -u)" -ne 0 ]; then
    echo "install-deps: UCX $ucx_version needs kvferry's fixes; run this script as root" >&2
    exit 1
  else
    echo "install-deps: building UCX $ucx_version with kvferry's fixes into $ucx_prefix (minutes)"
    "$here/ucx.sh" "$ucx_prefix"
  fi
fi
