#!/usr/bin/env bash
# The per-Python suite (`make test-pythons`): for each Python the package supports beside the
# main venv's 3.11 (now 3.12), a venv from that Python's lock (lock/test-py3.X.txt: TensorFlow's
# CPU build, Spark, pytest) and a few minutes of tests in it:
#
#   the fast tests that need no framework (the package's shape, the core, the data layer),
#   tests/test_pythons.py (imports without the frameworks; Spark + TensorFlow `run`; torch's
#   case skips: no CPU wheel of it for these Pythons here), and a KerasEstimator fit/transform
#   on local[2], after one Spark DataFrame written by prepare_data and read back (pandas).
#
#   scripts/test_pythons.sh [VERSION...]   or PYTHONS="..."; default 3.12
#
# Python 3.13 has no lock and no run: flytekit, a dependency of the package, requires Python
# <3.13 up to its latest release (1.16.31), so pip refuses the package there.
#
# The venvs are .cache/py3.X (reinstalled only when the lock or pyproject.toml changed, from
# pip's cache after the first time). A Python missing on the machine fails the run, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
  read -r -a versions <<<"${PYTHONS:-3.12}"
fi

find_python() {
  local version=$1 candidate
  for candidate in "$(command -v "python$version" || true)" \
    /root/.pyenv/versions/"$version".*/bin/python"$version" \
    /usr/bin/python"$version" /usr/local/bin/python"$version"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] &&
      "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$version'.split('.')))" \
        2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

tests=(
  tests/test_package.py
  tests/test_pythons.py
  tests/test_topology.py
  tests/test_buffers.py
  "tests/test_prepare_data.py::test_layout_metadata_and_shapes"
  "tests/test_keras_estimator.py::test_regression_fit_transform_save_load"
)

status=0
for version in "${versions[@]}"; do
  lock="lock/test-py$version.txt"
  venv=".cache/py$version"
  [ -f "$lock" ] || { echo "test-pythons: no $lock (make lock)" >&2; exit 1; }
  python=$(find_python "$version") || {
    echo "test-pythons: Python $version is not installed (pyenv install $version)" >&2
    exit 1
  }
  want=$(cat "$lock" pyproject.toml | sha256sum | cut -c1-16)
  if [ "$(cat "$venv/.installed-stamp" 2>/dev/null)" != "$want" ]; then
    start=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    # The lock pins pytest and pytest-timeout too; -e: the tests import this checkout.
    "$venv/bin/python" -m pip install -q -c "$lock" -e ".[tf-cpu]" pytest pytest-timeout
    echo "$want" >"$venv/.installed-stamp"
    echo "test-pythons: $venv installed from $lock in $((SECONDS - start)) s"
  fi
  start=$SECONDS
  echo "test-pythons: Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')"
  if ! TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -m pytest -p no:cacheprovider -q \
    --durations=5 "${tests[@]}"; then
    status=1
  fi
  echo "test-pythons: Python $version tests took $((SECONDS - start)) s"
done
exit $status
