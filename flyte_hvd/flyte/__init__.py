"""Flyte tasks whose body runs on every rank of a Spark barrier stage.

``@task(task_config=HorovodSpark(num_proc=2))``; importing this module registers the plugin
(flytekit also imports it through the ``flytekit.plugins`` entry point). pyspark is imported
only when a task runs.

This is the flytekit plugin. flytekit's releases (to 1.16.31, the latest) require Python
<3.13, so on Python 3.13 the package installs without it and this module refuses to import,
saying so; ``flyte_hvd.flyte2`` is the same task for the Flyte 2 SDK, on every Python.
"""

import sys as _sys


def _without_flytekit(error: ModuleNotFoundError) -> ImportError:
    """The error of an import of this module where flytekit or its Spark plugin is missing:
    what is missing, why, and what to do."""
    python = f"{_sys.version_info.major}.{_sys.version_info.minor}"
    if _sys.version_info >= (3, 13):
        why = (
            f"flytekit's releases (to 1.16.31) require Python <3.13, so flyte-hvd installs "
            f"without it on Python {python}"
        )
        todo = (
            "use the Flyte 2 SDK's plugin, `flyte_hvd.flyte2` (`pip install flyte-hvd[flyte2]`), "
            "or Python 3.11 or 3.12, where `pip install flyte-hvd` installs flytekit"
        )
    else:
        why = f"flyte-hvd requires them on Python {python}, but this environment lacks them"
        todo = (
            "`pip install 'flytekit>=1.16' 'flytekitplugins-spark>=1.16'` (or reinstall flyte-hvd)"
        )
    return ImportError(
        f"`flyte_hvd.flyte` is the flytekit plugin and needs flytekit and flytekitplugins-spark; "
        f"`{error.name}` is not installed: {why}. To run HorovodSpark tasks, {todo}."
    )


try:
    import flytekit as _flytekit  # noqa: F401
    import flytekitplugins.spark as _flytekit_spark  # noqa: F401
except ModuleNotFoundError as _error:
    if not (_error.name or "").startswith(("flytekit", "flytekitplugins")):
        raise
    raise _without_flytekit(_error) from _error

from flyte_hvd.flyte.task import HorovodSpark, HorovodSparkFunctionTask  # noqa: E402

__all__ = ["HorovodSpark", "HorovodSparkFunctionTask"]
