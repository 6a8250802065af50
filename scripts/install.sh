#!/usr/bin/env bash
# Installs lock/dev.txt into a virtual environment (`make setup`):
#
#   scripts/install.sh VENV_PYTHON          install
#   scripts/install.sh VENV_PYTHON --print  print the pip commands instead (downloads nothing)
#
# lock/dev.txt pins torch's CPU build (2.13.0+cpu), which PyPI does not carry. When pip finds
# that wheel without any index (a `find-links` folder in pip's configuration or PIP_FIND_LINKS),
# it is installed from there. Otherwise torch alone comes from the PyTorch CPU index
# (TORCH_INDEX_URL), and everything else from the indexes pip is configured with (PyPI).
# Then Azurite, the Azure Storage emulator of the abfs:// Store tests, comes from npm into
# .cache/azurite (scripts/install_azurite.sh; nothing to do when it is there).
set -euo pipefail
cd "$(dirname "$0")/.."

py="${1:?usage: scripts/install.sh VENV_PYTHON [--print]}"
mode="${2:-}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
extras="tf-cpu,torch,dev"

torch_pin=$(grep -E '^torch==' lock/dev.txt)
commands=()
# --no-index: only find-links folders are searched; --dry-run: nothing is installed.
if "$py" -m pip install --quiet --dry-run --ignore-installed --no-deps --no-index \
  "$torch_pin" >/dev/null 2>&1; then
  echo "install: $torch_pin from a local find-links folder" >&2
else
  echo "install: $torch_pin from $TORCH_INDEX_URL" >&2
  commands+=("$py -m pip install -q --no-deps --index-url $TORCH_INDEX_URL $torch_pin")
fi
commands+=("$py -m pip install -q -c lock/dev.txt -e .[$extras]")

for command in "${commands[@]}"; do
  if [ "$mode" = "--print" ]; then
    echo "$command"
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
