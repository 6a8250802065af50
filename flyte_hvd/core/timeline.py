"""Chrome-tracing timeline of collectives (``HOROVOD_TIMELINE=path`` or ``start_timeline``).

Each rank records its own events in memory; ``stop`` (collective, run by ``stop_timeline()``
and ``shutdown()``) gathers them on rank 0, which writes one JSON file that ``chrome://tracing``
and Perfetto open: one complete ("X") event per collective per rank, ``pid`` = rank. This module
depends on nothing else in core: the public ``start_timeline``/``stop_timeline`` in ``state``
pass it the rank and the communicator.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py import MPI

TIMELINE_ENV = "HOROVOD_TIMELINE"


class Timeline:
    def __init__(self, path: str, rank: int):
        self.path = path
        self.rank = rank
        self.events: list[dict[str, Any]] = []  # Chrome trace events: JSON values

    def record(self, kind: str, name: str | None, nbytes: int, start_ns: int) -> None:
        end_ns = time.time_ns()
        self.events.append(
            {
                "name": name or kind,
                "cat": kind,
                "ph": "X",
                "ts": start_ns / 1000.0,
                "dur": (end_ns - start_ns) / 1000.0,
                "pid": self.rank,
                "tid": 0,
                "args": {"bytes": int(nbytes)},
            }
        )


_active: Timeline | None = None


def current() -> Timeline | None:
    return _active


def begin() -> int:
    """The start of a collective for ``end``: 0 (no clock read) when nothing records."""
    return time.time_ns() if _active is not None else 0


def end(kind: str, name: str | None, nbytes: int, start_ns: int) -> None:
    """Record a collective that began at ``start_ns`` (``begin``), if a timeline records."""
    if _active is not None:
        _active.record(kind, name, nbytes, start_ns)


def start(file_path: str, rank: int) -> None:
    """Begin recording this rank's collectives into ``file_path`` (written by rank 0)."""
    global _active
    if not file_path:
        raise ValueError("`start_timeline` needs a file path; found an empty string.")
    parent = os.path.dirname(os.path.abspath(file_path))
    if not os.path.isdir(parent):
        raise ValueError(
            f"timeline path {file_path!r}: directory {parent!r} does not exist; create it first."
        )
    _active = Timeline(file_path, rank)


def start_from_env(rank: int) -> None:
    global _active
    path = os.environ.get(TIMELINE_ENV)
    # "DYNAMIC" is Horovod's "no file yet: start_timeline() will be called" setting.
    if path and path != "DYNAMIC" and _active is None:
        _active = Timeline(path, rank)


def stop(comm: MPI.Comm) -> None:
    """Stop recording and write the file on rank 0 (collective over ``comm``)."""
    global _active
    timeline, _active = _active, None
    if timeline is None:
        return
    all_events = comm.gather(timeline.events, root=0)
    if all_events is None:
        return
    trace: list[dict[str, Any]] = [  # JSON values
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
        for r in range(len(all_events))
    ]
    for events in all_events:
        trace.extend(events)
    tmp = f"{timeline.path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, timeline.path)
