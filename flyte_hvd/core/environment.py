"""Environment that processes started for a run take from the driver."""

from __future__ import annotations

import os
import sys

# Storage settings a local master's ranks and Python workers take from the driver as it is now.
FORWARDED_ENV_PREFIXES = ("AWS_", "FSSPEC_")


def local_driver_env(master: str) -> dict[str, str]:
    """On a ``local``/``local-cluster`` Spark master the ranks and Python workers are the
    driver's own descendants on this host, but their environment is the one Spark started
    with: S3 credentials or an endpoint the driver set since (``AWS_*``) would be missing.
    Pass the driver's current ones, as an executor pod on a cluster gets them from its own
    secret. The same holds for the driver's import path (``driver_import_path``). On any
    other master this is empty: nothing driver-local crosses to other hosts."""
    env = local_storage_env(master)
    path = driver_import_path() if master.startswith("local") else ""
    if path:
        env["PYTHONPATH"] = path
    return env


def local_storage_env(master: str) -> dict[str, str]:
    """The storage settings (``AWS_*``, ``FSSPEC_*``) of ``local_driver_env``."""
    if not master.startswith("local"):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def driver_import_path() -> str:
    """The driver's import path beyond the interpreter's own (the project root that pyflyte
    or pytest added, a script's folder): on a local master the ranks need it to import what
    cloudpickle sends by reference. On a cluster code reaches executors only as the Spark
    job ships it (``addPyFile``), which the rank takes from its Python worker instead."""
    own = tuple(os.path.abspath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    paths: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if not path.startswith(own) and path not in paths and os.path.exists(path):
            paths.append(path)
    return os.pathsep.join(paths)
