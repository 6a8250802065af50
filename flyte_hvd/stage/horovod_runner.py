"""Databricks' ``HorovodRunner`` API on flyte-hvd's launchers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flyte_hvd.core.types import UserValue
from flyte_hvd.launch.job import FunctionJob
from flyte_hvd.launch.supervisor import launch_local
from flyte_hvd.stage.dispatch import active_session, run, task_slots


class HorovodRunner:
    """``HorovodRunner(np).run(main, **kwargs)`` returns rank 0's return value.

    Args:
        np: ``> 0``: ``np`` ranks as barrier tasks on the cluster of the active SparkSession.
            ``< 0``: ``-np`` rank processes on this machine, no Spark job (for development;
            the same bootstrap as ``flyte-hvd-run``). ``0``: one rank per free task slot.
        driver_log_verbosity: accepted for compatibility; ``"all"`` (default) shows every
            rank's output, ``"log_callback_only"`` only the launcher's messages.

    Example:
        >>> from flyte_hvd.spark import HorovodRunner
        >>> def main(lr):
        ...     import flyte_hvd.core as hvd
        ...     hvd.init()
        ...     return hvd.size() * lr
        >>> HorovodRunner(np=2).run(main, lr=0.1)  # doctest: +SKIP
        0.2
    """

    def __init__(self, np: int, driver_log_verbosity: str = "all", start_timeout: float = 600):
        if isinstance(np, bool) or not isinstance(np, int):
            raise ValueError(f"HorovodRunner `np` must be an int; found {np!r}.")
        if driver_log_verbosity not in ("all", "log_callback_only"):
            raise ValueError(
                f"`driver_log_verbosity` must be 'all' or 'log_callback_only'; "
                f"found {driver_log_verbosity!r}."
            )
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity
        self.start_timeout = start_timeout

    def run(
        self,
        main: Callable[..., UserValue],
        **kwargs: Any,  # ``main``'s keyword arguments
    ) -> UserValue:
        if self.num_processor < 0:
            return launch_local(
                FunctionJob(main, (), kwargs), -self.num_processor, self.start_timeout
            )[0]
        num_proc = self.num_processor or task_slots(active_session())
        return run(main, kwargs=kwargs, num_proc=num_proc, start_timeout=self.start_timeout)[0]
