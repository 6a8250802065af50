"""What each task of the barrier stage runs, whatever the session: the supervisor of its one
rank process, the rendezvous and the output over its link to the driver, and its rank's result
(inline when small, else kept by the driver); and ``load_result``, the driver's side of that
result. ``pipeline.launch`` builds the task; a stage backend runs it in every Spark task.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeAlias

import cloudpickle

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch.environment import DRIVER_VERSION_ENV, version_mismatch
from flyte_hvd.launch.rendezvous import PARTITION_ENV

if TYPE_CHECKING:
    from pyspark import TaskContext

    from flyte_hvd.stage.driver_link import DriverLink, DriverServer


# A barrier task: given its partition (unused: the task knows its rank) or, in a run given
# ``data``, the path of the file its partition's rows were written to, it yields its rank's
# ``(rank, pickled result)``.
BarrierTask: TypeAlias = Callable[[object], Iterator[tuple[int, bytes]]]

# A spare-starting task: starts a spare rank process in its Python worker unless one is idle
# there (``pipeline.start_spares``); yields 1 if it started one, else 0.
SpareTask: TypeAlias = Callable[[object], Iterator[int]]

# Inside a rank: the accelerator addresses Spark assigned to its task, comma-separated.
DEVICES_ENV = "FLYTE_HVD_SPARK_DEVICES"

# What a barrier task yields instead of its rank's result when the driver has ended the run.
RUN_FAILED = b"flyte-hvd: the run failed"
# A pickled result above this many bytes goes to the driver over the task's link, into a file,
# and the task yields this prefix and the id the driver keeps it under instead: a result that
# travels with the stage passes whole through the JVMs' heaps (a few hundred MB per rank
# killed a local driver JVM, and the user's SparkSession with it).
INLINE_RESULT_BYTES = 1 << 20
RESULT_ON_LINK = b"flyte-hvd: result kept by the driver as "


def task_rank_env(env: dict[str, str], ctx: TaskContext) -> dict[str, str]:
    """The run's rank environment as this Spark task gives it to its rank: the worker's
    import path and the task's GPUs added."""
    rank_env = dict(env)
    rank_env["PYTHONPATH"] = _worker_import_path(rank_env.get("PYTHONPATH"))
    gpus = ctx.resources().get("gpu")
    if gpus is not None and gpus.addresses:
        rank_env[DEVICES_ENV] = ",".join(gpus.addresses)
        rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
    return rank_env


def spare_task(rank_env: dict[str, str], preload: tuple[str, ...], single_host: bool) -> SpareTask:
    """The closure each task of ``pipeline.start_spares``'s job runs."""

    def task(_: object) -> Iterator[int]:
        from pyspark import TaskContext

        from flyte_hvd.launch.supervisor import start_spare_ahead

        ctx = TaskContext.get()
        assert ctx is not None  # inside a Spark task
        env = task_rank_env(rank_env, ctx)
        yield int(start_spare_ahead(env, preload, single_host))

    return task


def barrier_task(
    job: bytes,
    num_proc: int,
    secret: str,
    driver_address: tuple[str, int],
    env: dict[str, str],
    start_timeout: float,
    single_host: bool = False,
    preload: tuple[str, ...] = (),
) -> BarrierTask:
    """The closure each barrier task runs: plain values only, no driver objects."""

    def task(spilled: object) -> Iterator[tuple[int, bytes]]:
        from pyspark import BarrierTaskContext

        from flyte_hvd.launch.stall import ForwardWatch
        from flyte_hvd.launch.supervisor import RankSupervisor
        from flyte_hvd.stage.driver_link import DriverLink

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        link = DriverLink(driver_address, secret, rank)
        link.event("task_started")
        mismatch = version_mismatch(env.get(DRIVER_VERSION_ENV), f"the executor of rank {rank}")
        if mismatch:
            if link.failed(mismatch):  # the driver ends the run and raises it
                link.close()
                yield rank, RUN_FAILED
                return
            link.close()
            raise RuntimeError(mismatch)
        rank_env = task_rank_env(env, ctx)
        if isinstance(spilled, str):  # the rank's partition of the run's data, in a file
            rank_env[PARTITION_ENV] = spilled
        # "host:port" of the task's executor as the driver reaches it: rank 0's host part is
        # MASTER_ADDR when the ranks span hosts (``launch.torch_env``).
        address = ctx.getTaskInfos()[rank].address.rpartition(":")[0]
        supervisor = RankSupervisor(
            job,
            ranks=[rank],
            size=num_proc,
            exchange=_DriverExchange(link),
            secret=secret,
            start_timeout=max(start_timeout, 1.0),
            env=rank_env,
            output=link.output,
            watch=ForwardWatch(link.forward),
            single_host=single_host,  # a local[N] master: nothing listens beyond loopback
            preload=preload,
            address=address,
            read_result=lambda _, path: _task_result(link, path),
        )
        # Spark stops a cancelled Python task only by killing its worker, seconds later; the
        # driver closing the link stops the ranks at once.
        link.on_lost = lambda: supervisor.cancel("the Spark driver ended the run")
        try:
            results = supervisor.run()
        except Exception as error:
            report = (
                error.failures.get(rank, str(error))
                if isinstance(error, RanksFailedError)
                else f"{type(error).__name__}: {error}"
            )
            if link.failed(report):
                # The driver ends the run here and raises the ranks' errors itself: end the
                # task without failing it (Spark would log a Java stack for each failed task).
                yield rank, RUN_FAILED
                return
            if isinstance(error, RanksFailedError):  # Spark retries the stage
                raise RuntimeError(f"flyte-hvd rank {rank} failed:\n{error}") from None
            raise
        finally:
            for name, at in supervisor.timings().get(rank, {}).items():
                link.event(name, at)
            link.close()
        yield rank, results[rank]

    return task


def _task_result(link: DriverLink, path: str) -> bytes:
    """What a barrier task yields for its rank's pickled result, the file at ``path``: the
    pickle itself when small, else the id under which the driver keeps it, sent over
    ``link``."""
    if os.path.getsize(path) <= INLINE_RESULT_BYTES:
        with open(path, "rb") as f:
            return f.read()
    return RESULT_ON_LINK + link.send_result(path).encode()


def load_result(server: DriverServer, payload: bytes) -> UserValue:
    """On the driver: a rank's result from what its task yielded (see ``_task_result``)."""
    if not payload.startswith(RESULT_ON_LINK):
        return cloudpickle.loads(payload)
    path = server.result_path(payload[len(RESULT_ON_LINK) :].decode())
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    finally:
        os.remove(path)


def _worker_import_path(extra: str | None) -> str:
    """This Python worker's import path for the rank process: it includes what Spark added
    with ``addPyFile`` (e.g. the code a Flyte task was fast-registered with), which the
    worker's PYTHONPATH does not name, so the rank can import what the task's code imports.
    The interpreter's own folders are left out: the rank's interpreter finds them itself."""
    own = tuple(os.path.abspath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    paths = [p for p in (extra or "").split(os.pathsep) if p]
    for entry in sys.path:
        path = os.path.abspath(entry) if entry else ""
        if path and not path.startswith(own) and path not in paths and os.path.exists(path):
            paths.append(path)
    return os.pathsep.join(paths)


class _DriverExchange:
    """Rendezvous rounds through the driver link (authenticated by the run's secret), not
    ``BarrierTaskContext.allGather``, which costs a second a call (see ``driver_link``)."""

    def __init__(self, link: DriverLink):
        self._link = link
        self._rounds = 0
        self._aborted = threading.Event()

    def all_gather(self, rank: int, value: str) -> list[str]:
        round_, self._rounds = self._rounds, self._rounds + 1
        return self._link.all_gather(round_, value, self._aborted)

    def abort(self) -> None:
        self._aborted.set()


def get_available_devices() -> list[str]:
    """Inside a rank: the accelerator addresses Spark assigned to its task (e.g. ``['0']``);
    empty when none were assigned or outside Spark."""
    raw = os.environ.get(DEVICES_ENV, "")
    return [a for a in raw.split(",") if a]
