#!/usr/bin/env bash
# The GPU check in one call on a machine with CUDA GPUs (what it measures and prints:
# benchmarks/gpu_check.py):
#
#   scripts/gpu_check.sh [OUT_DIR] [-- ARGS...]   on the GPU machine, from a copy of the checkout
#   scripts/gpu_check.sh --download [3.12]       ahead, on a machine that reaches PyPI
#
# The GPU machine brings Python and a CUDA build of torch (PYTHON, default python3). What
# flyte-hvd needs beside them (the mpich wheel's MPI and mpiexec, mpi4py, cloudpickle, at the
# versions lock/dev.txt pins) is installed, only where that Python lacks it, into a prefix of
# its own (never over the machine's packages; removed at the end) from the wheels in
# GPU_WHEELS (default .cache/gpu-wheels, which `--download` fills for that Python's version
# and which then travels with the checkout: about 15 MB), else from the package index.
# Writes OUT_DIR/gpu_check.json (the JSON line) and OUT_DIR/gpu_check.log (default OUT_DIR
# .cache/gpu-check); ARGS go to the benchmark (e.g. --sizes-mb 1,16 --no-estimator).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="${GPU_WHEELS:-.cache/gpu-wheels}"
PYTHON="${PYTHON:-python3}"
mapfile -t PINS < <(grep -E '^(mpich|mpi4py|cloudpickle)==' lock/dev.txt)
if [ "${#PINS[@]}" -ne 3 ]; then
  echo "gpu_check: lock/dev.txt must pin mpich, mpi4py and cloudpickle; found: ${PINS[*]:-none}" >&2
  exit 2
fi

if [ "${1:-}" = --download ]; then
  version="${2:-3.12}"
  mkdir -p "$WHEELS"
  platforms=()
  for p in manylinux_2_28 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
  done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "$version" "${platforms[@]}" -d "$WHEELS" "${PINS[@]}"
  echo "gpu_check: wheels for Python $version in $WHEELS:"
  ls -1 "$WHEELS"
  exit 0
fi

out="${1:-.cache/gpu-check}"
shift || true
[ "${1:-}" = -- ] && shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"

if ! command -v "$PYTHON" > /dev/null; then
  echo "gpu_check: no $PYTHON here; PYTHON=... names the Python that has torch" >&2
  exit 2
fi

# What this Python lacks of flyte-hvd's needs: an importable mpi4py and cloudpickle, and an
# mpiexec beside the interpreter or on PATH (the launcher's rule).
has_needs() {
  "$PYTHON" - <<'EOF'
import os, shutil, sys
import cloudpickle, mpi4py  # noqa: F401
mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: F401
sys.exit(0 if shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec") else 1)
EOF
}

prefix=""
cleanup() { if [ -n "$prefix" ]; then rm -rf "$prefix"; fi; }
trap cleanup EXIT
if has_needs 2> /dev/null; then
  echo "gpu_check: $PYTHON has mpi4py, cloudpickle and mpiexec; nothing to install"
else
  prefix="$(mktemp -d /tmp/gpu-check-prefix.XXXXXX)"
  from=()
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    from=(--no-index --find-links "$WHEELS")
  fi
  echo "gpu_check: installing ${PINS[*]} into $prefix from ${from[*]:-the package index}"
  # --ignore-installed: a version the machine has elsewhere (its own mpi4py) must not stop the
  # prefix's install.
  "$PYTHON" -m pip install -q --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --ignore-installed --prefix "$prefix" "${from[@]}" "${PINS[@]}"
  site="$("$PYTHON" -c 'import sys, sysconfig
print(sysconfig.get_path("purelib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$prefix")"
  # The prefix's mpi4py first; its libmpi found through MPI4PY_LIBMPI (mpi4py looks beside the
  # interpreter's own prefix otherwise); its mpiexec on PATH.
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$prefix/bin:$PATH"
  export MPI4PY_LIBMPI="$prefix/lib/libmpi.so.12"
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # flyte_hvd and benchmarks from the checkout
export PYSPARK_PYTHON="${PYSPARK_PYTHON:-$(command -v "$PYTHON")}"
export PYTHONUNBUFFERED=1
set +e
"$PYTHON" -m benchmarks.gpu_check --out "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
set -e
echo "gpu_check: exit $status; the JSON line in $out/gpu_check.json, the output in $out/gpu_check.log"
exit "$status"
