#!/usr/bin/env bash
# Installs, idempotently, every Debian 12 package kvferry needs to build, test and run.
# Run as root. The CUDA toolkit (nvcc) is not a Debian package here: when it is on the
# PATH (or in /usr/local/cuda/bin) the build uses it, otherwise it builds cpu-only.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libucx-dev ucx-utils libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libcpp-httplib-dev libxxhash-dev nlohmann-json3-dev libhwy-dev libssl-dev openssl
  prometheus curl python3 procps
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-xxhash
  python3-pip python3-venv python3-setuptools python3-wheel
)

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
