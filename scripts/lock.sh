#!/usr/bin/env bash
# Regenerates the lock files in lock/ from pyproject.toml (`make lock`).
#
#   scripts/lock.sh [UV-COMPILE-ARGS...]   e.g. --upgrade-package pandas, or --upgrade
#
# uv keeps each lock's pins where they still satisfy pyproject.toml; the arguments, passed to
# every `uv pip compile`, move them (`make lock LOCK_ARGS="--upgrade-package pandas"`).
#
#   lock/dev.txt        .[tf-cpu,torch,dev]   what `make setup` installs (CI, laptops)
#   lock/image.txt      .[tf,torch]           the Docker image
#   lock/image-gpu.txt  .[tf,torch] + tensorflow[and-cuda]   the image's GPU variant
#   lock/test-py3.12.txt  .[tf-cpu,flyte2] + pytest, pip   `make test-pythons` on Python 3.12
#   lock/test-py3.13.txt  .[tf-cpu,flyte2] + pytest, pip   `make test-pythons` on Python 3.13
#
# tensorflow and tensorflow-cpu cannot share an environment, hence one file per install.
# The first three are resolved for CPython 3.11 on x86_64 manylinux (the image and CI), whatever
# machine runs this; the test-py* files for the other Pythons the package supports, whose
# resolutions differ (numpy 2.5 needs Python 3.12; on 3.13 flytekit and flytekitplugins-spark
# drop out: every flytekit release, to 1.16.31, requires Python <3.13, and the package requires
# them only below 3.13). They hold no torch: its CPU build for those Pythons comes only from
# PyTorch's CPU index, which these machines do not reach.
#
# The package takes any torch>=2.13; the locks pin TORCH_VERSION (2.13.0, the CPU wheel these
# machines carry). torch is the CPU build (+cpu) in dev.txt and image.txt: from
# TORCH_FIND_LINKS (a folder holding it) when set or when /opt/wheels exists, else from the
# PyTorch CPU index. image-gpu.txt takes the same torch version from PyPI, whose Linux x86_64
# wheel is the CUDA build (its CUDA 13 libraries as nvidia-* wheels, beside the CUDA 12 ones
# of tensorflow[and-cuda]; the two sets have different names and resolve into one environment).
set -euo pipefail
cd "$(dirname "$0")/.."

UV="${UV:-uv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
# The Pythons of `make test-pythons`, one lock each (scripts/test_pythons.sh).
TEST_PYTHONS="${TEST_PYTHONS:-3.12 3.13}"
if [ -n "${TORCH_FIND_LINKS:-}" ] || [ -d /opt/wheels ]; then
  torch_source=(--find-links "${TORCH_FIND_LINKS:-/opt/wheels}")
else
  torch_source=(--extra-index-url https://download.pytorch.org/whl/cpu
    --index-strategy unsafe-best-match)
fi
common=(--quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28
  --custom-compile-command "make lock" --no-emit-find-links "${torch_source[@]}")

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==$TORCH_VERSION" >"$work/torch.txt"
# Every lock is on pandas 3 (pyspark 4.3 warns that it "does not yet fully support pandas >=
# 3.0.0"; the tests that touch pandas pass on it: Rossmann data, transform, toPandas, flytekit's
# pandas types, MLflow). numpy 2.5 only where the Python is 3.12 or later (its requirement).

"$UV" pip compile pyproject.toml "${common[@]}" -c "$work/torch.txt" \
  --extra tf-cpu --extra torch --extra dev -o lock/dev.txt "$@"
"$UV" pip compile pyproject.toml "${common[@]}" -c "$work/torch.txt" \
  --extra tf --extra torch -o lock/image.txt "$@"
sed -i -e "s|#   -c $work/torch.txt|#   -c torch==$TORCH_VERSION (TORCH_VERSION)|" lock/dev.txt lock/image.txt
# The GPU image: the CPU locks' torch version, as PyPI's CUDA build (no torch_source).
torch_version=$(sed -n 's/^torch==\([^+]*\)+cpu$/\1/p' lock/image.txt)
printf 'tensorflow[and-cuda]\ntorch==%s\n' "$torch_version" >"$work/gpu.in"
"$UV" pip compile pyproject.toml "$work/gpu.in" --quiet --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
  --extra tf --extra torch -o lock/image-gpu.txt "$@"
# The header names the temporary input; name what it held instead.
sed -i -e "s|#   -r $work/gpu.in|#   tensorflow[and-cuda], torch==$torch_version (CUDA)|" lock/image-gpu.txt

# The per-Python suite (`make test-pythons`): TensorFlow's CPU build, Spark, the Flyte 2 SDK
# (the Flyte plugin that installs on every Python), pytest, and pip (tests/test_pythons.py builds
# the wheel with it; a venv made by uv has none).
printf 'pytest>=8\npytest-timeout>=2.3\npip\n' >"$work/test.in"
for version in $TEST_PYTHONS; do
  "$UV" pip compile pyproject.toml "$work/test.in" --quiet --python-version "$version" \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
    --extra tf-cpu --extra flyte2 -o "lock/test-py$version.txt" "$@"
  sed -i "s|-r $work/test.in|pytest, pytest-timeout, pip (scripts/lock.sh)|" "lock/test-py$version.txt"
done

# The CPU installs must not carry CUDA, and the GPU image must: fail here rather than in a
# multi-GB install.
for lock in lock/dev.txt lock/image.txt; do
  if ! grep -Eq '^torch==[^ ]+\+cpu$' "$lock"; then
    echo "$lock: torch is not the CPU build (+cpu); set TORCH_FIND_LINKS to a folder holding it." >&2
    exit 1
  fi
done
test_locks=()
for version in $TEST_PYTHONS; do test_locks+=("lock/test-py$version.txt"); done
for lock in lock/dev.txt lock/image.txt "${test_locks[@]}"; do
  if grep -Eq '^nvidia-' "$lock"; then
    echo "$lock: CPU install pulls nvidia-* packages: $(grep -E '^nvidia-' "$lock" | tr '\n' ' ')" >&2
    exit 1
  fi
done
if ! grep -Eq '^torch==[0-9.]+$' lock/image-gpu.txt || ! grep -Eq '^nvidia-cudnn-cu13==' lock/image-gpu.txt; then
  echo "lock/image-gpu.txt: torch is not PyPI's CUDA build (no local version, nvidia-cudnn-cu13)." >&2
  exit 1
fi
echo "wrote lock/dev.txt lock/image.txt lock/image-gpu.txt ${test_locks[*]}"
