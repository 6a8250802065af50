"""The MPI transport: every collective of a communicator through mpi4py's buffer methods
(arrays never pickled), and the base the other transports fall back to."""

from __future__ import annotations

import concurrent.futures
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flyte_hvd.core import agreement, shm, state, timeline
from flyte_hvd.core.agreement import ABSENT, Agreement, Reduction
from flyte_hvd.core.buffers import pool
from flyte_hvd.core.reduce_ops import ReduceOp, finish_average, mpi_ops

if TYPE_CHECKING:
    from mpi4py import MPI

# From here a reduction into a separate output copies first and reduces in place: measured
# faster than MPICH's out-of-place path.
_IN_PLACE_BYTES = 8 << 20
# From here a broadcast's root copies its values into the output on a thread of its own
# while they are sent (numpy and MPI both release the GIL); below, the thread costs more.
_OVERLAPPED_COPY_BYTES = 4 << 20


@functools.cache
def _copier() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flyte-hvd-copy")


def _mpi():
    from mpi4py import MPI

    return MPI


def mpi_type(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype of a numpy dtype."""
    return _mpi()._typedict[dtype.char]


def displacements(counts: np.ndarray) -> np.ndarray:
    """Where each of ``counts`` starts when laid end to end."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


class MpiTransport:
    """How the collectives of ``comm`` move their data: here all over MPI.

    Every method takes what the collective API has checked and laid out (C-contiguous
    buffers, the fields the ranks agree on and how the call reads in an error) and records
    the transfer in the timeline.
    """

    # Whether ``reduce`` takes a fusion buffer's parts (``shm.Pieces``) instead of the packed
    # buffer; this one packs them itself.
    takes_pieces = False

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.size = comm.Get_size()

    # -- agreement ---------------------------------------------------------------------------

    def exchange(self, pair: tuple[int, int], describe: Callable[[], str]) -> tuple[int, int]:
        """The elementwise max of every rank's ``pair``: the agreement's one reduction."""
        MPI = _mpi()
        buf = np.array(pair, dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, buf, MPI.MAX)
        return int(buf[0]), int(buf[1])

    def check_same(
        self, fields: tuple, describe: Callable[[], str], reduction: Reduction = None
    ) -> None:
        """Agree with the other ranks before a collective (``agreement``'s protocol): raises
        ``CollectiveMismatchError`` on every rank if any rank's ``fields`` differ; with joined
        ranks, a collective with a ``reduction`` goes on and any other raises."""
        if self.size == 1 or not state.checks_collectives():
            return
        fp = agreement.fingerprint(fields)
        agreement.settle(self.comm, fp, self.exchange((fp, -fp), describe), describe, reduction)

    def serve_joined(self) -> int:
        """A joined rank's part in the others' collectives until every rank has joined;
        returns how many reductions it served."""
        served = 0
        while True:
            if self.exchange((ABSENT, 1), lambda: "join()")[0] == ABSENT:  # no rank is active
                return served
            served += agreement.serve_joined_round(self.comm)

    # -- reductions --------------------------------------------------------------------------

    def allreduce_small(self, arr: np.ndarray, op: int, name: str | None) -> np.ndarray | None:
        """A small allreduce by a shortcut of this transport, or None (none here: the general
        path runs)."""
        return None

    def reduce(
        self,
        agreed: Agreement | None,
        op: ReduceOp,
        wire: np.ndarray | shm.Pieces,
        out: np.ndarray,
        kind: str,
        name: str | None,
        mpi_only: bool = False,
    ) -> bool:
        """Reduce the C-contiguous ``wire`` of every rank into ``out`` (``wire`` itself for in
        place), averaged for ``Average``, once the ranks agree (``agreed``; None: they already
        did). ``wire`` may be a fusion buffer's parts where ``takes_pieces``; ``out`` is then
        packed from them. Returns whether another route than MPI carried it (``mpi_only``
        forbids that: later buffers of a reduction whose first one went over MPI)."""
        if agreed is not None:
            self.check_same(*agreed)
        self.reduce_agreed(op, wire, out, kind, name)
        return False

    def reduce_agreed(
        self,
        op: ReduceOp,
        wire: np.ndarray | shm.Pieces,
        out: np.ndarray,
        kind: str,
        name: str | None,
    ) -> None:
        """``reduce`` over MPI, the ranks having agreed."""
        if not isinstance(wire, np.ndarray):  # a fusion buffer's parts: pack them
            shm.fill_pieces(wire, out.reshape(-1).view(np.uint8), 0, out.nbytes)
            wire = out
        mop = mpi_ops()[op]
        start = timeline.begin()
        if out is wire:
            self.comm.Allreduce(_mpi().IN_PLACE, out, mop)
        elif out.nbytes >= _IN_PLACE_BYTES:
            np.copyto(out, wire)
            self.comm.Allreduce(_mpi().IN_PLACE, out, mop)
        else:
            self.comm.Allreduce(wire, out, mop)
        timeline.end(kind, name, out.nbytes, start)
        finish_average(out, self.size, op)

    def reducescatter(
        self, arr: np.ndarray, rows: np.ndarray, op: ReduceOp, name: str | None
    ) -> np.ndarray:
        """Rank r's ``rows[r]`` rows of the sum of every rank's ``arr`` (agreed already)."""
        row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
        out = np.empty((int(rows[self.comm.Get_rank()]), *arr.shape[1:]), dtype=arr.dtype)
        start = timeline.begin()
        self.comm.Reduce_scatter(arr, out, recvcounts=(rows * row_items).tolist(), op=mpi_ops()[op])
        timeline.end("reducescatter", name, out.nbytes, start)
        return out

    # -- moving rows -------------------------------------------------------------------------

    def allgather(
        self, arr: np.ndarray, fields: tuple, describe: Callable[[], str], name: str | None
    ) -> np.ndarray:
        """Every rank's rows of the C-contiguous ``arr`` (at least 1-D), in rank order."""
        rows = self._agree_rows(arr.shape[0], fields, describe)
        comm = self.comm
        if rows is None:  # no agreement to carry them: the counts are exchanged
            rows = np.empty(self.size, dtype=np.int64)
            comm.Allgather(np.array([arr.shape[0]], dtype=np.int64), rows)
        out = pool.empty((int(rows.sum()), *arr.shape[1:]), arr.dtype)
        start = timeline.begin()
        dtype = mpi_type(arr.dtype)
        if (rows == rows[0]).all():
            # Equal parts (the common case): MPICH's Allgatherv over TCP took twice Allgather's
            # time from 1 MB (2 ranks on 2 hosts: 16 MB 18.3-18.6 ms against 9.5-11.1 ms).
            comm.Allgather([arr, dtype], [out, dtype])
        else:
            counts = rows * math.prod(arr.shape[1:])
            comm.Allgatherv(arr, [out, counts, displacements(counts), dtype])
        timeline.end("allgather", name, out.nbytes, start)
        return out

    def _agree_rows(
        self, count: int, fields: tuple, describe: Callable[[], str]
    ) -> np.ndarray | None:
        """Every rank's row count, learnt in the agreement's round: the fingerprint carries
        this rank's count, so when all agree (equal counts, the common case) nothing more
        travels before the data; ragged counts cost the round that tells them apart from a
        real mismatch. None where there is no agreement (size 1 or the check off)."""
        if self.size == 1 or not state.checks_collectives():
            return None
        fp = agreement.fingerprint((*fields, count))
        agreed = self.exchange((fp, -fp), describe)
        if agreed == (fp, -fp):
            return np.full(self.size, count, dtype=np.int64)
        if agreed[1] > 0:  # ranks inside join(): raises on every rank
            agreement.settle(self.comm, fp, agreed, describe, None)
        entries = self.comm.allgather((agreement.fingerprint(fields), count))
        if len({fingerprint for fingerprint, _ in entries}) > 1:
            agreement.raise_mismatch(self.comm.allgather(describe()))
        return np.array([rows for _, rows in entries], dtype=np.int64)

    def broadcast(
        self,
        buf: np.ndarray,
        root: int,
        fields: tuple,
        describe: Callable[[], str],
        name: str | None,
        source: np.ndarray | None = None,
    ) -> None:
        """``root``'s C-contiguous ``buf`` into every rank's ``buf``; at the root, ``source``
        (when given: the same shape and dtype) is what is sent, and ``buf`` gets a copy."""
        self.check_same(fields, describe)
        start = timeline.begin()
        if source is None:
            self.comm.Bcast(buf, root=root)
        elif source.nbytes < _OVERLAPPED_COPY_BYTES or not source.flags.c_contiguous:
            np.copyto(buf, source)
            self.comm.Bcast(buf, root=root)
        else:
            # The root's copy runs while MPI sends from `source` (both only read it): between
            # hosts a 64 MB copy took as long as half the transfer, one after the other.
            copying = _copier().submit(np.copyto, buf, source)
            try:
                self.comm.Bcast(source, root=root)
            finally:
                copying.result()
        timeline.end("broadcast", name, buf.nbytes, start)

    def alltoall(
        self, arr: np.ndarray, send_rows: np.ndarray, name: str | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``send_rows[i]`` rows of ``arr`` to rank i (agreed already); the rows received,
        in rank order, and how many came from each rank."""
        comm = self.comm
        recv_rows = np.empty(self.size, dtype=np.int64)
        comm.Alltoall(send_rows, recv_rows)
        row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
        out = np.empty((int(recv_rows.sum()), *arr.shape[1:]), dtype=arr.dtype)
        send_counts, recv_counts = send_rows * row_items, recv_rows * row_items
        dtype = mpi_type(arr.dtype)
        start = timeline.begin()
        comm.Alltoallv(
            [arr, send_counts, displacements(send_counts), dtype],
            [out, recv_counts, displacements(recv_counts), dtype],
        )
        timeline.end("alltoall", name, out.nbytes, start)
        return out, recv_rows

    def barrier(self) -> None:
        self.check_same((8,), lambda: "barrier()")
        start = timeline.begin()
        self.comm.Barrier()
        timeline.end("barrier", None, 0, start)
