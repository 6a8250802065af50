#!/usr/bin/env bash
# `make cluster`: a Spark standalone master and two workers on simulated hosts (own mount and
# UTS namespaces, own loopback address), moto S3 on 127.0.0.1, and a shell on the driver host.
# Exiting the shell stops everything. Needs root and unshare. See tests/cluster_harness.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PY:-.venv/bin/python}" tests/cluster_harness.py "$@"
