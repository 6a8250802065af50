#!/usr/bin/env bash
# A Debian 12 (bookworm) base image with Python 3.11, made here with debootstrap from the apt
# mirror this machine uses, for building the image where no container registry is reachable
# (scripts/build_image.sh passes it as the Dockerfile's BASE_IMAGE):
#
#   scripts/build_base_image.sh [IMAGE]       default localhost/flyte-hvd-base:bookworm
#
# It holds what the Dockerfile expects of python:3.11-slim-bookworm: python3.11 with venv and
# pip, a `python` command, CA certificates and apt sources (the mirror, its updates and
# security suites). The root file system is cached as a tarball
# ($FLYTE_HVD_IMAGE_CACHE/base-bookworm.tar.gz, default ~/.cache/flyte-hvd-image): a second
# run only imports it, or does nothing while the image imported from it is there. Needs root, debootstrap and podman (scripts/build_image.sh installs
# them).
set -euo pipefail

image="${1:-localhost/flyte-hvd-base:bookworm}"
cache="${FLYTE_HVD_IMAGE_CACHE:-$HOME/.cache/flyte-hvd-image}"
tarball="$cache/base-bookworm.tar.gz"
packages=python3.11,python3-venv,python3-pip,python-is-python3,ca-certificates

fail() {
  echo "build_base_image: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "debootstrap and podman import need root (running as uid $(id -u))"
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || fail "$tool not found: apt-get install -y $tool"
done

# The mirror apt uses here (deb822 .sources or a one-line list), else Debian's own.
mirror=$(
  grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
    | grep -v security | grep -oE 'https?://[^ ]*/debian/?' | head -n1
) || true
mirror="${mirror:-http://deb.debian.org/debian}"
mirror="${mirror%/}"
security="${mirror%/debian}/debian-security"

if podman image exists "$image" && [ -s "$tarball" ]; then
  exit 0  # made from the cached tarball before (remove the image to import it again)
fi
if [ ! -s "$tarball" ]; then
  mkdir -p "$cache"
  root=$(mktemp -d "${TMPDIR:-/var/tmp}/flyte-hvd-base.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  echo "build_base_image: debootstrap bookworm from $mirror" >&2
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >&2 \
    || fail "debootstrap of bookworm from $mirror failed (see above)"
  cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
  # What an image does not need: downloaded packages, package lists (a Dockerfile's
  # apt-get update fetches them again), documentation.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/*
  tar -C "$root" --numeric-owner -czf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi

echo "build_base_image: importing $tarball as $image" >&2
podman import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  "$tarball" "$image" >/dev/null
