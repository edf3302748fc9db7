#!/usr/bin/env bash
# Builds the distribution's own UCX version, from its source package, with kvferry's patches
# for it (deploy/patches/ucx/<major.minor>/: fixes that upstream made in later versions),
# into a prefix.
# kvferry builds and runs against this UCX: its build finds the prefix (KVFERRY_UCX_PREFIX,
# default /opt/kvferry/ucx) and links kvferryd with it on the run path. install-deps.sh runs
# this script once.
#
#   deploy/ucx.sh [--cuda] [PREFIX]   # as root; PREFIX default /opt/kvferry/ucx
#
# --cuda adds UCX's CUDA transports (cuda_copy, cuda_ipc; Debian's and Ubuntu's UCX packages
# have none), so a kvferryd run with UCX_TLS naming one (--ucx_transports=tcp,cuda_copy,
# cuda_ipc, or rc,cuda_copy,cuda_ipc on RDMA NICs) hands device memory to UCX: its start-up
# line then says "device_memory=cuda:N". Build it into the prefix kvferry links with (or run
# kvferryd with LD_LIBRARY_PATH=PREFIX/lib). It needs the CUDA toolkit (CUDA_HOME, default
# /usr/local/cuda) and nvml.h: from the toolkit (cuda-nvml-dev) or, on Debian, the non-free
# package libnvidia-ml-dev, which this script fetches when neither is there. The driver's
# libnvidia-ml.so.1 need not be on the build machine (a link-time stand-in is made; the
# driver's library is loaded at run time). Verbs and rdmacm (RDMA NICs) are built in, as in
# Debian's package.
set -euo pipefail

CUDA=0
if [ "${1:-}" = --cuda ]; then
  CUDA=1
  shift
fi
PREFIX="${1:-/opt/kvferry/ucx}"
PATCHES_ROOT="$(cd "$(dirname "$0")" && pwd)/patches/ucx"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
JOBS="${JOBS:-$(nproc)}"
WORK="$(mktemp -d /tmp/kvferry-ucx.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

say() { printf 'ucx: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

[ "$CUDA" = 0 ] || [ -f "$CUDA_HOME/include/cuda.h" ] || die "no CUDA toolkit at $CUDA_HOME (set CUDA_HOME)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends autoconf automake libtool make gcc g++ pkg-config \
  dpkg-dev xz-utils libibverbs-dev librdmacm-dev >/dev/null

# apt, with this system's package sources plus their source packages, in a scratch state.
mkdir -p "$WORK/apt/parts" "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial"
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  sed -E 's/^Types:[[:space:]]*deb[[:space:]]*$/Types: deb deb-src/' "$f" > "$WORK/apt/parts/$(basename "$f")"
done
: > "$WORK/apt/sources.list"
if [ -f /etc/apt/sources.list ]; then
  grep -E '^deb ' /etc/apt/sources.list > "$WORK/apt/deb.list" || true
  cat "$WORK/apt/deb.list" > "$WORK/apt/sources.list"
  sed 's/^deb /deb-src /' "$WORK/apt/deb.list" >> "$WORK/apt/sources.list"
fi
APT=(apt-get -o "Dir::Etc::SourceList=$WORK/apt/sources.list" -o "Dir::Etc::SourceParts=$WORK/apt/parts"
     -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache"
     -o "APT::Sandbox::User=root")
"${APT[@]}" update >/dev/null

cd "$WORK"
say "fetching the source of $(dpkg-query -W -f='ucx ${Version}' libucx0 2>/dev/null || echo ucx)"
"${APT[@]}" source --download-only ucx >/dev/null
dpkg-source --no-check -x ucx_*.dsc src >/dev/null
cd src
# The upstream build scripts expect the templates of their own debian/ directory.
mkdir -p debian
cp -rn debian.upstream/. debian/ 2>/dev/null || true

VERSION="$(sed -nE 's/^Version: ([0-9]+:)?([0-9]+\.[0-9]+).*/\2/p' ../ucx_*.dsc)"
PATCHES="$PATCHES_ROOT/$VERSION"
for p in "$PATCHES"/*.patch; do
  [ -f "$p" ] || continue
  say "applying $(basename "$p")"
  patch -p1 --forward --quiet < "$p" || die "$(basename "$p") does not apply to this UCX source"
done

CUDA_FLAGS=()
if [ "$CUDA" = 1 ]; then
  # nvml.h, and libnvidia-ml to link against.
  NVML_INCLUDE=""
  for d in "$CUDA_HOME/include" /usr/include; do
    [ -f "$d/nvml.h" ] && NVML_INCLUDE="$d" && break
  done
  if [ -z "$NVML_INCLUDE" ]; then
    # shellcheck source=/dev/null
    . /etc/os-release
    [ "${ID:-}" = debian ] || die "no nvml.h: install NVIDIA's cuda-nvml-dev package"
    say "no nvml.h in the toolkit: taking it from Debian's libnvidia-ml-dev (non-free)"
    sed -E 's/^Components:.*/Components: non-free/; s/^Types:.*/Types: deb/' \
      "$WORK/apt/parts/debian.sources" > "$WORK/apt/parts/non-free.sources"
    "${APT[@]}" update >/dev/null
    (cd "$WORK" && "${APT[@]}" download libnvidia-ml-dev >/dev/null && dpkg -x libnvidia-ml-dev_*.deb nvml)
    NVML_INCLUDE="$WORK/nvml/usr/include"
  fi
  mkdir -p "$WORK/link"
  if ! ldconfig -p | grep -q 'libnvidia-ml.so.1 '; then
    cat > "$WORK/link/nvml.c" <<'C'
/* Link-time stand-in for libnvidia-ml.so.1; the driver's library is loaded at run time. */
int nvmlInit(void) { return 0; }
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetHandleByIndex(void) { return 0; }
int nvmlDeviceGetHandleByIndex_v2(void) { return 0; }
int nvmlDeviceGetFieldValues(void) { return 0; }
int nvmlDeviceGetNvLinkRemotePciInfo(void) { return 0; }
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void) { return 0; }
const char* nvmlErrorString(int e) { (void)e; return ""; }
C
    gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o "$WORK/link/libnvidia-ml.so" "$WORK/link/nvml.c"
  fi
  CUDA_FLAGS=(--with-cuda="$CUDA_HOME" CPPFLAGS="-I$NVML_INCLUDE"
              LDFLAGS="-L$WORK/link -L$CUDA_HOME/lib64/stubs")
else
  CUDA_FLAGS=(--without-cuda)
fi

VERBS=(--without-verbs --without-rdmacm)
if [ -f /usr/include/infiniband/verbs.h ] && [ -f /usr/include/rdma/rdma_cma.h ]; then
  VERBS=(--with-verbs --with-rdmacm)
fi
say "configuring (${CUDA_FLAGS[0]}, ${VERBS[0]})"
./autogen.sh >"$WORK/autogen.log" 2>&1 || { tail -20 "$WORK/autogen.log"; die "autogen failed"; }
./configure --prefix="$PREFIX" --enable-mt --enable-cma \
  --disable-backtrace-detail --without-java --without-go "${VERBS[@]}" \
  "${CUDA_FLAGS[@]}" >"$WORK/configure.log" 2>&1 ||
  { tail -20 "$WORK/configure.log"; die "configure failed"; }
[ "$CUDA" = 0 ] || grep -q 'UCT modules:.*cuda' "$WORK/configure.log" ||
  die "configure found no CUDA (see the log)"
say "building with $JOBS jobs"
# -k: some of UCX's own test programs do not build against newer CUDA headers; the
# libraries and modules are checked below.
make -k -j"$JOBS" >"$WORK/make.log" 2>&1 || true
make -k install >"$WORK/install.log" 2>&1 || true
expected=(lib/libucp.so.0 lib/libuct.so.0 lib/libucs.so.0 lib/libucm.so.0 lib/pkgconfig/ucx.pc
          bin/ucx_info bin/ucx_perftest)
[ "$CUDA" = 0 ] || expected+=(lib/ucx/libuct_cuda.so.0 lib/ucx/libucm_cuda.so.0)
for f in "${expected[@]}"; do
  [ -e "$PREFIX/$f" ] || { grep -n 'error' "$WORK/make.log" | head -20; die "missing $PREFIX/$f"; }
done
# What install-deps.sh compares to know this build is current.
cat "$PATCHES"/*.patch 2>/dev/null | sha256sum | cut -d' ' -f1 > "$PREFIX/kvferry-patches"
say "installed in $PREFIX"
