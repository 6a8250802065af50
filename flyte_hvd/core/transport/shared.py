"""Transports through a host's shared-memory segment (``shm``): all ranks on one host
(``SharedMemoryTransport``), or the same number on each of several hosts
(``HierarchicalTransport``: the segment within a host, MPI between hosts).

The agreement rides on the data's first wait where the segment carries a collective; where
ranks have joined, the reduction goes over MPI, which joined ranks serve. What the segment
does not carry (alltoall, reducescatter, complex MIN/MAX) goes over MPI.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flyte_hvd.core import agreement, shm, state, timeline
from flyte_hvd.core.agreement import Agreement
from flyte_hvd.core.buffers import pool
from flyte_hvd.core.reduce_ops import ReduceOp, finish_average, known_op
from flyte_hvd.core.transport.mpi import MpiTransport

if TYPE_CHECKING:
    from mpi4py import MPI


# From this size a broadcast's data goes over MPI (2 ranks on one host, alternating launches:
# 4 MB 0.69-0.85 ms over MPI against 0.82-1.22 ms through the segment, 64 MB 10.9-11.6 ms
# against 14.9-22.2 ms; 2 MB 0.50-0.65 against 0.29-0.45 ms).
MPI_BROADCAST_BYTES = 4 << 20


def _segment_reduces(op: ReduceOp, out: np.ndarray) -> bool:
    """Whether the segment's ufuncs reduce ``op`` on ``out``'s dtype (complex numbers have
    no order)."""
    return out.dtype.kind != "c" or op not in (ReduceOp.MIN, ReduceOp.MAX)


def _reduce_through(
    transport: MpiTransport,
    channel: shm.Channel | shm.Hierarchy,
    agreed: Agreement | None,
    op: ReduceOp,
    wire: np.ndarray | shm.Pieces,
    out: np.ndarray,
    kind: str,
    name: str | None,
) -> bool:
    """``reduce`` through ``channel``; on MPI (True/False as ``reduce`` returns) where ranks
    have joined, after ``agreement.settle`` (which raises on a mismatch)."""
    fp = agreement.fingerprint(agreed[0]) if agreed and state.checks_collectives() else 0
    describe = agreed[1] if agreed else (lambda: kind)
    # Floats are divided while copied out; integers after (rounded toward zero).
    size = transport.size
    divisor = size if op is ReduceOp.AVERAGE and out.dtype.kind in "fc" else 1
    start = timeline.begin()
    src = wire.reshape(-1) if isinstance(wire, np.ndarray) and wire.ndim != 1 else wire
    flat = out if out.ndim == 1 else out.reshape(-1)
    differ = channel.allreduce(src, flat, shm.UFUNCS[op], divisor, (fp, -fp), describe)
    if differ is None:
        timeline.end(kind, name, out.nbytes, start)
        if divisor == 1 and op is ReduceOp.AVERAGE:
            finish_average(out, size, op)
        return True
    assert agreed is not None  # only a fingerprint can differ
    agreement.settle(transport.comm, fp, differ, describe, agreed[2])  # raises unless joined
    transport.reduce_agreed(op, wire, out, kind, name)
    return False


class SharedMemoryTransport(MpiTransport):
    """Every rank of the communicator on this host: reductions, allgathers, broadcasts and
    the agreement through the host's segment."""

    takes_pieces = True
    agrees_in_records = False  # through the segment

    def __init__(self, comm: MPI.Comm, channel: shm.Channel):
        super().__init__(comm)
        self.channel = channel

    def exchange(self, pair: tuple[int, int], describe: Callable[[], str]) -> tuple[int, int]:
        # Every agreement on this communicator goes through the segment, joined ranks' too.
        return self.channel.exchange(pair, describe)

    def allreduce_small(self, arr: np.ndarray, op: int, name: str | None) -> np.ndarray | None:
        """An allreduce of at most ``shm.SMALL_BYTES`` (C-contiguous, uncompressed, unscaled)
        with what depends only on the kind of call worked out once: at 4 KB the general
        path's per-call work took longer than the reduction itself (measured: 9 of 16 us).
        None where the shortcut does not apply (the general path runs and raises what it
        raises)."""
        plan = self._cached_plan(op, arr, self._plan)
        if plan is None:
            return None
        reduce_op, pair, ufunc, divisor, average_after, describe = plan
        out = np.empty(arr.shape, arr.dtype)
        start = timeline.begin()
        differ = self.channel.allreduce_small(
            arr.reshape(-1) if arr.ndim != 1 else arr,
            out.reshape(-1) if out.ndim != 1 else out,
            ufunc, divisor, pair, describe,
        )  # fmt: skip
        if differ is None:
            timeline.end("allreduce", name, out.nbytes, start)
            if average_after:
                finish_average(out, self.size, ReduceOp.AVERAGE)
            return out
        agreement.settle(self.comm, pair[0], differ, describe, (reduce_op, arr))  # joined
        self.reduce_agreed(reduce_op, arr, out, "allreduce", name)
        return out

    def _plan(self, op: int, arr: np.ndarray) -> tuple | None:
        """``(op, pair, ufunc, divisor, average_after, describe)`` for a small allreduce of
        ``op`` on arrays like ``arr``, or None where the shortcut does not take it."""
        reduce_op = known_op(op)
        if reduce_op is None or arr.dtype.kind not in "fiu":
            return None
        fields, describe = agreement.allreduce_call(reduce_op, arr.dtype, arr.shape)
        fp = agreement.fingerprint(fields) if state.checks_collectives() else 0
        # As ``reduce``: floats are divided while copied out; integers after (toward zero).
        floating = arr.dtype.kind == "f"
        divisor = self.size if reduce_op is ReduceOp.AVERAGE and floating else 1
        average_after = reduce_op is ReduceOp.AVERAGE and not floating
        return reduce_op, (fp, -fp), shm.UFUNCS[reduce_op], divisor, average_after, describe

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
        if mpi_only or not _segment_reduces(op, out):
            return super().reduce(agreed, op, wire, out, kind, name, mpi_only)
        return _reduce_through(self, self.channel, agreed, op, wire, out, kind, name)

    def allgather(
        self, arr: np.ndarray, fields: tuple, describe: Callable[[], str], name: str | None
    ) -> np.ndarray:
        row_bytes = math.prod(arr.shape[1:]) * arr.itemsize
        if row_bytes:
            mine = arr.reshape(-1).view(np.uint8)

            def allocate(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
                out = pool.empty((sum(lengths) // row_bytes, *arr.shape[1:]), arr.dtype)
                return out, out.reshape(-1).view(np.uint8)

        else:  # rows of no bytes: their counts are what travels (every rank on this path)
            mine = np.array([arr.shape[0]], dtype=np.int64).view(np.uint8)

            def allocate(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
                counts = np.empty(sum(lengths) // 8, dtype=np.int64)
                return counts, counts.view(np.uint8)

        fp = agreement.fingerprint(fields) if state.checks_collectives() else 0
        start = timeline.begin()
        got = self.channel.allgather(mine, (fp, -fp), describe, allocate)
        if isinstance(got, np.ndarray):
            if not row_bytes:
                got = np.empty((int(got.sum()), *arr.shape[1:]), arr.dtype)
            timeline.end("allgather", name, got.nbytes, start)
            return got
        agreement.settle(self.comm, fp, got, describe, None)  # raises: a mismatch, or joined
        raise AssertionError("settle raises for a collective without a reduction")

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
        fp = agreement.fingerprint(fields) if state.checks_collectives() else 0
        start = timeline.begin()
        if buf.nbytes >= MPI_BROADCAST_BYTES:
            # The ranks agree in one wait of the segment, as the other path's first step does
            # (so a rank whose shape differs, and took the other path, raises here too), and
            # MPICH moves the data: once, process to process, where the segment copies it in
            # and out.
            pair = self.channel.exchange((fp, -fp), describe)
            differ = None if pair == (fp, -fp) else pair
            if differ is None:
                self.broadcast_data(buf, root, source)
        else:
            if source is not None:  # the root's values go through its segment from `buf`
                np.copyto(buf, source)
            view = buf.reshape(-1).view(np.uint8)
            differ = self.channel.broadcast(view, root, (fp, -fp), describe)
        if differ is None:
            timeline.end("broadcast", name, buf.nbytes, start)
            return
        agreement.settle(self.comm, fp, differ, describe, None)  # raises: a mismatch, or joined
        raise AssertionError("settle raises for a collective without a reduction")


class HierarchicalTransport(MpiTransport):
    """The same number of ranks (at least 2) on each of several hosts: large reductions go
    through each host's segment and MPI between hosts (``shm.Hierarchy``); short ones and
    every other collective over MPI, whose own algorithms are faster there."""

    takes_pieces = True

    def __init__(self, comm: MPI.Comm, hierarchy: shm.Hierarchy):
        super().__init__(comm)
        self.hierarchy = hierarchy

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
        if mpi_only or out.nbytes < shm.HIERARCHICAL_MIN_BYTES or not _segment_reduces(op, out):
            return super().reduce(agreed, op, wire, out, kind, name, mpi_only)
        if agreed is not None and state.checks_collectives():
            # Over MPI, as every agreement on this communicator (the records' round).
            fields, describe, reduction = agreed
            fp = agreement.fingerprint(fields)
            pair = self.exchange((fp, -fp), describe)
            if pair != (fp, -fp):
                agreement.settle(self.comm, fp, pair, describe, reduction)  # raises unless joined
                self.reduce_agreed(op, wire, out, kind, name)
                return False
        return _reduce_through(self, self.hierarchy, None, op, wire, out, kind, name)
