#!/usr/bin/env bash
# The per-Python suite (`make test-pythons`): for each Python the package supports beside the
# main venv's 3.11, a venv from that Python's lock (lock/test-py3.X.txt: TensorFlow's CPU
# build, Spark, the Flyte 2 SDK, pytest) and a few minutes of tests in it:
#
#   the fast tests that need no framework (the package's shape, the core, the data layer),
#   tests/test_pythons.py (imports without the frameworks and without flytekit; Spark +
#   TensorFlow `run`; torch's case skips: no CPU wheel of it for these Pythons here), a
#   KerasEstimator fit/transform on local[2], after one Spark DataFrame written by prepare_data
#   and read back (pandas), and a Flyte 2 HorovodSpark task run locally on two ranks.
#
#   scripts/test_pythons.sh [VERSION...]   or PYTHONS="..."; default 3.12 3.13
#
# On Python 3.13 the package installs without flytekit (every flytekit release, to 1.16.31,
# requires Python <3.13): there `flyte_hvd.flyte` refuses to import, naming why, and the Flyte 2
# plugin is the one tested.
#
# The venvs are .cache/py3.X, reinstalled only when their lock changed. The installer is uv
# (UV, default the main venv's; the version lock/dev.txt pins) from the package sources pip is
# configured with (scripts/pip_sources.sh): about 30-40 s a venv, cold cache or warm, where pip
# takes 85 s from its cache and 2 minutes without (docs/testing.md). INSTALLER=pip installs
# with pip instead. A Python or a lock missing fails the run at once, naming it, before any
# venv is made or test run.
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
  read -r -a versions <<<"${PYTHONS:-3.12 3.13}"
fi
INSTALLER="${INSTALLER:-uv}"
UV="${UV:-$(if [ -x .venv/bin/uv ]; then echo .venv/bin/uv; else command -v uv || true; fi)}"
if [ "$INSTALLER" = uv ] && [ -z "$UV" ]; then
  echo "test-pythons: no uv (make setup installs it into .venv; or INSTALLER=pip)" >&2
  exit 1
fi
# pip's configuration is read by a Python that has pip: the main venv's, else python3.
pip_python=$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)

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

# Installs $lock into a fresh venv $venv of $python: the package editable (the tests import
# this checkout) with its tf-cpu and flyte2 extras, pytest and pip; the lock pins every one.
install() {
  local python=$1 venv=$2 lock=$3
  local requirements=(-e ".[tf-cpu,flyte2]" pytest pytest-timeout pip)
  rm -rf "$venv"
  if [ "$INSTALLER" = uv ]; then
    # pip's CA bundle (a proxy's certificate authority), which uv takes from SSL_CERT_FILE.
    local cert
    cert=$(scripts/pip_sources.sh "$pip_python" --cert)
    [ -n "$cert" ] && export SSL_CERT_FILE="${SSL_CERT_FILE:-$cert}"
    "$UV" venv -q --python "$python" "$venv"
    # Word splitting of the sources is intended: they hold no spaces inside an argument.
    # shellcheck disable=SC2046
    "$UV" pip install -q --python "$venv/bin/python" \
      $(scripts/pip_sources.sh "$pip_python") -c "$lock" "${requirements[@]}"
  else
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q -c "$lock" "${requirements[@]}"
  fi
}

tests=(
  tests/test_package.py
  tests/test_pythons.py
  tests/test_topology.py
  tests/test_buffers.py
  "tests/test_prepare_data.py::test_layout_metadata_and_shapes"
  "tests/test_keras_estimator.py::test_regression_fit_transform_save_load"
  "tests/test_flyte2.py::test_body_runs_on_every_rank_and_outputs_are_rank_0s"
  "tests/test_flyte2.py::test_serialized_task_is_the_spark_plugins_job_with_the_barrier_settings"
)

# The Python of version $1, where it has a lock; else says what is missing.
python_with_lock() {
  [ -f "lock/test-py$1.txt" ] || {
    echo "test-pythons: no lock/test-py$1.txt (make lock)" >&2
    return 1
  }
  find_python "$1" || {
    echo "test-pythons: Python $1 is not installed (pyenv install $1)" >&2
    return 1
  }
}

# The venv of $1 made current from its lock (reinstalled only when the lock changed).
ensure_venv() {
  local version=$1 lock="lock/test-py$1.txt" venv=".cache/py$1" python want start
  python=$(python_with_lock "$version")
  # The lock and what is installed from it; not pyproject.toml, whose dependencies reach the
  # venv only through the lock (`make lock`).
  want=$( (cat "$lock"; declare -f install) | sha256sum | cut -c1-16)
  if [ "$(cat "$venv/.installed-stamp" 2>/dev/null)" != "$want" ]; then
    start=$SECONDS
    install "$python" "$venv" "$lock"
    echo "$want" >"$venv/.installed-stamp"
    echo "test-pythons: $venv installed from $lock with $INSTALLER in $((SECONDS - start)) s"
  fi
}

# Each Python's venv is made while the Python before it runs its tests: the install keeps
# about one core busy, mostly where the tests leave one idle.
# Every version's lock and Python are there before anything is installed or run.
for version in "${versions[@]}"; do
  python_with_lock "$version" >/dev/null
done
status=0
ensure_venv "${versions[0]}"
for i in "${!versions[@]}"; do
  version=${versions[$i]}
  venv=".cache/py$version"
  next=${versions[$((i + 1))]:-}
  making=""
  if [ -n "$next" ]; then
    ensure_venv "$next" >".cache/py$next.install.log" 2>&1 &
    making=$!
  fi
  start=$SECONDS
  echo "test-pythons: Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')"
  # Python writes the bytecode of what these tests import (where PYTHONDONTWRITEBYTECODE is
  # set, every rank and Spark worker would compile TensorFlow's sources again): cheaper than
  # compiling every installed file ahead, as `make setup` does for the main venv (measured on
  # 2 cores: the Python 3.12 venv 59 -> 32 s, its tests 66 -> 80 s the first time).
  if ! env -u PYTHONDONTWRITEBYTECODE TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -m pytest \
    -p no:cacheprovider -q --durations=5 "${tests[@]}"; then
    status=1
  fi
  echo "test-pythons: Python $version tests took $((SECONDS - start)) s"
  if [ -n "$making" ]; then
    making_status=0
    wait "$making" || making_status=$?
    cat ".cache/py$next.install.log"
    [ "$making_status" = 0 ] || exit 1
  fi
done
exit $status
