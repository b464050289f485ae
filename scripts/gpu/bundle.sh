#!/usr/bin/env bash
# Makes the folder of build dependencies the GPU machine lacks (it has CMake,
# ninja, nvcc, CUDA and python3 with torch, but no package registry), to carry
# there with the working tree (see scripts/gpu/README.md):
#
#   scripts/gpu/bundle.sh [DEST]        default DEST: .gpu-deps (git-ignored)
#
# Runs here, where Debian's archive is reachable. DEST/usr holds the contents
# of these Debian packages, unpacked (not installed):
#   liburing-dev (headers, static liburing.a), libtbb-dev libtbb12 libtbbmalloc2
#   libtbbbind-2-5 (oneTBB), nlohmann-json3-dev, libgtest-dev (static GoogleTest),
#   libgloo-dev (headers only: LibTorch carries Gloo itself)
# and DEST/bin/fio, built from Debian's fio source (checked against the .dsc's
# SHA-256) with no optional engines, so it needs only libc, libm and libz: the
# reference `zero bench aio` compares with. DEST/MANIFEST lists what came from where.
# CMake takes all of it from DEST with -DZERO_DEPS_PREFIX=DEST (cmake/zero_deps.cmake).
# Idempotent: a DEST whose MANIFEST matches is left as it is.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/.gpu-deps}
case "$dest" in /*) ;; *) dest=$PWD/$dest ;; esac

pkgs=(liburing-dev libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 nlohmann-json3-dev libgtest-dev libgloo-dev)
fio_version=3.33
fio_debian=3.33-3
archive=http://deb.debian.org/debian/pool/main/f/fio

want="packages: ${pkgs[*]}; fio ${fio_debian}"
if [ -f "$dest/MANIFEST" ] && head -n 1 "$dest/MANIFEST" | grep -qxF "# $want"; then
  echo "bundle: $dest is up to date ($(du -sh "$dest" | cut -f1))"
  exit 0
fi

for tool in apt-get dpkg-deb curl sha256sum make cc; do
  command -v "$tool" >/dev/null || { echo "bundle: error: '$tool' is needed here (a Debian machine with its archive)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "bundle: downloading ${pkgs[*]}"
if ! (cd "$work" && apt-get download -q "${pkgs[@]}" >/dev/null 2>"$work/apt.err"); then
  # A fresh machine may have no package lists yet.
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  (cd "$work" && apt-get download -q "${pkgs[@]}" >/dev/null) || {
    echo "bundle: error: apt-get download ${pkgs[*]} failed:" >&2; cat "$work/apt.err" >&2; exit 1; }
fi

stage=$work/stage
mkdir -p "$stage"
{
  echo "# $want"
  echo "# made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME") by scripts/gpu/bundle.sh"
} >"$work/MANIFEST"
for deb in "$work"/*.deb; do
  dpkg-deb -x "$deb" "$stage"
  echo "$(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version) $(sha256sum "$deb" | cut -d' ' -f1)" >>"$work/MANIFEST"
done
# Keep what a build reads; Gloo's CMake files name a libgloo nobody links.
rm -rf "$stage/usr/share/doc" "$stage/usr/share/lintian" "$stage/usr/share/cmake/Gloo" "$stage/usr/lib/libgloo.so" \
       "$stage/usr/src"
# The static liburing is linked (no run-time dependency on the machine's liburing).
rm -f "$stage"/usr/lib/x86_64-linux-gnu/liburing.so*

echo "bundle: building fio $fio_version from Debian's source (a minute or two)"
(
  cd "$work"
  curl -fsSL -o fio.dsc "$archive/fio_${fio_debian}.dsc"
  curl -fsSL -o "fio_${fio_version}.orig.tar.gz" "$archive/fio_${fio_version}.orig.tar.gz"
  expected=$(awk '/^Checksums-Sha256:/ {on=1; next} /^[^ ]/ {on=0} on && $3 == "fio_'"$fio_version"'.orig.tar.gz" {print $1}' fio.dsc)
  actual=$(sha256sum "fio_${fio_version}.orig.tar.gz" | cut -d' ' -f1)
  [ -n "$expected" ] && [ "$expected" = "$actual" ] || {
    echo "bundle: error: fio_${fio_version}.orig.tar.gz has SHA-256 $actual; fio_${fio_debian}.dsc says '${expected:-(none)}'" >&2
    exit 1; }
  tar xzf "fio_${fio_version}.orig.tar.gz"
  cd "fio-$fio_version"
  # No optional engines or libraries: io_uring and libaio-free psync are built in.
  ./configure --disable-native --disable-numa --disable-rdma --disable-rados --disable-rbd \
    --disable-http --disable-gfapi --disable-libnfs --disable-pmem --disable-tcmalloc \
    --disable-dfs --disable-xnvme --disable-libzbc --disable-lex >"$work/fio-configure.log" 2>&1 ||
    { tail -20 "$work/fio-configure.log" >&2; exit 1; }
  make -s -j "$(nproc)" fio >"$work/fio-make.log" 2>&1 || { tail -20 "$work/fio-make.log" >&2; exit 1; }
  mkdir -p "$stage/bin"
  cp fio "$stage/bin/fio"
  strip "$stage/bin/fio"
  echo "fio $fio_version (source fio_${fio_version}.orig.tar.gz $actual) $(ldd fio | awk '/=>/ {print $1}' | tr '\n' ' ')" \
    >>"$work/MANIFEST"
)

mv "$work/MANIFEST" "$stage/MANIFEST"
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$stage" "$dest"
echo "bundle: $dest ($(du -sh "$dest" | cut -f1)); carry it with the call (device run: carry [\".gpu-deps\"])"
