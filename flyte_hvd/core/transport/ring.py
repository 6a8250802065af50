"""Large reductions over MPI as a ring of our own, chunk by chunk, instead of MPICH's
``Allreduce`` (the MPI transport's route where ``takes`` says so).

The buffer is cut in one segment per rank. Each segment is passed to the right and reduced on
the way until one rank holds it reduced by every rank (``n - 1`` steps), then passed round
again whole. Segments move in chunks, and a chunk goes on as soon as it has arrived, so chunks
are reduced while later ones are on the wire; with two ranks that is an exchange of halves.
Every value is reduced on one rank only, so every rank ends with the same bits.

Measured against MPICH's ``Allreduce`` (out of place, medians of 5): between two simulated
hosts over TCP 1.0x at 1-4 MB, 1.2x at 16 MB, 1.8x at 64 MB, whichever of MPICH's algorithms
it ran (ring, reduce-scatter + allgather, recursive doubling); two ranks on one host over MPI
0.9x at 1 MB, 1.4x at 2 MB, 2.9x at 64 MB; three and four simulated hosts on two cores (ranks
sharing a core) 1.2-1.6x from 4 MB. In place a chunk's final values may land only once that
chunk has been sent, which waits longer.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

import numpy as np

from flyte_hvd.core import shm, timeline
from flyte_hvd.core.buffers import pool
from flyte_hvd.core.reduce_ops import ReduceOp, finish_average

if TYPE_CHECKING:
    from mpi4py import MPI

# Where the ring is faster than MPICH's Allreduce (simulated hosts over TCP, alternating):
# two ranks out of place from 1 MB, in place from 32 MB (MPICH's in-place exchange is faster
# below); more ranks out of place from 4 MB, in place from 8 MB.
_TWO_RANKS_BYTES = (1 << 20, 32 << 20)  # (out of place, in place)
_MORE_RANKS_BYTES = (4 << 20, 8 << 20)
_CHUNK_BYTES = 4 << 20
# The ring's point-to-point tags: from _TAG, fewer than _MAX_TAGS (below the agreement's
# records' tag, 0x5244, for up to 2,000 ranks).
_TAG, _MAX_TAGS = 0x100, 0x4000
# The order a rank waits for its transfers in: every rank the same, each transfer after the
# ones it depends on (a segment's stage s after stage s - 1 on the left neighbour, the whole
# segments after the reductions). MPICH's Waitany never yields the core: where ranks share
# one (more ranks than cores, a pod's CPU limit), a 1 MB ring took 9.3 ms against 0.9 ms.
_ORDER = {"arrived": 0, "sent": 1, "gathered": 2}


def reduces_alike(op: ReduceOp, arr: np.ndarray) -> bool:
    """Whether every rank can reduce ``op`` on ``arr`` itself with numpy (the ring, or the MPI
    transport over its records' data): the ops numpy has, on numbers that have an order where
    the op needs one."""
    return op in shm.UFUNCS and arr.dtype.kind in "fiu"


def takes(size: int, op: ReduceOp, wire: np.ndarray, out: np.ndarray, mpi_only: bool) -> bool:
    """Whether the ring takes a reduction of ``wire`` into ``out`` on ``size`` ranks: large
    enough, ``reduces_alike``, and not a later buffer of a reduction that ranks inside
    ``join()`` serve (``mpi_only``: their part is MPI's)."""
    if mpi_only or size < 2 or not reduces_alike(op, wire):
        return False
    out_of_place, in_place = _TWO_RANKS_BYTES if size == 2 else _MORE_RANKS_BYTES
    return wire.nbytes >= (in_place if out is wire else out_of_place)


def allreduce(
    comm: MPI.Comm, op: ReduceOp, wire: np.ndarray, out: np.ndarray, kind: str, name: str | None
) -> None:
    """``op`` over every rank's C-contiguous ``wire`` into ``out`` (``wire`` itself for in
    place), averaged for ``Average``, recorded in the timeline as ``kind``; every rank of
    ``comm`` calls it with the same shape and dtype, the ranks having agreed."""
    start = timeline.begin()
    reduce(comm, shm.UFUNCS[op], wire.reshape(-1), out.reshape(-1), out is wire)
    timeline.end(kind, name, out.nbytes, start)
    finish_average(out, comm.Get_size(), op)


def reduce(
    comm: MPI.Comm, ufunc: np.ufunc, src: np.ndarray, dst: np.ndarray, in_place: bool
) -> None:
    """``ufunc`` over every rank's 1-D ``src`` into ``dst`` (``src`` itself where ``in_place``)."""
    from mpi4py import MPI

    n, r = comm.Get_size(), comm.Get_rank()
    left, right = (r - 1) % n, (r + 1) % n
    count = src.size
    bounds = [count * k // n for k in range(n + 1)]
    # Chunks of at least _CHUNK_BYTES, few enough for every tag to stay in its range.
    step = max(1, _CHUNK_BYTES // src.itemsize, -(-count * 2 // _MAX_TAGS))
    chunks = [
        [(a, min(a + step, bounds[k + 1])) for a in range(bounds[k], bounds[k + 1], step)]
        for k in range(n)
    ]
    width = max(len(c) for c in chunks)

    def tag(gathering: bool, stage: int, c: int) -> int:
        return _TAG + ((n if gathering else 0) + stage) * width + c

    partial = pool.empty((count,), src.dtype)  # the segments passing through, part-reduced
    # The transfers to wait for, in _ORDER: (order, stage, chunk, n-th, request, segment, role).
    pending: list[tuple[int, int, int, int, MPI.Request, int, str]] = []
    posted = itertools.count()  # never compares two requests
    later = []

    def wait_for(request: MPI.Request, role: str, stage: int, k: int, c: int) -> None:
        heapq.heappush(pending, (_ORDER[role], stage, c, next(posted), request, k, role))

    def expect(into: np.ndarray, role: str, stage: int, k: int, c: int) -> None:
        a, b = chunks[k][c]
        wait_for(comm.Irecv(into[a:b], left, tag(role == "gathered", stage, c)), role, stage, k, c)

    for stage in range(n - 1):  # segment r - stage - 1 arrives part-reduced from the left
        for c in range(len(chunks[(r - stage - 1) % n])):
            expect(partial, "arrived", stage, (r - stage - 1) % n, c)
    if not in_place:  # then segment r - stage arrives whole; in place, once it may land
        for stage in range(n - 1):
            for c in range(len(chunks[(r - stage) % n])):
                expect(dst, "gathered", stage, (r - stage) % n, c)
    for c, (a, b) in enumerate(chunks[r]):
        wait_for(comm.Isend(src[a:b], right, tag(False, 0, c)), "sent", 0, r, c)
    while pending:
        _, stage, c, _, request, k, role = heapq.heappop(pending)
        request.Wait()
        a, b = chunks[k][c]
        if role == "arrived":
            whole = stage == n - 2  # this rank's own segment, reduced by every rank now
            into = dst if whole else partial
            ufunc(src[a:b], partial[a:b], out=into[a:b])
            later.append(comm.Isend(into[a:b], right, tag(whole, 0 if whole else stage + 1, c)))
            if in_place and not whole:
                expect(dst, "gathered", stage + 1, k, c)  # src[a:b] is read: it may land
        elif role == "sent" and in_place:
            expect(dst, "gathered", 0, k, c)
        elif role == "gathered" and stage < n - 2:
            later.append(comm.Isend(dst[a:b], right, tag(True, stage + 1, c)))
    MPI.Request.Waitall(later)
