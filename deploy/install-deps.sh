#!/usr/bin/env bash
# Installs, idempotently, every Debian 12 package kvferry needs to build, test and run
# (clang and its runtimes: the sanitizer, thread-safety and fuzz builds; prometheus, systemd
# and python3-yaml: the checks of the deployment files).
# Run as root. The CUDA toolkit (nvcc) is not a Debian package here: when it is on the
# PATH (or in /usr/local/cuda/bin) the build uses it, otherwise it builds cpu-only.
set -euo pipefail

# What building kvferryd and the kvferry command needs (the container's build stage
# installs only these: `install-deps.sh --build`).
build_packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libspdlog-dev libfmt-dev
  libcpp-httplib-dev libxxhash-dev nlohmann-json3-dev libhwy-dev libssl-dev openssl
  libtomlplusplus-dev
)
# The tests, benchmarks, sanitizer builds and the checks of the deployment files.
test_packages=(
  libucx-dev ucx-utils
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
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing ${missing[*]}; run this script as root" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: installed ${missing[*]}"
