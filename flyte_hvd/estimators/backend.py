"""The backend ``fit`` runs the ranks with: Horovod's ``Backend`` interface, and
``SparkBackend``, which runs them in a barrier stage of the active SparkSession."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from flyte_hvd.stage.dispatch import (
    active_session,
    check_slots,
    default_parallelism,
    horovod_run_args,
    launch,
    start_spares,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# Horovod's `run` arguments a SparkBackend passes on (`horovod.spark.common.backend`).
_RUN_ARGS = frozenset(
    {
        "start_timeout",
        "use_mpi",
        "use_gloo",
        "extra_mpi_args",
        "stdout",
        "stderr",
        "verbose",
        "nics",
        "prefix_output_with_timestamp",
        "executable",
    }
)


class Backend(Protocol):
    """What ``fit`` needs of a backend (Horovod's ``horovod.spark.common.backend.Backend``):
    ``SparkBackend`` or a user's own."""

    def num_processes(self) -> int: ...

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        env: dict[str, str] | None = None,
    ) -> list[Any]: ...


class SparkBackend:
    """Runs the training function on ``num_proc`` ranks of the active SparkSession: Horovod's
    ``SparkBackend(num_proc=None, env=None, **kwargs)``.

    Args:
        num_proc: ranks; defaults to the session's default parallelism.
        env: environment of the ranks; by default the driver's as it is at ``fit``
            (see ``flyte_hvd.spark.run``).
        **kwargs: ``flyte_hvd.spark.run``'s arguments: ``start_timeout``, ``stdout``,
            ``stderr``, ``verbose``, ``prefix_output_with_timestamp``, ``nics``, and
            Horovod's ``use_mpi``, ``use_gloo``, ``extra_mpi_args``, ``executable``
            (accepted; each says once that it does nothing here).
    """

    def __init__(
        self,
        num_proc: int | None = None,
        env: dict[str, str] | None = None,
        preload: tuple[str, ...] = (),
        **kwargs: Any,  # ``flyte_hvd.spark.run``'s arguments, passed on
    ):
        unknown = sorted(set(kwargs) - _RUN_ARGS)
        if unknown:
            raise ValueError(
                f"SparkBackend got unknown argument(s) {unknown}; it takes `num_proc`, `env` "
                f"and `flyte_hvd.spark.run`'s arguments: {sorted(_RUN_ARGS)}."
            )
        self._num_proc = num_proc
        self._env = dict(env) if env is not None else None
        self.preload = preload
        self._kwargs = kwargs
        self._verbose = kwargs.get("verbose", 1)

    def num_processes(self) -> int:
        if self._num_proc is None:
            return default_parallelism(active_session())
        return self._num_proc

    def check_slots(self) -> None:
        """The cluster has a task slot per rank (``flyte_hvd.stage.dispatch.check_slots``)."""
        check_slots(self.num_processes(), self._kwargs.get("start_timeout"))

    def start_spares(self, data: bool = False) -> None:
        """Rank processes import the framework while ``prepare_data`` runs, or, with
        ``data``, while Spark computes the DataFrame a streamed fit's ranks receive
        (``flyte_hvd.stage.dispatch.start_spares``)."""
        start_spares(self.num_processes(), self._env, self.preload, data)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        env: dict[str, str] | None = None,
        data: DataFrame | None = None,
    ) -> list[Any]:
        """Runs ``fn`` on the ranks; ``env`` adds to the backend's environment; ``data``, a
        DataFrame whose partitions the ranks receive (``flyte_hvd.spark.run``'s)."""
        full_env = {**self._env, **(env or {})} if self._env is not None else (env or None)
        options = dict(self._kwargs)
        full_env = horovod_run_args(
            full_env,
            *(
                options.pop(k, None)
                for k in ("use_mpi", "use_gloo", "extra_mpi_args", "nics", "executable")
            ),
        )
        return launch(
            fn,
            args,
            kwargs,
            num_proc=self.num_processes(),
            env=full_env,
            preload=self.preload,
            data=data,
            **options,
        ).results
