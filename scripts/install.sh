#!/usr/bin/env bash
# Installs lock/dev.txt into a virtual environment (`make setup`):
#
#   scripts/install.sh VENV_PYTHON          install
#   scripts/install.sh VENV_PYTHON --print  print the install commands instead (downloads nothing)
#
# The installer is uv (the version lock/dev.txt pins, put into the venv with pip first): from a
# warm cache it installs the ~250 locked packages in about 40 s where pip takes about 3 minutes.
# uv reads no pip configuration, so the package sources pip is configured with (its config
# files and PIP_* variables: index-url, extra-index-url, find-links, constraint) are passed to
# it (scripts/pip_sources.sh), and like pip it picks the best match across them. INSTALLER=pip installs with pip instead.
#
# lock/dev.txt pins torch's CPU build (2.13.0+cpu), which PyPI does not carry. When pip finds
# that wheel without any index (a `find-links` folder in pip's configuration or PIP_FIND_LINKS),
# it is installed from there. Otherwise torch alone comes from the PyTorch CPU index
# (TORCH_INDEX_URL), and everything else from the indexes pip is configured with (PyPI).
# Then Azurite, the Azure Storage emulator of the abfs:// Store tests, comes from npm into
# the user's cache (scripts/install_azurite.sh; nothing to do when it is there).
set -euo pipefail
cd "$(dirname "$0")/.."

py="${1:?usage: scripts/install.sh VENV_PYTHON [--print]}"
mode="${2:-}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
INSTALLER="${INSTALLER:-uv}"
extras="tf-cpu,torch,dev"

torch_pin=$(grep -E '^torch==' lock/dev.txt)
uv_pin=$(grep -E '^uv==' lock/dev.txt)
venv_bin=$(dirname "$py")
if [ "$INSTALLER" = uv ]; then
  # pip's CA bundle (a proxy's certificate authority), which uv takes from SSL_CERT_FILE.
  cert=$(scripts/pip_sources.sh "$py" --cert)
  [ -n "$cert" ] && export SSL_CERT_FILE="${SSL_CERT_FILE:-$cert}"
  sources=$(scripts/pip_sources.sh "$py")
  install=("$py -m pip install -q $uv_pin" "$venv_bin/uv pip install -q --python $py")
else
  sources=""
  install=("" "$py -m pip install -q")
fi
commands=()
[ -n "${install[0]}" ] && commands+=("${install[0]}")
# --no-index: only find-links folders are searched; --dry-run: nothing is installed.
if "$py" -m pip install --quiet --dry-run --ignore-installed --no-deps --no-index \
  "$torch_pin" >/dev/null 2>&1; then
  echo "install: $torch_pin from a local find-links folder" >&2
else
  echo "install: $torch_pin from $TORCH_INDEX_URL" >&2
  commands+=("${install[1]} --no-deps --index-url $TORCH_INDEX_URL $torch_pin")
fi
# uv, unlike pip, writes no bytecode unless asked: without it every process (each rank, each
# Spark worker) compiles the sources of TensorFlow, torch and pyspark it imports, again and
# again where PYTHONDONTWRITEBYTECODE is set (a rank's imports took 2-3x as long).
compile=$([ "$INSTALLER" = uv ] && echo --compile-bytecode || true)
commands+=("${install[1]} $compile $sources -c lock/dev.txt -e .[$extras]")

for command in "${commands[@]}"; do
  if [ "$mode" = "--print" ]; then
    echo "$command" | tr -s ' '
  else
    # Word splitting is intended: the commands hold no spaces inside an argument.
    $command
  fi
done
if [ "$mode" = "--print" ]; then
  echo "install: then scripts/install_azurite.sh (Azurite from npm, for the abfs:// tests)" >&2
elif ! scripts/install_azurite.sh >/dev/null; then
  # Only the abfs:// tests need it; their fixture says what is missing.
  echo "install: Azurite could not be installed (see above); the abfs:// Store tests fail until it is" >&2
fi
