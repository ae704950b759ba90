#!/usr/bin/env bash
# Builds the bdev_qcow2 image without an image registry, from the SPDK installed on this
# (Debian) host: the base image is made with debootstrap and `docker import`ed; the host's SPDK
# install (libraries, spdk_tgt, headers, pkg-config files, its python RPC client) is copied
# into the build context, never built; so are the crates the module needs (`cargo vendor`), and
# the build stage compiles it offline with Debian's cargo. See docker/README.md.
#
#   docker/build.sh [-t TAG] [--rebuild-base] [-- DOCKER-BUILD-ARGS...]
#
# The last stage runs spdk_tgt once (docker/check_module.py). Where SPDK applications must
# take turns, build up to it first (`-- --target build`), then run the rest under the turn.
#
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SECURITY_MIRROR
# (default http://deb.debian.org/debian-security).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
tag=bdev_qcow2
rebuild_base=
while [ $# -gt 0 ]; do
  case "$1" in
    -t) tag=$2; shift 2 ;;
    --rebuild-base) rebuild_base=1; shift ;;
    --) shift; break ;;
    *) echo "usage: $0 [-t TAG] [--rebuild-base] [-- DOCKER-BUILD-ARGS...]" >&2; exit 2 ;;
  esac
done

die() { echo "docker/build.sh: $*" >&2; exit 1; }

# The base is the host's own release: the staged SPDK was linked against its libraries.
# shellcheck disable=SC1091
suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ -n "$suite" ] || die "no VERSION_CODENAME in /etc/os-release (a Debian host is needed)"
command -v dpkg-query >/dev/null || die "dpkg-query not found (a Debian host is needed)"
base="bdev_qcow2-base:$suite"

# --- 1. Where SPDK is installed: the prefix of `pkg-config spdk_bdev`. -----------------------
pkg-config --exists spdk_bdev || die "pkg-config finds no spdk_bdev: install SPDK first"
prefix=$(pkg-config --variable=prefix spdk_bdev)
if [ -z "$prefix" ]; then
  # SPDK's .pc files may carry no prefix variable: take it from the library directory.
  libdir=$(pkg-config --libs-only-L spdk_bdev | tr ' ' '\n' | sed -n 's/^-L//p' | head -1)
  prefix=$(dirname "${libdir:-/usr/local/lib}")
fi
[ -x "$prefix/bin/spdk_tgt" ] || die "$prefix/bin/spdk_tgt not found"
[ -f "$prefix/include/spdk/bdev_module.h" ] || die "$prefix/include/spdk not found"
rpc_client=$(command -v spdk-rpc) || die "spdk-rpc (SPDK's python RPC client) not on PATH"
rpc_python=$(sed -n '1s/^#!//p' "$rpc_client" | cut -d' ' -f1)
spdk_py=$("$rpc_python" -c 'import os, spdk; print(os.path.dirname(spdk.__file__))') ||
  die "$rpc_python cannot import spdk (the package spdk-rpc runs)"
echo "SPDK: $prefix ($(pkg-config --modversion spdk_bdev)), python package $spdk_py"

# --- 2. The base image: debootstrap + docker import, once per suite. -------------------------
if [ -n "$rebuild_base" ] || ! docker image inspect "$base" >/dev/null 2>&1; then
  if ! command -v debootstrap >/dev/null; then
    apt-get install -y --no-install-recommends debootstrap
  fi
  rootfs=$(mktemp -d /tmp/bdev_qcow2-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
  debootstrap --variant=minbase "$suite" "$rootfs" "$mirror"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb
  # Updates and security too, as Debian's own images have (the security suite carries the
  # newest rustc-web/cargo-web).
  cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} $suite-security main
EOF
  tar -C "$rootfs" -c . | docker import - "$base"
  rm -rf "$rootfs"
  trap - EXIT
fi

# --- 3. The build context: sources, the SPDK install, the Debian packages SPDK needs. --------
ctx=$(mktemp -d /tmp/bdev_qcow2-context.XXXXXX)
trap 'rm -rf "$ctx"' EXIT

# The repository's files as they are in the work tree (tracked and new, not target/).
mkdir "$ctx/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard |
  tar -C "$repo" --null -T - --ignore-failed-read -c | tar -C "$ctx/src" -x

# SPDK's files at their installed paths: shared libraries, spdk_tgt, headers, pkg-config
# files, and the python package with the RPC client.
stage="$ctx/spdk"
mkdir -p "$stage$prefix/lib/pkgconfig" "$stage$prefix/bin" "$stage$prefix/include"
cp -a "$prefix"/lib/libspdk*.so* "$stage$prefix/lib/"
cp -a "$prefix"/lib/pkgconfig/spdk_*.pc "$stage$prefix/lib/pkgconfig/"
cp -a "$prefix/bin/spdk_tgt" "$stage$prefix/bin/"
cp -a "$prefix/include/spdk" "$stage$prefix/include/"
mkdir -p "$stage/opt/spdk-python" "$stage/usr/local/bin"
cp -a "$spdk_py" "$stage/opt/spdk-python/"
find "$stage/opt/spdk-python" -name __pycache__ -prune -exec rm -rf {} +
printf '#!/usr/bin/python3\nimport sys\nfrom spdk.spdk_rpc import main\nsys.exit(main())\n' \
  >"$stage/usr/local/bin/spdk-rpc"
chmod 0755 "$stage/usr/local/bin/spdk-rpc"

# The Debian package that installed file $1 (dpkg records /lib and /usr/lib paths apart).
deb_of() {
  local f g p
  # As named (a -dev package's lib*.so link, normalized), else the file it links to.
  for f in "$(realpath -s "$1")" "$(readlink -f "$1")"; do
    for g in "$f" "/usr$f" "${f#/usr}"; do
      p=$(dpkg-query -S "$g" 2>/dev/null | head -1 | cut -d: -f1) || true
      if [ -n "$p" ]; then echo "$p"; return; fi
    done
  done
  die "no Debian package owns $1 (SPDK needs it)"
}

# The libraries the module links with -l besides SPDK's (spdk-sys/build.rs asks pkg-config the
# same): shared ones as their unversioned link, else static archives (librt.a).
links=()
for flag in $(pkg-config --libs-only-l spdk_env_dpdk spdk_syslibs); do
  l=${flag#-l}
  case "$l" in spdk_*) continue ;; esac
  f=$(cc -print-file-name="lib$l.so")
  [ "${f#/}" != "$f" ] || f=$(cc -print-file-name="lib$l.a")
  [ "${f#/}" != "$f" ] || die "cannot find lib$l for the module's link"
  links+=("$f")
done

# Runtime: what spdk_tgt and SPDK's libraries load from outside the prefix, and what the module
# links (with --no-as-needed it needs them all, e.g. libIPSec_MB, which spdk_tgt does not).
# (libspdk.so is a linker script, which ldd refuses; runpaths may print paths with "//".)
{
  { ldd "$prefix/bin/spdk_tgt" "$prefix"/lib/libspdk*.so 2>/dev/null || true; } |
    awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sed 's#//*#/#g'
  for f in "${links[@]}"; do
    r=$(readlink -f "$f") # a shared object, not a linker script (libm.so, libbsd.so)
    [ "$(head -c 4 "$r" | tail -c 3)" != ELF ] || [ "${r%.a}" != "$r" ] || echo "$r"
  done
} | grep -v "^$prefix/" | sort -u |
  while read -r lib; do deb_of "$lib"; done | sort -u >"$ctx/runtime-debs"

# Build: the packages with the links themselves (the -dev packages).
for f in "${links[@]}"; do deb_of "$f"; done | sort -u >"$ctx/build-debs"
echo "runtime packages: $(tr '\n' ' ' <"$ctx/runtime-debs")"
echo "build packages: $(tr '\n' ' ' <"$ctx/build-debs")"

# The crates, from the host's cargo (crates.io over HTTPS is for the host: an image build may
# not trust the same certificates), for an offline build inside.
(cd "$repo" && cargo vendor --locked --versioned-dirs "$ctx/vendor") |
  sed "s#$ctx/vendor#/vendor#" >"$ctx/cargo-config.toml"
grep -q 'directory = "/vendor"' "$ctx/cargo-config.toml" || die "cargo vendor printed no source config"

cp "$repo/docker/Dockerfile" "$ctx/Dockerfile"

# --- 4. The image. Host network: the stages install Debian packages.
docker build --network host --build-arg "BASE=$base" -t "$tag" "$@" "$ctx"
echo "built $tag (base $base)"
