"""Environment that processes started for a run take from the driver."""

from __future__ import annotations

import os

# Storage settings a local master's ranks and Python workers take from the driver as it is now.
FORWARDED_ENV_PREFIXES = ("AWS_", "FSSPEC_")


def local_driver_env(master: str) -> dict[str, str]:
    """On a ``local``/``local-cluster`` Spark master the ranks and Python workers are the
    driver's own descendants on this host, but their environment is the one Spark started
    with: S3 credentials or an endpoint the driver set since (``AWS_*``) would be missing.
    Pass the driver's current ones, as an executor pod on a cluster gets them from its own
    secret. On any other master this is empty: nothing driver-local crosses to other hosts."""
    if not master.startswith("local"):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
