#!/usr/bin/env bash
# Installs Azurite (Microsoft's Azure Storage emulator, an npm package) for the abfs:// Store
# tests into the user's cache, one folder per version (~/.cache/flyte-hvd/azurite-VERSION, or
# AZURITE_PREFIX), so every checkout on the machine shares it (an npm install takes ~45 s);
# quick and silent when that version is there.
#
#   scripts/install_azurite.sh     install if missing, then print the azurite-blob path
#
# Needs node and npm (npm's configured registry is used).
set -euo pipefail
cd "$(dirname "$0")/.."

AZURITE_VERSION="${AZURITE_VERSION:-3.37.0}"
prefix="${AZURITE_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/flyte-hvd/azurite-$AZURITE_VERSION}"
bin="$prefix/node_modules/.bin/azurite-blob"
installed="$prefix/node_modules/azurite/package.json"

if ! [ -x "$bin" ] || ! grep -q "\"version\": \"$AZURITE_VERSION\"" "$installed" 2>/dev/null; then
  command -v npm >/dev/null || {
    echo "install_azurite: npm is not installed; install Node.js 18+ with npm (e.g. apt-get install nodejs npm)" >&2
    exit 1
  }
  echo "install_azurite: azurite@$AZURITE_VERSION into $prefix" >&2
  mkdir -p "$prefix"
  npm install --prefix "$prefix" --no-save --no-audit --no-fund --loglevel=error \
    "azurite@$AZURITE_VERSION" >&2
fi
echo "$bin"
