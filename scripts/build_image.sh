#!/usr/bin/env bash
# build_image.sh - build docker/Dockerfile with rootful podman on a machine that reaches no image
# registry (CI, tests/test_container.py): the base is a Debian + Python image made here with
# debootstrap, passed as --build-arg BASE_IMAGE. Debian 12 host, run as root.
#
#   scripts/build_image.sh [options] [-- args for one run of the image]
#
#   -t, --tag TAG           image to build (default localhost/maxlm:cpu)
#   --base TAG              use this local base image instead of the debootstrap one (e.g. a pulled
#                           nvcr.io/nvidia/jax tag); nothing is made or pulled then
#   --suite NAME            Debian release of the made base (default bookworm: Python 3.11, which the
#                           prebuilt TE JAX extension in docker/wheels/ needs)
#   --mirror URL            Debian mirror for debootstrap (default: the one this machine's apt uses)
#   --rebuild-base          make the base again even if it is cached
#   --build-arg KEY=VALUE   passed on to the build (repeatable), e.g. MAXLM_TE=0
#   --ca-bundle FILE|none   CA bundle bind-mounted read-only into every RUN step (default
#                           /etc/ssl/certs/ca-certificates.crt): pip needs it where HTTPS goes through a
#                           TLS-inspecting proxy
#   --no-install            fail instead of apt-get installing podman, runc or debootstrap
#   --run                   run the image once after building, with the args after `--` (default: doctor)
#
# Caches, all only to save time (a missing or removed one is made again; nothing depends on them):
#   the debootstrap root file system  /var/cache/maxlm-image/rootfs-<suite> (complete ones only)
#   the base image                    localhost/maxlm-base:<suite> in podman's store
#   image layers                      podman's store
#   pip's downloads                   /var/cache/maxlm-image/pip, mounted into the RUN steps
# Clean up: podman rmi localhost/maxlm:cpu localhost/maxlm-base:bookworm; rm -rf /var/cache/maxlm-image
#
# Always runc and explicit ulimits (nofile = this shell's hard limit, nproc 4096): podman's default
# runtime crun fails on hosts with a hybrid cgroup v1/v2 layout, and its default ulimits are above the
# hard limits of such machines. Network `host` while building (no bridge, no iptables rules left
# behind). Every podman command is printed before it runs, so its flags can be copied.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TAG=localhost/maxlm:cpu BASE="" SUITE=bookworm MIRROR="" REBUILD_BASE=0 NO_INSTALL=0 RUN=0
CA=/etc/ssl/certs/ca-certificates.crt BUILD_ARGS=() RUN_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -t|--tag) TAG=${2:?}; shift ;;
    --base) BASE=${2:?}; shift ;;
    --suite) SUITE=${2:?}; shift ;;
    --mirror) MIRROR=${2:?}; shift ;;
    --rebuild-base) REBUILD_BASE=1 ;;
    --build-arg) BUILD_ARGS+=(--build-arg "${2:?}"); shift ;;
    --ca-bundle) CA=${2:?}; shift ;;
    --no-install) NO_INSTALL=1 ;;
    --run) RUN=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    --) shift; RUN_ARGS=("$@"); break ;;
    *) echo "build_image.sh: error: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
die() { echo "build_image.sh: error: $*" >&2; exit 1; }
say() { echo "+ $*" >&2; "$@"; }
[ "$(id -u)" = 0 ] || die "run as root (rootful podman, debootstrap)"
export DEBIAN_FRONTEND=noninteractive
T0=$SECONDS

# 1. tools
missing=()
for p in podman runc debootstrap; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$NO_INSTALL" = 1 ] && die "missing packages: ${missing[*]} (apt-get install ${missing[*]})"
  apt-get install -y -q "${missing[@]}" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
  echo "installed ${missing[*]} in $((SECONDS - T0)) s" >&2
fi
NOFILE=$(ulimit -Hn); [ "$NOFILE" = unlimited ] && NOFILE=65536
PODMAN=(podman --runtime runc)
OPTS=(--network host --ulimit "nofile=$NOFILE:$NOFILE" --ulimit nproc=4096:4096)
if [ "$CA" != none ]; then
  [ -f "$CA" ] || die "CA bundle $CA not found (use --ca-bundle FILE or --ca-bundle none)"
  OPTS+=(-v "$CA:$CA:ro")
fi
PIP_CACHE=/var/cache/maxlm-image/pip                # pip's downloads, shared by builds (docker/install.py)
mkdir -p "$PIP_CACHE"

# 2. the base: Debian minbase + Python, made with debootstrap and imported into podman
if [ -z "$BASE" ]; then
  BASE=localhost/maxlm-base:$SUITE
  CACHE=/var/cache/maxlm-image
  ROOTFS=$CACHE/rootfs-$SUITE
  if [ "$REBUILD_BASE" = 1 ]; then
    if podman image exists "$BASE"; then say podman rmi "$BASE" >/dev/null; fi
    rm -rf "${ROOTFS:?}"
  fi
  if ! podman image exists "$BASE"; then
    T1=$SECONDS
    if [ ! -f "$ROOTFS/.maxlm-complete" ]; then
      if [ -z "$MIRROR" ]; then
        # shellcheck disable=SC2016  # $(REPO_URI) is expanded by apt-get, not by the shell
        FMT='$(REPO_URI)'
        MIRROR=$(apt-get indextargets 'Identifier: Packages' "Codename: $SUITE" 'Component: main' \
                 --format "$FMT" 2>/dev/null | head -1)
        [ -n "$MIRROR" ] || MIRROR=$(apt-get indextargets --format "$FMT" 'Component: main' \
                 'Origin: Debian' 'Label: Debian' 2>/dev/null | head -1)
        [ -n "$MIRROR" ] || die "no Debian mirror in this machine's apt config; pass --mirror URL"
      fi
      mkdir -p "$CACHE"
      TMP=$(mktemp -d "$CACHE/.rootfs-$SUITE.XXXXXX")
      trap 'rm -rf "$TMP"' EXIT                        # an interrupted debootstrap leaves no cache behind
      say debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$SUITE" "$TMP" "$MIRROR" >/dev/null
      rm -rf "$TMP"/var/cache/apt/archives/*.deb "$TMP"/var/lib/apt/lists/*_Packages \
        "$TMP"/etc/resolv.conf                         # podman provides resolv.conf at run time
      : > "$TMP/etc/hostname"                          # not this machine's name
      rm -rf "${ROOTFS:?}" && mv "$TMP" "$ROOTFS" && trap - EXIT
      touch "$ROOTFS/.maxlm-complete"
    fi
    echo "+ tar -C $ROOTFS -c . | podman import - $BASE" >&2
    tar --numeric-owner --exclude=./.maxlm-complete -C "$ROOTFS" -c . \
      | podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$BASE" >/dev/null
    echo "base image $BASE made in $((SECONDS - T1)) s" >&2
  fi
fi

# 3. build (--pull=never: nothing is fetched from a registry)
T2=$SECONDS
say "${PODMAN[@]}" build --pull=never "${OPTS[@]}" -v "$PIP_CACHE:/root/.cache/pip" --build-arg BASE_IMAGE="$BASE" "${BUILD_ARGS[@]}" \
  -f "$ROOT/docker/Dockerfile" -t "$TAG" "$ROOT"
echo "built $(podman image ls --format '{{.Repository}}:{{.Tag}} ({{.Size}})' "$TAG" | head -1)" \
  "in $((SECONDS - T2)) s ($((SECONDS - T0)) s in all)" >&2

# 4. one run of the image (its ENTRYPOINT is maxlm)
if [ "$RUN" = 1 ]; then
  say "${PODMAN[@]}" run --rm --network none --ulimit "nofile=$NOFILE:$NOFILE" --ulimit nproc=4096:4096 \
    "$TAG" "${RUN_ARGS[@]}"
fi
