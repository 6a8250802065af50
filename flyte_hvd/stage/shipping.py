"""Ship a task's own Python package to Spark's Python workers, as a cluster ships code.

A UDF that a Spark task defines, and a function or model it hands to the ranks, is pickled by
reference to its module (``workflows.rossmann_features.…``). Spark's Python workers, and the
ranks they start, import that module again, so the module's package must be importable
there. On a cluster it is importable only through what the Spark job ships: the Spark
plugins of both Flyte SDKs add the task's code as a zip (``SparkContext.addPyFile``).
``pyflyte run`` or ``flyte run --local`` started from another directory puts the package on
the driver's ``sys.path`` alone, and executors on other hosts never see the checkout.
``ship_package`` ships the package the same way in every case: a zip of its source, added
with ``addPyFile``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from flyte_hvd.core.log import get_logger

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = get_logger(__name__)


def ship_package(spark: SparkSession, module: str) -> str:
    """Make the top-level package of ``module`` importable on the session's Python workers.

    Args:
        spark: the task's ``SparkSession``.
        module: a module of the package, usually ``__name__`` of the calling task's module.

    Returns:
        The zip's file name (``<package>-<content hash>.zip``). Calling again with unchanged
        sources ships nothing new.

    Raises:
        ValueError: ``module`` is not imported, or its top-level package is a single module
            file or an installed distribution's package (those reach executors through the
            image, not through a zip).
    """
    top = module.partition(".")[0]
    package = sys.modules.get(top)
    paths = list(getattr(package, "__path__", []) or [])
    if package is None or len(paths) != 1:
        raise ValueError(
            f"`module`={module!r}: expected an imported module of a regular package (a folder "
            f"with __init__.py); found {'no imported module' if package is None else package}. "
            f"Pass `__name__` from a module inside the package to ship."
        )
    source = Path(paths[0]).resolve()
    if "site-packages" in source.parts or "dist-packages" in source.parts:
        raise ValueError(
            f"`module`={module!r} is installed ({source}): it reaches executors through the "
            f"image's Python environment; ship only the workflow's own package."
        )
    files = sorted(
        path
        for path in source.rglob("*.py")
        if "__pycache__" not in path.parts and not path.name.startswith(".")
    )
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    name = f"{top}-{digest.hexdigest()[:16]}.zip"
    context = spark.sparkContext
    if name in (context._python_includes or []):
        return name
    from pyspark import SparkFiles

    # Under Spark's own temporary folder of this application, which Spark removes at its end.
    folder = tempfile.mkdtemp(prefix="flyte-hvd-ship-", dir=SparkFiles.getRootDirectory())
    archive = os.path.join(folder, name)
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in files:
            zf.write(path, os.path.join(top, str(path.relative_to(source))))
    context.addPyFile(archive)
    logger.info(
        "shipped package %s (%d files) to Spark's Python workers as %s", top, len(files), name
    )
    return name
