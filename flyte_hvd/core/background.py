"""Collectives on a background thread: what the ``*_async`` ops, ``synchronize``/``poll`` and the
optimizers' gradient reduction during ``backward()`` stand on.

The thread runs on duplicates of the communicators (``state.async_comm()``, a process set's
``async_comm``). MPI matches collectives per communicator, so the calling thread can keep using
its own (metrics, broadcasts) while reductions are in flight; and since every rank submits in
the same order, the thread's collectives match across ranks.

    handle = background.submit(lambda comm: collectives.allreduce_on(comm, x), name="x")
    result = background.synchronize(handle)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from flyte_hvd.core import state
from flyte_hvd.core.errors import HorovodInternalError

if TYPE_CHECKING:
    from mpi4py import MPI

# What an operation's function returns (an array, a list or tuple of arrays), or what its
# ``finish`` makes of that on the waiting thread (a framework's tensor): each op its own.
Result: TypeAlias = Any


class Handle:
    """One submitted operation. ``wait()`` returns its result (passed through ``finish``, on
    the waiting thread) or raises its error; ``done()`` tells whether it has finished."""

    __slots__ = ("_done", "_error", "_finish", "_result", "name")

    def __init__(self, name: str | None = None, finish: Callable[[Result], Result] | None = None):
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Result = None
        self._finish = finish
        self.name = name

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Result:
        self._done.wait()
        if self._error is not None:
            raise self._error
        finish, self._finish = self._finish, None
        if finish is not None:
            self._result = finish(self._result)
        return self._result


class Engine:
    """Runs submitted ``fn(comm)`` calls one at a time, in submission order, on one thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._names: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="flyte-hvd-comm", daemon=True)
        self._thread.start()

    def submit(
        self,
        fn: Callable[[MPI.Comm], Result],
        comm: MPI.Comm,
        name: str | None = None,
        finish: Callable[[Result], Result] | None = None,
    ) -> Handle:
        """Queue ``fn(comm)``. A ``name`` still in flight on this rank is a ``ValueError``:
        the ranks could not tell the two operations apart."""
        handle = Handle(name, finish)
        if self._failed is not None:
            # A rank whose earlier collective failed must not start the next one: its peers
            # may be waiting in the failed one, and this one would never be matched.
            handle._error = HorovodInternalError(
                f"an earlier background collective failed on this rank ({self._failed!r}); "
                f"no further collectives run on it."
            )
            handle._done.set()
            return handle
        if name is not None:
            with self._lock:
                if name in self._names:
                    raise ValueError(
                        f"an operation named {name!r} is still in flight on this rank; "
                        f"synchronize() it first or give this one another `name`."
                    )
                self._names.add(name)
        self._queue.put((handle, fn, comm))
        return handle

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, fn, comm = item
            if self._failed is not None:
                handle._error = HorovodInternalError(
                    f"an earlier background collective failed on this rank "
                    f"({self._failed!r}); this one was not started."
                )
            else:
                try:
                    handle._result = fn(comm)
                except BaseException as error:
                    self._failed = error
                    handle._error = error
            if handle.name is not None:
                with self._lock:
                    self._names.discard(handle.name)
            handle._done.set()

    def drain(self) -> None:
        """Wait until everything submitted so far has run."""
        marker = Handle()
        self._queue.put((marker, lambda comm: None, None))
        marker._done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """The background thread, started on first use."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = Engine()
        return _engine


def submit(
    fn: Callable[[MPI.Comm], Result],
    comm: MPI.Comm,
    name: str | None = None,
    finish: Callable[[Result], Result] | None = None,
) -> Handle:
    """Run ``fn(comm)`` on the background thread; see ``Engine.submit``."""
    return engine().submit(fn, comm, name, finish)


def drain() -> None:
    """Wait for this rank's submitted operations (no-op when none were ever submitted)."""
    if _engine is not None:
        _engine.drain()


def synchronize(handle: Handle) -> Result:
    """Wait for an async op; returns its result (raises the error it failed with)."""
    if not isinstance(handle, Handle):
        raise ValueError(
            f"`synchronize` takes the handle an *_async op returned; found {type(handle).__name__}."
        )
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once the async op of ``handle`` has finished (``synchronize`` will not block)."""
    if not isinstance(handle, Handle):
        raise ValueError(
            f"`poll` takes the handle an *_async op returned; found {type(handle).__name__}."
        )
    return handle.done()


def stop() -> None:
    """Stop the background thread (``shutdown()``); waits for submitted work."""
    global _engine
    with _engine_lock:
        if _engine is not None:
            _engine.close()
            _engine = None


state.on_shutdown(stop, order=0)  # before process sets free the communicators it uses
