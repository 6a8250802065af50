"""What a rank runs once it has joined: a cloudpickled function, or a Python program."""

from __future__ import annotations

import contextlib
import gc
import runpy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from flyte_hvd.core.types import UserValue


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
