"""Environment that processes started for a run take from the driver."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

# Storage settings a local master's ranks and Python workers take from the driver as it is now:
# S3's, fsspec's, Google Cloud Storage's (credentials, project, an emulator, gcsfs' switches)
# and Azure's.
FORWARDED_ENV_PREFIXES = ("AWS_", "FSSPEC_", "GOOGLE_", "GCSFS_", "STORAGE_EMULATOR_HOST", "AZURE_")


# The Spark driver's flyte_hvd version, in every rank's environment: the executor's task and
# the rank each compare their own with it before they run anything.
DRIVER_VERSION_ENV = "FLYTE_HVD_DRIVER_VERSION"


def version_mismatch(driver_version: str | None, where: str) -> str | None:
    """The error when the flyte_hvd imported here (``where``: an executor, a rank) is not the
    driver's version ``driver_version``; None when they agree or no version was given."""
    import flyte_hvd

    mine = flyte_hvd.__version__
    if not driver_version or driver_version == mine:
        return None
    return (
        f"flyte_hvd {mine} in {where} (imported from "
        f"{os.path.dirname(flyte_hvd.__file__)}), but flyte_hvd {driver_version} on the Spark "
        f"driver: the driver, the executors and the ranks must run one flyte_hvd. If the "
        f"executors' image is older or newer than the driver's, run both from one image "
        f"(spark.kubernetes.executor.container.image, or the task's image). If the task's code "
        f"bundle ships a flyte_hvd of its own (`pyflyte run --remote --copy auto` from a "
        f"checkout), register with `--copy all`, whose .flyteignore leaves it out, so that "
        f"every pod imports the image's."
    )


def local_driver_env(master: str, num_proc: int) -> dict[str, str]:
    """On a ``local``/``local-cluster`` Spark master the ranks and Python workers are the
    driver's own descendants on this host, but their environment is the one Spark started
    with: storage credentials or an endpoint the driver set since (``AWS_*``,
    ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``...) would be missing.
    Pass the driver's current ones, as an executor pod on a cluster gets them from its own
    secret. The same holds for the driver's import path (``driver_import_path``), and each
    of ``num_proc`` ranks gets its share of a ``local[N]`` master's cores
    (``local_threads_env``). On any other master this is empty: nothing driver-local crosses
    to other hosts."""
    env = local_storage_env(master)
    path = driver_import_path() if master.startswith("local") else ""
    if path:
        env["PYTHONPATH"] = path
    env.update(local_threads_env(master, num_proc))
    return env


def local_threads_env(master: str, num_proc: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``num_proc`` ranks on a ``local``/``local[N]``/
    ``local[*]`` master: the master's cores divided among the ranks (at least 1).

    Spark gives every Python worker ``OMP_NUM_THREADS`` = ``spark.task.cpus`` (1 unless set),
    and a rank inherits its worker's environment; PyTorch and OpenMP libraries size their
    thread pools by it (and TensorFlow through ``rank_threads_env``). On a cluster that is
    the rank's share of its executor (what ``HorovodSpark``'s ``cores_per_rank`` sets), but on
    a local master the ranks are all that computes on the machine while they train: one rank
    of a ``local[8]`` session would use 1 core of 8. A ``local`` master without brackets has
    one core; ``local-cluster`` keeps Spark's setting."""
    match = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\s*\d+)?\])?", master.strip())
    if match is None:
        return {}
    cores = match.group(1)
    total = (os.cpu_count() or 1) if cores == "*" else int(cores or 1)
    return {"OMP_NUM_THREADS": str(max(1, total // max(1, num_proc)))}


# TensorFlow sizes its intra-op pool by the cores it can run on, not by OMP_NUM_THREADS.
TF_INTRA_OP_ENV = "TF_NUM_INTRAOP_THREADS"


def rank_threads_env(env: Mapping[str, str]) -> dict[str, str]:
    """TensorFlow's intra-op threads for a rank: its ``OMP_NUM_THREADS`` (its share of the
    cores, see ``local_threads_env``) unless ``TF_NUM_INTRAOP_THREADS`` is set already.

    Left to itself, each rank's TensorFlow splits every op over all the cores of the host or
    pod, and ranks that share the cores wait on each other's threads: the Rossmann model's
    step on 2 ranks of ``local[2]`` took 217 ms with a pool of 2 threads a rank, 162 ms with
    1. Read when TensorFlow makes its first op, so the rank sets it before the job runs."""
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if TF_INTRA_OP_ENV in env or not threads.isdigit() or int(threads) < 1:
        return {}
    return {TF_INTRA_OP_ENV: threads}


def local_storage_env(master: str) -> dict[str, str]:
    """The storage settings (``AWS_*``, ``FSSPEC_*``, ``GOOGLE_*``, ``GCSFS_*``,
    ``STORAGE_EMULATOR_HOST``, ``AZURE_*``) of ``local_driver_env``."""
    if not master.startswith("local"):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def driver_import_path() -> str:
    """The driver's import path beyond the interpreter's own (the project root that pyflyte
    or pytest added, a script's folder), then the folders its loaded modules were imported
    from where the path no longer names them: on a local master the ranks need them to import
    what cloudpickle sends by reference. (``pyflyte run /path/wf.py`` puts the workflow's
    folder on ``sys.path`` only while it loads the file; the task, run later, and the modules
    beside it come from there.) On a cluster code reaches executors only as the Spark job
    ships it (``addPyFile``), which the rank takes from its Python worker instead."""
    own = tuple(os.path.abspath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    paths: list[str] = []
    for path in [os.path.abspath(e or os.getcwd()) for e in sys.path] + _module_roots(own):
        if not path.startswith(own) and path not in paths and os.path.exists(path):
            paths.append(path)
    return os.pathsep.join(paths)


def _module_roots(skip: tuple[str, ...]) -> list[str]:
    """The folders the loaded modules were imported from, but those under ``skip``: ``/x``
    for a module ``a.b`` loaded from ``/x/a/b.py`` or ``/x/a/b/__init__.py``."""
    roots = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if (
            name == "__main__"
            or not isinstance(file, str)
            or not file.endswith(".py")
            or file.startswith(skip)
        ):
            continue
        parts = name.split(".")
        if os.path.basename(file) == "__init__.py":
            parts.append("__init__")
        tail = os.sep + os.path.join(*parts) + ".py"
        file = os.path.abspath(file)
        if file.endswith(tail) and (root := file[: -len(tail)]) not in roots:
            roots.append(root)
    return roots


# What ranks never take from the driver's environment: it describes the driver's own host,
# process, interpreter or Spark role, not the job (the ranks' host and Spark give them theirs).
_HOST_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "PWD",
        "OLDPWD",
        "HOSTNAME",
        "TMPDIR",
        "TEMP",
        "TMP",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONEXECUTABLE",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "CLASSPATH",
        "SHLVL",
        "_",
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "DISPLAY",
        "TERM_SESSION_ID",
        # pytest's name of the test phase the driver process runs, new at every phase: passed
        # on, every run's ranks would start unlike the last run's, and no spare rank started
        # ahead (``spare``, keyed by the rank's environment) would ever serve one.
        "PYTEST_CURRENT_TEST",
        "FLYTE_HVD_SPARE",
        "FLYTE_HVD_SPARE_OWNER",
        "FLYTE_HVD_SPARE_PRELOAD",
        "FLYTE_HVD_OUTPUT_FDS",
        "FLYTE_HVD_ADDRESS",
        # The driver's own torch.distributed group (it runs under torchrun, say): each rank gets
        # its own values (``process_group``).
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
_HOST_ENV_PREFIXES = (
    "SPARK_",
    "PYSPARK_",
    "JAVA_",
    "JDK_",
    "HADOOP_",
    "YARN_",
    "KUBERNETES_",
    "XDG_",
    "SSH_",
    "CONDA_",
    "JPY_",
    "PMI_",
    "PMIX_",
    "HYDRA_",
    "MPIR_",
    "OMPI_",
    "I_MPI_",
    "FLYTE_HVD_RANK",
    "FLYTE_HVD_SIZE",
    "FLYTE_HVD_CONTROL",
    "FLYTE_HVD_JOB",
    "FLYTE_HVD_RESULT",
    "TORCHELASTIC_",
)


def driver_env() -> dict[str, str]:
    """The driver's environment as it is now, for ranks started without an explicit ``env``
    (Horovod's ``run`` and ``SparkBackend`` default ``env`` to ``os.environ``): a variable set
    on the driver before the call (``HOROVOD_TIMELINE``, ``TF_CPP_MIN_LOG_LEVEL``, a tracking
    URI) reaches every rank. Left out: what describes the driver's own host, interpreter or
    Spark role (``PATH``, ``HOME``, ``PYTHONPATH``, ``JAVA_HOME``, ``SPARK_*``,
    ``CUDA_VISIBLE_DEVICES``, thread counts, MPI launch variables, the driver's own
    ``RANK``/``MASTER_ADDR``/... of a torch.distributed group it belongs to, ...)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in _HOST_ENV and not k.startswith(_HOST_ENV_PREFIXES)
    }
