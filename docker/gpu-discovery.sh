#!/usr/bin/env bash
# Spark's GPU discovery script (spark.{driver,executor}.resource.gpu.discoveryScript): prints
# the GPUs this container sees as Spark's ResourceInformation JSON. nvidia-smi is provided by
# the NVIDIA container runtime on GPU nodes.
set -euo pipefail
addresses=$(nvidia-smi --query-gpu=index --format=csv,noheader | sed 's/.*/"&"/' | paste -sd, -)
printf '{"name": "gpu", "addresses": [%s]}\n' "$addresses"
