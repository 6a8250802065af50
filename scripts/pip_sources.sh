#!/usr/bin/env bash
# Prints the package sources pip is configured with as uv arguments (uv reads no pip
# configuration): index-url, extra-index-url, find-links and constraint from pip's config files
# and PIP_* variables, the last value of each setting winning as in pip (a setting may hold
# several values), after --index-strategy unsafe-best-match (pip picks the best match across
# its indexes; uv would stop at the first that has the package). With pip configured with
# nothing, only that flag: uv then uses PyPI, as pip does.
#
#   scripts/pip_sources.sh [PYTHON]          PYTHON's pip is asked (default: python3)
#   scripts/pip_sources.sh PYTHON --cert     pip's CA bundle (`cert`: a proxy's certificate
#                                            authority), which uv takes from SSL_CERT_FILE
set -euo pipefail
py="${1:-python3}"
if [ "${2:-}" = --cert ]; then
  "$py" -m pip config list 2>/dev/null | sed -n "s/^.*\.cert='\(.*\)'$/\1/p" | tail -1
  exit 0
fi
"$py" -m pip config list 2>/dev/null | "$py" -c '
import shlex, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}
last = {}
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    name = key.rsplit(".", 1)[-1]
    if name in flags:
        last[name] = shlex.split(value)[0].split() if value else []
args = [f"{flags[name]} {value}" for name, values in last.items() for value in values]
print(" ".join(["--index-strategy unsafe-best-match", *args]))
'
