"""The ranks' agreement over MPI as records: one round in which every rank sends every other
its record, the call's fingerprint and its negation, how many bytes of the call's data the
record carries (-1: none), the rank's row count (allgather), then the data itself where it
fits in ``FLYTE_HVD_EAGER_BYTES``.

Up to ``P2P_MAX_RANKS`` ranks the records go point to point (two ranks: one ``Sendrecv``),
each as long as it needs, and from ``_SENT_FROM_CALLER_BYTES`` a rank's data goes out from
the caller's array behind its header (one MPI datatype of the two addresses) instead of being
copied into its record; between two ranks the other rank's data may come in the same way,
straight into the collective's output (``receives_into``). Above ``P2P_MAX_RANKS``, as one
``Allgather`` of fixed-size records. The transports (``mpi.py``) read the round's verdict and
every rank's data from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flyte_hvd.core import state

if TYPE_CHECKING:
    from mpi4py import MPI

# A record's header, in int64 slots: fingerprint, -fingerprint, inline bytes, rows.
_HEADER_SLOTS = 4
_HEADER_BYTES = _HEADER_SLOTS * 8
# Up to this many ranks each rank sends its record to every other point to point, only as
# long as its data: between two simulated hosts a round of bare headers took 22 us, one of
# records with room for 4 KB 43 us, so calls whose data does not ride pay no room for it.
# Above, one Allgather of fixed-size records (MPICH's algorithm scales; n-1 sends do not).
P2P_MAX_RANKS = 8
_TAG = 0x5244  # the records' tag; collectives never match point-to-point messages
# An Allgather's records stay below this over all ranks: their bytes grow with the ranks.
_EAGER_TOTAL = 64 << 10
# Between two ranks a record carries up to this much (point to point, each as long as it
# needs): between two simulated hosts a 128-256 KB allreduce took 0.96-1.23x raw MPICH in one
# round against 0.65-0.76x as a round and then MPICH's ``Allreduce``; with more ranks every
# rank would send its part to every other, where MPICH's algorithms send it log2(n) times.
_PAIR_EAGER = 256 << 10
# From here a rank's data goes out from the caller's array, behind the record's header in one
# message (an MPI datatype of the two, 2 us to make), not copied into the record first; and
# between two ranks the other's data may come into the output the same way.
_SENT_FROM_CALLER_BYTES = 32 << 10


def eager_bytes(size: int) -> int:
    """Bytes of a call's data a record carries on a communicator of ``size`` ranks."""
    if size > P2P_MAX_RANKS:
        room = _EAGER_TOTAL // size
    else:
        room = _PAIR_EAGER if size == 2 else _EAGER_TOTAL
    return min(state.eager_bytes(), room) // 8 * 8


class Records:
    """Every rank's record of the last agreement round on ``comm`` (``round``), read until
    the next round."""

    def __init__(self, comm: MPI.Comm):
        from mpi4py import MPI

        self.comm = comm
        self.size = size = comm.Get_size()
        # The same on every rank (a record's size must be), whatever each was given.
        eager = eager_bytes(size)
        self.eager = min(comm.allgather(eager)) if size > 1 else eager
        self.p2p = 1 < size <= P2P_MAX_RANKS
        self._records = np.zeros((size, _HEADER_SLOTS + self.eager // 8), dtype=np.int64)
        self.rank = me = comm.Get_rank()
        self._record = self._records[me]  # this rank's, written in place
        # Views made once: a numpy view costs about a microsecond, a tenth of a small call.
        self._bytes = self._records.view(np.uint8)  # (size, record bytes)
        self._room = self._bytes[me, _HEADER_BYTES:].data
        self._fps = self._records[:, 0]
        self._datas = self._bytes[:, _HEADER_BYTES:]  # (size, eager) bytes
        self._peers = [(r, self._bytes[r]) for r in range(size) if r != me]  # their records
        self._pair = self._peers[0] if size == 2 else None
        self._inline_and_rows = self._records[:, 2:4].T  # (2, size): bytes in the record, rows
        self._header_address = MPI.Get_address(self._record)
        self._peer_address = MPI.Get_address(self._pair[1]) if self._pair is not None else 0
        # This rank's data in the last round where it went out from the caller's array (bytes),
        # else None: its record's room holds it.
        self._own: np.ndarray | None = None
        self._mpi = MPI  # an import statement per call costs a small call a microsecond

    def copies(self, nbytes: int) -> bool:
        """Whether ``round`` carries data of ``nbytes`` copied into this rank's record, so that
        ``rows`` holds every rank's part after a round where all sent as much."""
        return nbytes <= self.eager and (nbytes < _SENT_FROM_CALLER_BYTES or not self.p2p)

    def receives_into(self, nbytes: int) -> bool:
        """Whether ``round`` may take ``into`` for a call of ``nbytes`` (two ranks; from the
        size where a datatype costs less than the copy it saves, up to ``eager``)."""
        return self._pair is not None and _SENT_FROM_CALLER_BYTES <= nbytes <= self.eager

    def round(
        self,
        fp: int,
        neg: int,
        rows: int = 0,
        data: np.ndarray | None = None,
        into: np.ndarray | None = None,
    ) -> bool:
        """One agreement round: every rank's record, this rank's made of the fields given and
        ``data`` (None: no data; else it fits in ``eager`` and is C-contiguous). ``into``
        (C-contiguous bytes, only where ``receives_into`` says so): where the other rank's data
        lands, as far as it reaches, the rest in its record (``data_of`` with the same ``into``
        reads it).
        On a mismatch ``into`` may hold any bytes. Returns whether every rank sent ``fp``."""
        record = self._record
        record[0], record[1], record[3] = fp, neg, rows
        nbytes = 0 if data is None else data.nbytes
        record[2] = -1 if data is None else nbytes
        sent_type = None
        mine: object
        if nbytes >= _SENT_FROM_CALLER_BYTES and self.p2p:
            self._own = own = data.reshape(-1).view(np.uint8)  # type: ignore[union-attr]
            addresses = [self._header_address, self._mpi.Get_address(own)]
            sent_type = self._mpi.BYTE.Create_hindexed([_HEADER_BYTES, nbytes], addresses)
            mine = [self._mpi.BOTTOM, 1, sent_type.Commit()]
        else:
            self._own = None
            if nbytes:
                self._room[:nbytes] = data.data.cast("B")  # type: ignore[union-attr]
            mine = self._bytes[self.rank, : _HEADER_BYTES + nbytes]
        received = None
        if into is not None:
            # Header into the peer's record, data into ``into``, what is longer after the
            # first ``into.nbytes`` of its record's room (a shorter message fills less).
            lengths = [_HEADER_BYTES, into.nbytes]
            addresses = [self._peer_address, self._mpi.Get_address(into)]
            if into.nbytes < self.eager:
                lengths.append(self.eager - into.nbytes)
                addresses.append(self._peer_address + _HEADER_BYTES + into.nbytes)
            received = self._mpi.BYTE.Create_hindexed(lengths, addresses).Commit()
        comm = self.comm
        # A shorter message than the receive buffer is fine in MPI, and messages between two
        # ranks with one tag arrive in order: round k meets round k.
        try:
            if self._pair is not None:  # one call, no request objects: 1-3 us less a round
                peer, record = self._pair
                landing = record if received is None else [self._mpi.BOTTOM, 1, received]
                comm.Sendrecv(mine, peer, _TAG, landing, peer, _TAG)
            elif self.p2p:
                requests = [comm.Irecv(record, peer, _TAG) for peer, record in self._peers]
                requests += [comm.Isend(mine, peer, _TAG) for peer, _ in self._peers]
                self._mpi.Request.Waitall(requests)
            else:
                comm.Allgather(self._mpi.IN_PLACE, self._records)
        finally:
            if sent_type is not None:
                sent_type.Free()
            if received is not None:
                received.Free()
        return self._fps.tolist().count(fp) == self.size

    def agreed_pair(self) -> tuple[int, int]:
        """The elementwise max of the last round's (fingerprint, -fingerprint): ``settle``'s
        input where the ranks did not all agree."""
        return int(self._records[:, 0].max()), int(self._records[:, 1].max())

    def inline_and_rows(self) -> tuple[list[int], list[int]]:
        """Per rank, the bytes of data its last record carried (-1: none) and its row count
        (Python lists: reading them from numpy per call is slower)."""
        inline, rows = self._inline_and_rows.tolist()
        return inline, rows

    def data_of(self, rank: int, into: np.ndarray | None = None) -> np.ndarray:
        """The bytes of ``rank``'s data in the last round (another rank's), whose ``into`` is
        given where the round had one: a view, or a copy where it came partly into ``into``."""
        nbytes = int(self._records[rank, 2])
        if into is None:
            return self._datas[rank, :nbytes]
        if nbytes <= into.nbytes:
            return into[:nbytes]
        return np.concatenate((into, self._datas[rank, into.nbytes : nbytes]))

    def rows(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """The first ``nbytes`` of every record's data as ``dtype``, a row per rank: a view,
        the same for every round, so it may be made once and kept."""
        return self._datas[:, :nbytes].view(dtype)

    def parts(self, rows: np.ndarray) -> np.ndarray | list[np.ndarray]:
        """``rows`` (from ``rows``) for the last round, with this rank's own array in place of
        its row where the round sent it from there."""
        if self._own is None:
            return rows
        parts = list(rows)
        parts[self.rank] = self._own.view(rows.dtype)
        return parts
