"""What a rank runs once it has joined: a cloudpickled function, or a Python program."""

from __future__ import annotations

import contextlib
import gc
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import cloudpickle

from flyte_hvd.core.types import UserValue

# The largest pickled return value a rank may hand back, in bytes (Spark runs set it for their
# ranks; elsewhere it applies when set).
MAX_RESULT_ENV = "FLYTE_HVD_MAX_RESULT_BYTES"
DEFAULT_MAX_RESULT_BYTES = 2 << 30


class ResultError(Exception):
    """A rank's return value cannot go back to the launcher; the message says why and what to
    do, and is the rank's whole report (no traceback: the user's code did nothing wrong)."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a rank imports its framework, and what
    the imports made frozen afterwards (``gc.freeze``: never examined again).

    Importing Keras and TensorFlow makes about half a million tracked objects, and the
    collector's full passes over them during the imports took a quarter of the import
    (measured: 2.5 -> 1.85 CPU s per rank); every full pass of the training that follows
    walked them again. Modules, classes and functions live as long as the process; the
    imports leave a few thousand cyclic garbage objects, which stay."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@dataclass
class FunctionJob:
    """``fn(*args, **kwargs)``; its return value goes back to the launcher."""

    fn: Callable[..., UserValue]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)  # the user's arguments to ``fn``

    def run(self) -> UserValue:
        return self.fn(*self.args, **self.kwargs)


@dataclass
class ProgramJob:
    """A Python program given as ``python``'s arguments: ``script.py ...``, ``-m mod ...``
    or ``-c code ...``. It runs in the rank process itself, so ``hvd.init()`` finds the
    communicator the rank joined."""

    argv: list[str]

    @classmethod
    def from_command(cls, command: list[str]) -> ProgramJob:
        """Accept ``python ...`` (any interpreter name starting with ``python``) or the
        arguments alone; anything else cannot share the rank's communicator."""
        if not command:
            raise ValueError("no program given: expected e.g. `python train.py --epochs 3`.")
        first = command[0].rsplit("/", 1)[-1]
        args = command[1:] if first.startswith("python") else command
        if not args or not (args[0].endswith(".py") or args[0] in ("-m", "-c")):
            raise ValueError(
                f"cannot run {' '.join(command)!r} as a rank: expected a Python program, "
                f"`python script.py ...`, `python -m module ...` or `python -c code ...`."
            )
        if args[0] in ("-m", "-c") and len(args) < 2:
            raise ValueError(f"`python {args[0]}` needs an argument after it.")
        return cls(list(args))

    def run(self) -> None:
        args = self.argv
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
        return None


class Job(Protocol):
    """What a supervisor runs on each rank (``FunctionJob``, ``ProgramJob``, or a launcher's
    own wrapper around them): it travels pickled and is run once."""

    def run(self) -> UserValue: ...


def write_result(result: UserValue, path: str, rank: int, limit: int | None) -> None:
    """Pickles ``result`` into ``path`` (atomically). Raises ``ResultError`` when it cannot be
    pickled, or when its pickle is larger than ``limit`` bytes: then nothing is written past
    the limit, and the pickle is only counted to name its size."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            counted = _CountingFile(f, limit)
            try:
                cloudpickle.dump(result, counted)
            except Exception as error:
                raise ResultError(
                    f"rank {rank}'s return value (type {type(result).__qualname__}) cannot be "
                    f"pickled: {type(error).__name__}: {error}. Return something picklable "
                    f"(or write it to a file and return the path)."
                ) from None
        if limit is not None and counted.size > limit:
            raise ResultError(
                f"rank {rank}'s return value is {_size(counted.size)} pickled, above the "
                f"limit of {_size(limit)} ({MAX_RESULT_ENV}). Write large results to a file "
                f"or the Store and return the path instead, or raise {MAX_RESULT_ENV}."
            )
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


class _CountingFile:
    """A file that counts what is written, and writes nothing once ``limit`` is passed."""

    def __init__(self, f: IO[bytes], limit: int | None):
        self._f, self._limit, self.size = f, limit, 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        n = memoryview(data).nbytes
        self.size += n
        if self._limit is None or self.size <= self._limit:
            self._f.write(data)
        return n


def result_limit(env: dict[str, str] | os._Environ[str]) -> int | None:
    """The limit ``MAX_RESULT_ENV`` sets in ``env`` (None when unset); raises ``ValueError``
    for anything but a positive whole number of bytes."""
    raw = env.get(MAX_RESULT_ENV)
    if raw is None or raw == "":
        return None
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ValueError(
            f"{MAX_RESULT_ENV} must be a positive whole number of bytes (e.g. "
            f"{DEFAULT_MAX_RESULT_BYTES} for 2 GiB); found {raw!r}."
        )
    return limit


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"
