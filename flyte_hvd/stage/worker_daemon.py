"""Spark's Python worker daemon, importing pyspark from its installed package.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip``, py4j's zip and the spark-core jar first
on its Python workers' import path. With pyspark installed by pip, ``$SPARK_HOME`` is that
installed package, so the archives hold the code that sits unpacked beside them, and they
cost twice: a module imported from a zip is compiled from source (no bytecode cache) in every
new daemon, and before each task PySpark's worker calls ``importlib.invalidate_caches()``,
which reads the directory of every archive on the path again, once per package imported from
it (measured: 0.11 s of CPU per task on 2 cores, a fifth of the Python side of a 1 M-row
``transform``). This daemon takes the archives that lie inside the installed pyspark package
off ``sys.path``, then runs PySpark's own daemon. Where pyspark is not installed beside them
(a Spark distribution's ``$SPARK_HOME``), nothing changes.

The workers it forks write to its stderr, which the executor copies to its log (locally: the
console). TensorFlow's C++ libraries print notices there when a worker imports them (a Keras
model's ``transform``) that ``TF_CPP_MIN_LOG_LEVEL`` does not reach; a filter process between
the workers and that stderr drops those lines (``launch.output.IMPORT_NOTICES``) and the
traceback a worker prints when the JVM closed its connection before the worker's last flush (a
broken pipe through PySpark's daemon), and passes the rest, as the ranks' output is passed
(``FLYTE_HVD_SPARK_LOG=warn`` keeps them).

Spark starts it for ``spark.python.daemon.module`` (see ``flyte_hvd.flyte.task``). Before
PySpark it imports only this package's launcher modules (no pyspark, no threads started:
PySpark's daemon forks its workers), which the workers' tasks then find already loaded.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys

SPARK_LOG_ENV = "FLYTE_HVD_SPARK_LOG"
_FILTER = (
    "import sys; from flyte_hvd.launch.output import copy_without_notices; "
    "copy_without_notices(0, 2, int(sys.argv[1]))"
)


def installed_pyspark(path: list[str]) -> str | None:
    """The directory of the pyspark package found on ``path``'s plain directories."""
    folders = [p for p in path if os.path.isdir(p or os.curdir)]
    spec = importlib.machinery.PathFinder.find_spec("pyspark", folders)
    if spec is None or not spec.origin or not spec.submodule_search_locations:
        return None
    return os.path.dirname(os.path.realpath(spec.origin))


def bundled_archives(path: list[str]) -> list[str]:
    """The entries of ``path`` that are archives (files) inside the installed pyspark."""
    home = installed_pyspark(path)
    if home is None:
        return []
    return [p for p in path if os.path.isfile(p) and os.path.realpath(p).startswith(home + os.sep)]


def filter_stderr() -> None:
    """From now on, this process's stderr (and that of the processes it forks) goes through a
    filter process that drops TensorFlow's import notices on its way to the stderr it had."""
    read_end, write_end = os.pipe()
    # It ends with this process: the orphaned workers' last words (tracebacks of sockets
    # closed by Spark's shutdown) go nowhere, as they did without the filter.
    subprocess.Popen(
        [sys.executable, "-c", _FILTER, str(os.getpid())],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
    )
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)


def main() -> None:
    if os.environ.get(SPARK_LOG_ENV, "error").strip().lower() == "error":
        filter_stderr()
    archives = bundled_archives(sys.path)
    for entry in archives:
        sys.path.remove(entry)
    for key in list(sys.path_importer_cache):  # the archives and folders inside them
        if any(key == a or key.startswith(a + os.sep) for a in archives):
            del sys.path_importer_cache[key]
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
