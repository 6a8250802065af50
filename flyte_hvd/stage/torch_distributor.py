"""pyspark's ``TorchDistributor`` on flyte-hvd's launchers: a script written for
``pyspark.ml.torch.distributor.TorchDistributor`` runs with one import changed.

Each process is a flyte-hvd rank: it has ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``... (``flyte_hvd.launch.torch_env``), so
``torch.distributed.init_process_group()`` finds its peers, and the run keeps flyte-hvd's
guarantees: bad arguments and a cluster too small fail before any rank starts, a rank that
fails or stalls ends the run with an error naming it, and no rank process outlives ``run``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flyte_hvd.core.log import get_logger
from flyte_hvd.core.types import UserValue
from flyte_hvd.launch.environment import driver_env
from flyte_hvd.launch.job import FunctionJob, ProgramJob
from flyte_hvd.launch.supervisor import launch_local
from flyte_hvd.launch.torch_env import NODE_PER_RANK_ENV
from flyte_hvd.stage import dispatch

logger = get_logger(__name__)

# As HorovodRunner(np<0): seconds for the driver's rank processes to start and join.
_LOCAL_START_TIMEOUT = 600.0
_GPU_KEY = "spark.task.resource.gpu.amount"
_DRIVER_GPU_KEY = "spark.driver.resource.gpu.amount"


@dataclass
class _TorchJob:
    """What each rank runs: a function, or a script as ``python script args...``; with
    ``hide_gpus`` the rank sees no GPU (pyspark's ``use_gpu=False``), whatever Spark
    assigned to its task."""

    fn: Callable[..., Any] | None = None
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    hide_gpus: bool = False

    def run(self) -> UserValue:
        if self.hide_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if self.fn is None:
            return ProgramJob(self.argv).run()
        return FunctionJob(self.fn, self.args, self.kwargs).run()


class TorchDistributor:
    """Runs PyTorch training on ``num_processes`` ranks, as pyspark's ``TorchDistributor``.

    Args:
        num_processes: how many processes (ranks) train.
        local_mode: True: the processes run on the driver (no Spark job; an active
            SparkSession is needed only for ``use_gpu``). False: one process per task of a
            Spark barrier stage on the active SparkSession (classic or Spark Connect); each
            is then a node of its own, as under pyspark (``LOCAL_RANK=0``,
            ``NODE_RANK=RANK``).
        use_gpu: train on GPUs: with ``local_mode`` the driver's
            (``spark.driver.resource.gpu.amount``), else one per task
            (``spark.task.resource.gpu.amount=1``). False hides every GPU from the
            processes (``CUDA_VISIBLE_DEVICES=""``): use the ``gloo`` backend.

    Raises:
        ValueError: an argument is wrong.
        RuntimeError: ``use_gpu`` but Spark has no GPUs to give.

    Example:
        >>> from flyte_hvd.spark import TorchDistributor
        >>> def train(lr):
        ...     import torch.distributed as dist
        ...     dist.init_process_group("gloo")
        ...     rank = dist.get_rank()
        ...     dist.destroy_process_group()
        ...     return rank, lr
        >>> TorchDistributor(2, local_mode=True, use_gpu=False).run(train, 0.1)  # doctest: +SKIP
        (0, 0.1)
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True):
        if isinstance(num_processes, bool) or not isinstance(num_processes, int):
            raise ValueError(f"`num_processes` must be an int >= 1; found {num_processes!r}.")
        if num_processes < 1:
            raise ValueError(f"`num_processes` must be >= 1; found {num_processes}.")
        for name, value in (("local_mode", local_mode), ("use_gpu", use_gpu)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False; found {value!r}.")
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        # The driver's GPUs each process may use (local mode): checked now, before any run.
        self._driver_gpus: list[str] = []
        if use_gpu and local_mode:
            self._driver_gpus = _driver_gpus()
            if num_processes > len(self._driver_gpus):
                logger.warning(
                    "`num_processes`=%d but the driver has %d GPU(s) (%s): running %d "
                    "processes, one per GPU, as pyspark's TorchDistributor does",
                    num_processes,
                    len(self._driver_gpus),
                    _DRIVER_GPU_KEY,
                    len(self._driver_gpus),
                )
                self.num_processes = len(self._driver_gpus)
        elif use_gpu:
            _check_task_gpus()

    def run(
        self, train_object: Callable[..., Any] | str, *args: UserValue, **kwargs: UserValue
    ) -> UserValue:
        """Runs ``train_object`` on every process.

        Args:
            train_object: a function, which runs as ``train_object(*args, **kwargs)``; or the
                path of a Python script, which runs as ``python train_object args...`` (each
                argument as ``str``; no ``kwargs``). With ``local_mode=False`` the script must
                exist at that path on every executor.
            *args: the function's positional arguments, or the script's arguments.
            **kwargs: the function's keyword arguments.

        Returns:
            The function's return value on rank 0; None for a script.

        Raises:
            RanksFailedError: a process raised, died or stalled; the message names its rank
                and carries its traceback.
        """
        job = self._job(train_object, args, kwargs)
        if self.local_mode:
            env = {"CUDA_VISIBLE_DEVICES": ",".join(self._driver_gpus)} if self.use_gpu else {}
            return launch_local(job, self.num_processes, _LOCAL_START_TIMEOUT, env=env)[0]
        try:
            report = dispatch.launch(
                job.run,
                num_proc=self.num_processes,
                env={**driver_env(), NODE_PER_RANK_ENV: "1"},
                preload=("torch",),
            )
        except RuntimeError as error:  # the pipeline's slot check names its own argument
            if str(error).startswith("`num_proc`="):
                raise RuntimeError(str(error).replace("`num_proc`", "`num_processes`")) from None
            raise
        return report.results[0]

    def _job(self, train_object: object, args: tuple, kwargs: dict[str, Any]) -> _TorchJob:
        hide = not self.use_gpu
        if callable(train_object):
            return _TorchJob(fn=train_object, args=args, kwargs=kwargs, hide_gpus=hide)
        if not isinstance(train_object, str):
            raise ValueError(
                f"`train_object` must be a function or the path of a Python script; found "
                f"{type(train_object).__name__}."
            )
        if kwargs:
            raise ValueError(
                f"a script takes its arguments as strings, not keyword arguments; found "
                f"{sorted(kwargs)}. Pass them as `run(path, '--name=value', ...)`."
            )
        if self.local_mode and not os.path.isfile(train_object):
            raise ValueError(
                f"`train_object` {train_object!r} is not a file on the driver, where "
                f"`local_mode=True` runs it; pass the script's path (or a function)."
            )
        return _TorchJob(argv=[train_object, *map(str, args)], hide_gpus=hide)


def _driver_gpus() -> list[str]:
    """The GPU addresses Spark gave the driver (``SparkContext.resources``), as pyspark's
    local mode uses them."""
    try:
        resources = dispatch.active_session().sparkContext.resources
    except Exception:  # no session, or a Spark Connect one (no SparkContext)
        resources = {}
    gpus = resources.get("gpu")
    if gpus is None or not gpus.addresses:
        raise RuntimeError(
            "`use_gpu=True` with `local_mode=True` trains on the driver's GPUs, but the "
            f"active SparkSession has none (set {_DRIVER_GPU_KEY} and "
            "spark.driver.resource.gpu.discoveryScript). To train on CPUs, pass "
            "`use_gpu=False` and use the `gloo` backend "
            '(`torch.distributed.init_process_group("gloo")`); `nccl` needs GPUs.'
        )
    return list(gpus.addresses)


def _check_task_gpus() -> None:
    """``use_gpu`` on the cluster: one GPU per Spark task, as each task runs one process."""
    raw = dispatch.active_session().conf.get(_GPU_KEY, None) or "0"
    try:
        amount = float(raw)
    except ValueError:
        amount = 0.0
    if amount < 1:
        raise RuntimeError(
            f"`use_gpu=True` gives each process its Spark task's GPU, but {_GPU_KEY} is "
            f"{raw}: set {_GPU_KEY}=1 (and executors with GPUs), or pass `use_gpu=False` and "
            'use the `gloo` backend (`torch.distributed.init_process_group("gloo")`); '
            "`nccl` needs GPUs."
        )
    if amount != 1:
        raise ValueError(
            f"{_GPU_KEY}={raw}: flyte-hvd runs one process per Spark task, so each task "
            f"needs one GPU; set {_GPU_KEY}=1 (`num_processes` then counts tasks)."
        )
