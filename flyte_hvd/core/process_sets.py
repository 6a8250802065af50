"""Process sets: collectives among a subset of the ranks, on an MPI sub-communicator.

    evens = hvd.add_process_set([0, 2])        # collective: every rank calls it, in order
    if evens.included():
        hvd.allreduce(x, process_set=evens)     # only ranks 0 and 2 take part
    hvd.remove_process_set(evens)               # collective again

Ranks are always global ranks (``root_rank`` of a broadcast too); ``ProcessSet.rank()`` is this
process's position inside the set. ``global_process_set`` is every rank, the default of every
collective's ``process_set=`` argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from flyte_hvd.core import state, transport

if TYPE_CHECKING:
    from mpi4py import MPI


class ProcessSet:
    """An ordered set of global ranks that run collectives among themselves.

    Built unregistered from a list of ranks; ``add_process_set`` gives it its communicators.
    """

    def __init__(self, ranks: Sequence[int] | None):
        self._ranks = None if ranks is None else _checked_ranks(ranks)
        self.comm: MPI.Comm | None = None  # collectives of the calling thread
        self.async_comm: MPI.Comm | None = (
            None  # collectives of the background thread (``*_async``)
        )
        self.process_set_id: int | None = None

    @property
    def ranks(self) -> list[int]:
        """The global ranks in the set, ascending."""
        if self._ranks is None:
            return list(range(state.size()))
        return list(self._ranks)

    def size(self) -> int:
        return state.size() if self._ranks is None else len(self._ranks)

    def rank(self) -> int:
        """This process's position in the set, or -1 if it is not a member."""
        if self._ranks is None:
            return state.rank()
        me = state.rank()
        return self._ranks.index(me) if me in self._ranks else -1

    def included(self) -> bool:
        """Whether this process is a member of the set."""
        return self._ranks is None or state.rank() in self._ranks

    def __repr__(self) -> str:
        which = "global" if self._ranks is None else self._ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={which})"


global_process_set = ProcessSet(None)
global_process_set.process_set_id = 0
_registered: list[ProcessSet] = []


def _checked_ranks(ranks: Sequence[int]) -> list[int]:
    try:
        out = sorted(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise ValueError(
            f"a process set takes a list of global ranks (ints); found {ranks!r}."
        ) from None
    if not out or len(set(out)) != len(out) or any(r < 0 for r in out):
        raise ValueError(
            f"a process set needs distinct non-negative ranks, at least one; found {list(ranks)!r}."
        )
    return out


def comm_of(process_set: ProcessSet) -> MPI.Comm:
    """The communicator a collective on ``process_set`` runs on (this thread's)."""
    if process_set is global_process_set:
        return state.comm()
    return _member_comm(process_set, "comm")


def async_comm_of(process_set: ProcessSet) -> MPI.Comm:
    """The communicator the background thread uses for ``process_set``."""
    if process_set is global_process_set:
        return state.async_comm()
    return _member_comm(process_set, "async_comm")


def _member_comm(process_set: object, which: str) -> MPI.Comm:
    if not isinstance(process_set, ProcessSet):
        raise ValueError(
            f"`process_set` must be a hvd.ProcessSet (hvd.global_process_set or one from "
            f"hvd.add_process_set); found {type(process_set).__name__}."
        )
    state.comm()  # the init() error first
    if process_set.process_set_id is None:
        raise ValueError(
            f"{process_set!r} is not registered: pass it to hvd.add_process_set() on every rank "
            f"first (or it was removed)."
        )
    comm = getattr(process_set, which)
    if comm is None:
        raise ValueError(
            f"rank {state.rank()} is not in {process_set!r}; only its members may call "
            f"collectives on it (check `process_set.included()`)."
        )
    return comm


def translate_root(process_set: ProcessSet, root_rank: int) -> int:
    """``root_rank`` (a global rank) as a rank of ``process_set``'s communicator."""
    if process_set is global_process_set:
        return root_rank
    ranks = process_set.ranks
    if root_rank not in ranks:
        raise ValueError(
            f"root_rank={root_rank} is not in {process_set!r}; pass the global rank of a member."
        )
    return ranks.index(root_rank)


def registered() -> list[ProcessSet]:
    """The process sets registered now (not the global one)."""
    return list(_registered)


def register(ps: ProcessSet) -> None:
    """Give ``ps`` the next id and remember it (``collectives.add_process_set``)."""
    ps.process_set_id = max([0, *(p.process_set_id or 0 for p in _registered)]) + 1
    _registered.append(ps)


def unregister(ps: ProcessSet) -> bool:
    """Forget ``ps``; returns whether it was registered."""
    if ps not in _registered:
        return False
    _registered.remove(ps)
    return True


def free(ps: ProcessSet) -> None:
    for comm in (ps.async_comm, ps.comm):
        if comm is not None:
            transport.forget(comm)
            comm.Free()
    ps.comm = ps.async_comm = None
    ps.process_set_id = None


def release_all() -> None:
    """Forget every registered set (``shutdown()``); their communicators are freed."""
    while _registered:
        free(_registered.pop())


state.on_shutdown(release_all, order=1)  # after the background thread stopped (order 0)
