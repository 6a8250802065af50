"""Reductions on a background thread, so that gradients are reduced while ``backward()`` is
still computing: what Horovod's ``*_async`` ops and ``synchronize(handle)`` stand on.

The thread owns a duplicate of the core's communicator. MPI matches collectives per
communicator, so the main thread can keep using the core's (metrics, broadcasts) while
reductions are in flight; and since every rank submits its reductions in the same order (the
optimizer submits its buckets in a fixed order), the thread's collectives match across ranks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from flyte_hvd.core import collectives, state
from flyte_hvd.core.collectives import ReduceOp
from flyte_hvd.core.compression import Compressor


class Handle:
    """One submitted operation: ``wait()`` returns its result or raises its error."""

    __slots__ = ("_done", "_error", "_result", "name")

    def __init__(self, name: str | None = None):
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None
        self.name = name

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class CommThread:
    """Runs submitted ``fn(comm)`` calls one at a time, in submission order."""

    def __init__(self, base_comm: Any):
        self.base = base_comm
        self.comm = base_comm.Dup()  # collective over base_comm: every rank creates one
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="flyte-hvd-comm", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Any], Any], name: str | None = None) -> Handle:
        handle = Handle(name)
        if self._failed is not None:
            # A rank whose earlier collective failed must not start the next one: its peers
            # may be waiting in the failed one, and this one would never be matched.
            handle._error = RuntimeError(
                f"an earlier background collective failed on this rank ({self._failed!r}); "
                f"no further collectives run on it."
            )
            handle._done.set()
            return handle
        self._queue.put((handle, fn))
        return handle

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, fn = item
            if self._failed is not None:
                handle._error = RuntimeError(
                    f"an earlier background collective failed on this rank "
                    f"({self._failed!r}); this one was not started."
                )
            else:
                try:
                    handle._result = fn(self.comm)
                except BaseException as error:
                    self._failed = error
                    handle._error = error
            handle._done.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)
        if not self._thread.is_alive() and self._failed is None:
            self.comm.Free()


_engine: CommThread | None = None
_engine_lock = threading.Lock()


def engine() -> CommThread:
    """The background thread for the current ``init()``; started on first use (collective)."""
    global _engine
    base = state.comm()
    with _engine_lock:
        if _engine is None or _engine.base is not base:
            if _engine is not None:
                _engine.close()
            _engine = CommThread(base)
        return _engine


def stop() -> None:
    """Stop the background thread (before ``shutdown()``); waits for submitted work."""
    global _engine
    with _engine_lock:
        if _engine is not None:
            _engine.close()
            _engine = None


def average_as_sum(op: ReduceOp, gradient_predivide_factor: float, size: int, floating: bool):
    """``(op, prescale, postscale)`` for a reduction, folding ``Average`` into the scale
    factors for floating data so no extra pass divides the result.

    Horovod's ``gradient_predivide_factor`` f divides by f before the sum and by size/f after.
    """
    if op is not ReduceOp.AVERAGE or not floating:
        return op, 1.0, 1.0
    f = gradient_predivide_factor
    if f == 1.0:
        return ReduceOp.SUM, 1.0 / size, 1.0
    return ReduceOp.SUM, 1.0 / f, f / size


def reduce_in_place(
    comm: Any,
    flat: np.ndarray,
    op: ReduceOp,
    compression: type[Compressor],
    postscale_factor: float,
    name: str | None,
    describe: Callable[[], str],
) -> None:
    """Reduce the 1-D ``flat`` across ranks in place, with one MPI call on ``comm``.

    Any prescaling has already been applied by the caller (folded into the copy that filled
    ``flat``). The ranks first compare (op, dtype, length, compression); ``describe`` renders
    this rank's call for the error raised on a mismatch.
    """
    op, mpi_op = collectives._mpi_op(op)
    collectives._check_same(
        comm,
        (8, op, flat.dtype.num, flat.shape, collectives._compression_id(compression)),
        describe,
    )
    wire, ctx = compression.compress(flat)
    wire = np.ascontiguousarray(wire)
    start = collectives._begin()
    comm.Allreduce(collectives._in_place(), wire, mpi_op)
    collectives._end("allreduce", name, wire.nbytes, start)
    collectives._finish_average(wire, comm.Get_size(), op)
    collectives._scale_in_place(wire, postscale_factor, "postscale_factor")
    if wire is not flat:
        flat[...] = compression.decompress(wire, ctx)
