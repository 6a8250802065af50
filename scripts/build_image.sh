#!/usr/bin/env bash
# Builds the project's CPU image with buildah (`make image`) on a machine that reaches no
# container registry and no Maven Central, only Debian's and PyPI's packages:
#
#   scripts/build_image.sh [--if-stale] [IMAGE]     default localhost/flyte-hvd:latest
#
# The Dockerfile as it is, with three substitutions (its build arguments):
#   BASE_IMAGE   a Debian 12 base made here by scripts/build_base_image.sh (debootstrap), in
#                place of python:3.11-slim-bookworm; set BASE_IMAGE to use another.
#   FIND_LINKS   the folder where pip finds lock/image.txt's CPU torch wheel without an index
#                (as scripts/install.sh finds it: pip's find-links), mounted at /wheels; when
#                no such folder holds it, torch comes from TORCH_INDEX_URL as in the Dockerfile.
#   S3A_JARS     false when Maven Central does not answer (the image then says at start that
#                Spark has no s3a://); set S3A_JARS=true or false to decide.
# --if-stale builds only when no image IMAGE was built from the same files (the label
# flyte-hvd.context, a hash of everything the Dockerfile copies): what the tests call.
#
# Cached between runs on one machine: the base's root file system (~/.cache/flyte-hvd-image,
# or FLYTE_HVD_IMAGE_CACHE) and buildah's layers. A build needs FLYTE_HVD_IMAGE_FREE_GB
# (default 16) free in podman's storage, checked before it starts; it removes what it made
# that nothing uses any more: the image IMAGE named before (and its build's layers) and, when
# it fails, its working containers. Needs root; buildah, podman, runc and debootstrap are
# installed with apt-get when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "build_image: $*" >&2
  exit 1
}

if_stale=false
if [ "${1:-}" = --if-stale ]; then
  if_stale=true
  shift
fi
image="${1:-localhost/flyte-hvd:latest}"
base="${BASE_IMAGE:-}"
maven="${MAVEN_URL:-https://repo1.maven.org/maven2}"

[ "$(id -u)" = 0 ] || fail "building with buildah here needs root (running as uid $(id -u))"
missing=()
for tool in buildah podman runc debootstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null || fail "${missing[*]} not found, and no apt-get to install them"
  echo "build_image: installing ${missing[*]} with apt-get" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
    >&2 || fail "apt-get install ${missing[*]} failed (see above)"
fi

# Everything the Dockerfile copies, and the Dockerfile: the image is current when its label
# holds this hash.
context=$(
  find Dockerfile Dockerfile.dockerignore pyproject.toml README.md lock/image*.txt docker flyte_hvd \
    -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
    | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
)
if $if_stale; then
  built=$(podman image inspect --format '{{index .Labels "flyte-hvd.context"}}' "$image" \
    2>/dev/null || true)
  if [ "$built" = "$context" ]; then
    echo "build_image: $image is current (context $context)" >&2
    exit 0
  fi
fi

args=()
# pip's configuration as scripts/install.sh sees it: the venv's pip, else the system's.
pip_python=.venv/bin/python
[ -x "$pip_python" ] || pip_python=python3
torch_pin=$(grep -E '^torch==' lock/image.txt)
wheel="torch-${torch_pin#torch==}-cp311-*.whl"
folders="${PIP_FIND_LINKS:-}"
if [ -z "$folders" ]; then
  folders=$("$pip_python" -m pip config get global.find-links 2>/dev/null || true)
fi
wheels=""
for folder in $folders; do
  folder="${folder#file://}"
  if compgen -G "$folder/$wheel" >/dev/null; then
    wheels="$folder"
    break
  fi
done
if [ -n "$wheels" ]; then
  echo "build_image: $torch_pin from $wheels" >&2
  args+=(--volume "$wheels:/wheels:ro" --build-arg FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=)
else
  echo "build_image: $torch_pin from the Dockerfile's TORCH_INDEX_URL (no find-links folder holds $wheel)" >&2
fi

# A CA bundle pip is configured with here (a proxy's own CA, say) reaches pip in the build
# as a volume with a pip.conf naming it; neither is in the image.
cert="${PIP_CERT:-}"
if [ -z "$cert" ]; then
  cert=$("$pip_python" -m pip config get global.cert 2>/dev/null || true)
fi
if [ -n "$cert" ]; then
  [ -r "$cert" ] || fail "pip's certificate bundle $cert (PIP_CERT or pip's global.cert) is not readable"
  conf=$(mktemp "${TMPDIR:-/tmp}/flyte-hvd-pip.XXXXXX.conf")
  trap 'rm -f "$conf"' EXIT
  printf '[global]\ncert = /etc/ssl/flyte-hvd-build-ca.crt\n' >"$conf"
  args+=(--volume "$cert:/etc/ssl/flyte-hvd-build-ca.crt:ro" --volume "$conf:/etc/pip.conf:ro")
fi

s3a="${S3A_JARS:-}"
case "$s3a" in
  true | false) ;;
  "")
    if curl -fsS --max-time 10 -o /dev/null "$maven/" 2>/dev/null; then
      s3a=true
    else
      s3a=false
      echo "build_image: $maven does not answer (or no curl): building without the S3A jars" \
        "(S3A_JARS=false)" >&2
    fi
    ;;
  *) fail "S3A_JARS must be true or false (or unset: true when Maven Central answers), not '$s3a'" ;;
esac
args+=(--build-arg "S3A_JARS=$s3a")

# The build's peak, measured on a cold build: 15 GB (the venv's 4 GB in its step, again in
# the layer blob buildah writes to commit it, again as the stored layer, and uv's downloads).
need_gb="${FLYTE_HVD_IMAGE_FREE_GB:-16}"
[[ "$need_gb" =~ ^[0-9]+$ ]] || fail "FLYTE_HVD_IMAGE_FREE_GB must be a number of GB, not '$need_gb'"
storage=$(podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || true)
storage="${storage:-/var/lib/containers}"
mkdir -p "$storage"
# df counts KiB (1024 bytes); GB here are 10^9 bytes, as the figures above.
free_gb=$(($(df -Pk "$storage" | awk 'NR == 2 {print $4}') * 1024 / 1000000000))
if [ "$free_gb" -lt "$need_gb" ]; then
  fail "building $image needs about ${need_gb} GB free in $storage; ${free_gb} GB are free." \
    "Free space there (podman image prune, podman system df shows what it holds)," \
    "or set FLYTE_HVD_IMAGE_FREE_GB to a lower figure if the layers are already built."
fi
previous=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)

started=$(date +%s)
if [ -z "$base" ]; then
  base=localhost/flyte-hvd-base:bookworm
  scripts/build_base_image.sh "$base"
fi
args+=(--build-arg "BASE_IMAGE=$base")
# chroot isolation: RUN steps need no user namespaces or cgroups of their own here.
# --force-rm: a failed step's working container goes too (each holds what the step wrote).
buildah bud --isolation chroot --format docker --layers --force-rm \
  --ignorefile Dockerfile.dockerignore \
  --label "flyte-hvd.context=$context" \
  "${args[@]}" -t "$image" -f Dockerfile . \
  || fail "buildah bud failed (see above)"
# The image IMAGE named before, and the layers of the builds that made it, when nothing uses
# them now (a lock change leaves a 4 GB venv layer behind otherwise); the layers of this
# build stay, the cache of the next one.
current=$(podman image inspect --format '{{.Id}}' "$image")
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  podman rmi "$previous" >/dev/null 2>&1 || true
fi
podman image prune --force --filter "label=flyte-hvd.context" >/dev/null 2>&1 || true
size=$(podman image inspect --format '{{.Size}}' "$image")
echo "build_image: $image built in $(($(date +%s) - started)) s, $((size / 1000000)) MB" >&2
