"""The MPI transport: every collective of a communicator through mpi4py's buffer methods
(arrays never pickled), and the base the other transports fall back to.

The ranks' agreement (``agreement.py``) goes over MPI as one round of records
(``records.py``): every rank sees every record, so every rank reaches the same verdict: a
mismatch or joined ranks as before; agreed and every rank's data in its record, the
collective is done here (an allreduce reduced locally in rank order, an allgather
concatenated, a broadcast copied from the root's record; between two ranks the other's part of
an allgather, and the root's values for a new broadcast array, come straight into the output):
one round between hosts instead of two; agreed otherwise, the data goes next. Every agreement
round on a communicator is this one round, joined ranks' too, so the rounds always match.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flyte_hvd.core import agreement, shm, state, timeline
from flyte_hvd.core.agreement import (
    ABSENT,
    Agreement,
    Reduction,
    allgather_call,
    broadcast_call,
)
from flyte_hvd.core.buffers import MIN_POOLED_BYTES, pool
from flyte_hvd.core.reduce_ops import ReduceOp, finish_average, known_op, mpi_ops
from flyte_hvd.core.transport import ring
from flyte_hvd.core.transport.records import Records

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


_MAX_PLANS = 256  # kinds of small allreduce, allgather and broadcast kept per transport
# The first item of a small allgather's and broadcast's plans' keys (an allreduce's is its op).
_ALLGATHER, _BROADCAST = "allgather", "broadcast"


def _reduce_parts(ufunc: np.ufunc, parts: np.ndarray | list[np.ndarray], out: np.ndarray) -> None:
    """Every rank's data (``parts``: one row per rank) reduced in rank order into ``out``, so
    every rank gets the same bits."""
    flat = out.reshape(-1)
    if len(parts) == 2:
        ufunc(parts[0], parts[1], out=flat)  # 1.6 us where ``reduce`` takes 2.6
    elif isinstance(parts, np.ndarray):
        ufunc.reduce(parts, axis=0, out=flat)
    else:  # the same order as ``reduce`` along the ranks
        # In place, this rank's part (sent from the caller's array) is ``out`` itself: a part
        # read after ``out`` is first written is copied before.
        later = [p.copy() if np.may_share_memory(p, flat) else p for p in parts[2:]]
        ufunc(parts[0], parts[1], out=flat)
        for part in later:
            ufunc(flat, part, out=flat)


def _rows_joined(rows: np.ndarray, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """A new array of ``shape`` holding ``rows`` (a 2-D view, a row per rank, of any dtype
    whose rows are whole elements of ``dtype``) end to end: one copy."""
    # Below the pool's threshold its bookkeeping costs more than malloc (a small call is a
    # few microseconds in all), and a copy of the rows is half the time of a copy into one.
    if rows.nbytes < MIN_POOLED_BYTES:
        return rows.copy().view(dtype).reshape(shape)
    out = pool.empty(shape, dtype)
    out.reshape(-1).view(rows.dtype).reshape(rows.shape)[...] = rows
    return out


def _joined_parts(
    datas: np.ndarray | list[np.ndarray], lengths: list[int], shape: tuple, dtype: np.dtype
) -> np.ndarray:
    """A new array of ``shape`` holding every rank's data (``datas``: bytes, a row per rank,
    ``lengths[r]`` of rank r's) end to end."""
    total = sum(lengths)
    first = lengths[0]
    if isinstance(datas, np.ndarray) and lengths.count(first) == len(lengths):  # one copy
        return _rows_joined(datas[:, :first], shape, dtype)
    if total < MIN_POOLED_BYTES:
        flat = np.empty(total, np.uint8)
        out = flat.view(dtype).reshape(shape)
    else:
        out = pool.empty(shape, dtype)
        flat = out.reshape(-1).view(np.uint8)
    at = 0
    for rank, nbytes in enumerate(lengths):
        flat[at : at + nbytes] = datas[rank][:nbytes]
        at += nbytes
    return out


def displacements(counts: np.ndarray) -> np.ndarray:
    """Where each of ``counts`` starts when laid end to end."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


class MpiTransport:
    """How the collectives of ``comm`` move their data: here all over MPI. Every method takes
    what the collective API has checked and laid out (C-contiguous buffers, the fields the ranks
    agree on and how the call reads in an error) and records the transfer in the timeline."""

    # Whether ``reduce`` takes a fusion buffer's parts (``shm.Pieces``) instead of the packed
    # buffer; this one packs them itself.
    takes_pieces = False
    # Whether ``exchange`` is the records' round, so a call may ride in it (a transport
    # whose agreement goes elsewhere must not start one here: its joined ranks wait there).
    agrees_in_records = True

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.size = comm.Get_size()
        self.records = Records(comm)
        self.eager = self.records.eager
        # Every rank's record data as bytes, a row per rank: a view made once (a small call is a
        # few microseconds; a view is one).
        self._record_bytes = self.records.rows(self.eager, np.dtype(np.uint8))
        # What a small allreduce needs that depends only on its kind (op, dtype, shape).
        self._plans: dict[tuple, tuple] = {}

    # -- agreement ---------------------------------------------------------------------------

    def exchange(self, pair: tuple[int, int], describe: Callable[[], str]) -> tuple[int, int]:
        """The elementwise max of every rank's ``pair``: one agreement round."""
        self.records.round(*pair)
        return self.records.agreed_pair()

    def check_same(
        self, fields: tuple, describe: Callable[[], str], reduction: Reduction = None
    ) -> bool:
        """Agree with the other ranks before a collective (``agreement``'s protocol): raises
        ``CollectiveMismatchError`` on every rank if any rank's ``fields`` differ; with joined
        ranks, a collective with a ``reduction`` goes on (returning False: the joined ranks'
        part is MPI's ``Allreduce``) and any other raises."""
        if self.size == 1 or not state.checks_collectives():
            return True
        fp = agreement.fingerprint(fields)
        pair = self.exchange((fp, -fp), describe)
        agreement.settle(self.comm, fp, pair, describe, reduction)
        return pair == (fp, -fp)

    def serve_joined(self) -> int:
        """A joined rank's part in the others' collectives until every rank has joined;
        returns how many reductions it served."""
        served = 0
        while True:
            if self.exchange((ABSENT, 1), lambda: "join()")[0] == ABSENT:  # no rank is active
                return served
            # Where ranks have joined, the active ones skip their records' data and go the
            # general way (``settle``), so this side is the same whatever they carried.
            served += agreement.serve_joined_round(self.comm)

    # -- reductions --------------------------------------------------------------------------

    def allreduce_small(self, arr: np.ndarray, op: int, name: str | None) -> np.ndarray | None:
        """An allreduce of C-contiguous ``arr`` (uncompressed, unscaled) carried in the
        agreement's records, with what depends only on the kind of call worked out once; or
        None (the general path runs and raises what it raises)."""
        if arr.nbytes > self.eager or not state.checks_collectives():
            return None
        plan = self._cached_plan(op, arr, self._record_plan)
        if plan is None:
            return None
        reduce_op, fp, describe, parts, ufunc = plan
        out = np.empty(arr.shape, arr.dtype)
        start = timeline.begin()
        if not self.records.round(fp, -fp, 0, arr):
            agreement.settle(self.comm, fp, self.records.agreed_pair(), describe, (reduce_op, arr))
            self.reduce_agreed(reduce_op, arr, out, "allreduce", name)  # joined ranks: over MPI
            return out
        _reduce_parts(ufunc, self.records.parts(parts), out)
        timeline.end("allreduce", name, out.nbytes, start)
        if reduce_op is ReduceOp.AVERAGE:
            finish_average(out, self.size, reduce_op)
        return out

    def _cached_plan(
        self, op: int, arr: np.ndarray, make: Callable[[int, np.ndarray], tuple | None]
    ) -> tuple | None:
        """What a small allreduce of ``op`` on arrays like ``arr`` needs that depends only on
        that kind of call (``make``'s plan, kept per kind), or None where ``make`` declines."""
        if type(op) is not ReduceOp and type(op) is not int:  # not a float equal to an op
            return None
        key = (op, arr.dtype, arr.shape)
        plan = self._plans.get(key)
        if plan is None:
            plan = make(op, arr)
            if plan is None:
                return None
            self._keep_plan(key, plan)
        return plan

    def _keep_plan(self, key: tuple, plan: tuple) -> tuple:
        """``plan`` kept for ``key`` (a bounded number of kinds: a program's are few)."""
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _record_plan(self, op: int, arr: np.ndarray) -> tuple | None:
        """``(op, fingerprint, describe, parts, ufunc)`` for a small allreduce of ``op`` on
        arrays like ``arr`` (``parts``: every rank's data in the records, as ``arr``'s dtype),
        or None where the records do not take it."""
        reduce_op = known_op(op)
        if reduce_op is None or not ring.reduces_alike(reduce_op, arr):
            return None
        fields, describe = agreement.allreduce_call(reduce_op, arr.dtype, arr.shape)
        parts = self.records.rows(arr.nbytes, arr.dtype)
        return reduce_op, agreement.fingerprint(fields), describe, parts, shm.UFUNCS[reduce_op]

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
        packed from them. Returns whether later buffers of the same reduction may take any
        route: False where ranks have joined, whose part is MPI's ``Allreduce`` (``mpi_only``
        then says so for those buffers)."""
        if (
            agreed is not None
            and self.agrees_in_records
            and isinstance(wire, np.ndarray)
            and wire.nbytes <= self.eager
            and self.size > 1
            and state.checks_collectives()
            and ring.reduces_alike(op, wire)
        ):
            fields, describe, reduction = agreed  # agreement and data in one round
            fp = agreement.fingerprint(fields)
            start = timeline.begin()
            if self.records.round(fp, -fp, 0, wire):
                parts = self.records.parts(self.records.rows(wire.nbytes, wire.dtype))
                _reduce_parts(shm.UFUNCS[op], parts, out)
                timeline.end(kind, name, out.nbytes, start)
                finish_average(out, self.size, op)
                return True
            agreement.settle(self.comm, fp, self.records.agreed_pair(), describe, reduction)
        elif agreed is None or self.check_same(*agreed):
            # A fusion buffer's parts (not an ndarray) go to MPI packed.
            if isinstance(wire, np.ndarray) and ring.takes(self.size, op, wire, out, mpi_only):
                ring.allreduce(self.comm, op, wire, out, kind, name)
                return True
            self.reduce_agreed(op, wire, out, kind, name)
            return not mpi_only
        self.reduce_agreed(op, wire, out, kind, name)  # joined ranks: their part is MPI's
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

    def allgather_small(self, arr: np.ndarray, name: str | None) -> np.ndarray | None:
        """An allgather of the C-contiguous ``arr`` (at least 1-D, numeric) whose data the
        records carry in their own room, with what depends only on the kind of call (dtype
        and shape) worked out once; or None (the general path runs)."""
        records = self.records
        if self.size == 1 or not self.agrees_in_records or not records.copies(arr.nbytes):
            return None
        key = (_ALLGATHER, arr.dtype, arr.shape)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._keep_plan(key, _gather_plan(self, arr))
        fp, describe, rows, shape = plan
        if not state.checks_collectives():
            fp = 0
        start = timeline.begin()
        if not records.round(fp, -fp, arr.shape[0], arr):
            agreement.settle(self.comm, fp, records.agreed_pair(), describe, None)
            raise AssertionError("settle raises for a collective without a reduction")
        inline, counts = records.inline_and_rows()
        rows_here = arr.shape[0]  # equal parts (rows of no bytes may still be ragged)
        if inline.count(arr.nbytes) == self.size and counts.count(rows_here) == self.size:
            out = _rows_joined(rows, shape, arr.dtype)
            timeline.end("allgather", name, out.nbytes, start)
            return out
        return _gathered(self, arr, inline, counts, name, start)

    def allgather(
        self, arr: np.ndarray, fields: tuple, describe: Callable[[], str], name: str | None
    ) -> np.ndarray:
        """Every rank's rows of the C-contiguous ``arr`` (at least 1-D), in rank order."""
        if self.size == 1:
            return _gathered(self, arr, [-1], [arr.shape[0]], name, timeline.begin())
        start = timeline.begin()
        gathered, inline, counts = _gather_round(self, arr, fields, describe)
        if gathered is not None:
            timeline.end("allgather", name, gathered.nbytes, start)
            return gathered
        return _gathered(self, arr, inline, counts, name, start)

    def broadcast_small(self, arr: np.ndarray, root: int, name: str | None) -> np.ndarray | None:
        """A new array of ``root``'s C-contiguous ``arr`` (numeric or bool), where the root's
        record carries it in its own room and the argument check is on, with what depends only
        on the kind of call worked out once; or None (the general path runs)."""
        records = self.records
        if (
            self.size == 1
            or not self.agrees_in_records
            or not records.copies(arr.nbytes)
            or not state.checks_collectives()
        ):
            return None
        key = (_BROADCAST, arr.dtype, arr.shape, root)
        plan = self._plans.get(key)
        if plan is None:
            fields, describe = broadcast_call(arr.dtype, arr.shape, root)
            roots = records.rows(arr.nbytes, arr.dtype)[root].reshape(arr.shape)
            plan = self._keep_plan(key, (agreement.fingerprint(fields), describe, roots))
        fp, describe, roots = plan
        at_root = records.rank == root
        start = timeline.begin()
        if not records.round(fp, -fp, 0, arr if at_root else None):
            agreement.settle(self.comm, fp, records.agreed_pair(), describe, None)
            raise AssertionError("settle raises for a collective without a reduction")
        out = arr.copy() if at_root else roots.copy()
        timeline.end("broadcast", name, out.nbytes, start)
        return out

    def broadcast(
        self,
        buf: np.ndarray,
        root: int,
        fields: tuple,
        describe: Callable[[], str],
        name: str | None,
        source: np.ndarray | None = None,
        buf_is_new: bool = False,
    ) -> None:
        """``root``'s C-contiguous ``buf`` into every rank's ``buf``; at the root, ``source``
        (when given: the same shape and dtype) is what is sent, and ``buf`` gets a copy.
        ``buf_is_new``: ``buf`` is the call's own output, which may hold anything if the call
        fails (not the caller's array)."""
        if self.size > 1 and state.checks_collectives() and buf.nbytes <= self.eager:
            # The root's values ride in its record: agreement and data in one round.
            fp = agreement.fingerprint(fields)
            start = timeline.begin()
            at_root = self.comm.Get_rank() == root
            sent = np.ascontiguousarray(buf if source is None else source) if at_root else None
            # Between two ranks the root's values may land in a new ``buf`` directly; never
            # in the caller's array, which a mismatch would leave half-written.
            direct = not at_root and buf_is_new and self.records.receives_into(buf.nbytes)
            into = buf.reshape(-1).view(np.uint8) if direct else None
            if not self.records.round(fp, -fp, 0, sent, into):
                agreement.settle(self.comm, fp, self.records.agreed_pair(), describe, None)
                raise AssertionError("settle raises for a collective without a reduction")
            if not at_root and into is None:
                buf.reshape(-1).view(np.uint8)[...] = self.records.data_of(root)
            elif source is not None:
                np.copyto(buf, source)
            timeline.end("broadcast", name, buf.nbytes, start)
            return
        self.check_same(fields, describe)
        start = timeline.begin()
        self.broadcast_data(buf, root, source)
        timeline.end("broadcast", name, buf.nbytes, start)

    def broadcast_data(self, buf: np.ndarray, root: int, source: np.ndarray | None) -> None:
        """``broadcast``'s data, the ranks having agreed: ``Bcast``, from ``source`` at the
        root when given (``buf`` gets a copy)."""
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
        start = timeline.begin()
        if self.size > 1 and state.checks_collectives():
            # The agreement is a barrier itself: no rank learns its outcome before every rank
            # has sent its fingerprint.
            self.check_same((8,), lambda: "barrier()")
        else:
            self.comm.Barrier()
        timeline.end("barrier", None, 0, start)


# -- an allgather's steps over MPI (``MpiTransport.allgather`` and ``allgather_small``) -------


def _gather_plan(route: MpiTransport, arr: np.ndarray) -> tuple:
    """``(fingerprint, describe, rows, shape)`` for ``allgather_small`` on arrays like
    ``arr``: ``rows`` every rank's part in the records as ``arr``'s dtype (a view), ``shape``
    the output's where the parts are equal."""
    fields, describe = allgather_call(arr.dtype, arr.shape)
    rows = route.records.rows(arr.nbytes, arr.dtype)
    shape = (route.size * arr.shape[0], *arr.shape[1:])
    return agreement.fingerprint(fields), describe, rows, shape


def _gathered(
    route: MpiTransport,
    arr: np.ndarray,
    inline: list[int],
    counts: list[int],
    name: str | None,
    start: int,
) -> np.ndarray:
    """An allgather's output once the ranks agreed on ``counts`` (rows per rank): joined
    from the records where every part came in the round (``inline``: bytes per rank, -1
    for none), else moved by MPI."""
    if min(inline) >= 0:
        datas = route.records.parts(route._record_bytes)
        out = _joined_parts(datas, inline, (sum(counts), *arr.shape[1:]), arr.dtype)
        timeline.end("allgather", name, out.nbytes, start)
        return out
    comm = route.comm
    row_shape = arr.shape[1:]
    rows = np.array(counts, dtype=np.int64)
    out = pool.empty((int(rows.sum()), *row_shape), arr.dtype)
    dtype = mpi_type(arr.dtype)
    if (rows == rows[0]).all():
        # Equal parts (the common case): MPICH's Allgatherv over TCP took twice Allgather's
        # time from 1 MB (2 ranks on 2 hosts: 16 MB 18.3-18.6 ms against 9.5-11.1 ms).
        comm.Allgather([arr, dtype], [out, dtype])
    else:
        items = rows * math.prod(row_shape)
        comm.Allgatherv(arr, [out, items, displacements(items), dtype])
    timeline.end("allgather", name, out.nbytes, start)
    return out


def _gather_round(
    route: MpiTransport, arr: np.ndarray, fields: tuple, describe: Callable[[], str]
) -> tuple[np.ndarray | None, list[int], list[int]]:
    """An allgather's agreement round: the output where the parts came into it (else
    None), and per rank the bytes of its part in the round (-1: none) and its row count."""
    # The records carry each rank's row count (ragged parts agree in one round) and, where
    # every part fits, the parts themselves; with the check off the same, with no
    # fingerprint to compare.
    records = route.records
    fp = agreement.fingerprint(fields) if state.checks_collectives() else 0
    fits = arr.nbytes <= route.eager
    halves = None
    if fits and records.receives_into(arr.nbytes):
        # Two ranks: the other's part comes straight into the output, as raw ``Allgather``
        # receives it, where the parts are equal (most calls).
        out = pool.empty((2 * arr.shape[0], *arr.shape[1:]), arr.dtype)
        halves = out.reshape(2, -1).view(np.uint8)
    into = None if halves is None else halves[1 - records.rank]
    if not records.round(fp, -fp, arr.shape[0], arr if fits else None, into):
        agreement.settle(route.comm, fp, records.agreed_pair(), describe, None)
        raise AssertionError("settle raises for a collective without a reduction")
    inline, counts = records.inline_and_rows()
    if halves is None or min(inline) < 0:  # ``_gathered`` joins or moves the parts
        return None, inline, counts
    own = arr.reshape(-1).view(np.uint8)
    if inline.count(arr.nbytes) == 2:
        halves[records.rank] = own
        return out, inline, counts
    # Ragged: the other's part came partly into ``halves``.
    datas = [own if r == records.rank else records.data_of(r, into) for r in range(2)]
    shape = (sum(counts), *arr.shape[1:])
    return _joined_parts(datas, inline, shape, arr.dtype), inline, counts
