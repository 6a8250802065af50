"""Same-host reductions through one shared-memory segment per communicator.

When every rank of a communicator runs on one host, an allreduce need not go through MPI's
messages: each rank writes into its slot of a segment all of them map the part of its input
the others reduce, each reduces its share of the elements with numpy, and each copies the
result out. Ranks wait for
one another on counters in the segment (a spin, then ``sched_yield``, then short sleeps), and
while they wait they look at whether the ranks they wait for are still alive: a rank that
died ends the others' wait with an error naming it, instead of a hang.

The same counters carry the ranks' agreement on each collective's arguments (see
``agreement.py``): a rank writes its fingerprint beside its data before the first
wait, so a checked reduction costs no extra round.

Messages up to ``SMALL_BYTES`` take one wait: every rank reduces the whole message from
double-buffered slots. Longer ones go in chunks of ``CHUNK_BYTES`` with one wait per chunk
(and one more at the end): the post after copying in chunk k also says chunk k-1 is reduced,
so a rank copies out k-1 and reduces k after the same wait. Chunks alternate between two
sets of slots and result areas, so a set is written again only after every rank has posted
past its last read of it.

Broadcasts and allgathers use the same slots: the root (for an allgather, every rank)
writes the next chunk, every rank posts and waits, and the others copy it out; the lengths
of an allgather's parts ride on its first wait with the agreement.

Where a communicator's ranks sit on several hosts, the same number on each, a ``Hierarchy``
reduces within each host through the host's segment, has each rank of a host allreduce its
slice over MPI with its peers on the other hosts, and shares the slices within the host
again (``HOROVOD_HIERARCHICAL_ALLREDUCE``, on by default; measured in docs/performance.md).

The segment is a file in ``/dev/shm`` that rank 0 creates and removes as soon as every rank
has mapped it, so nothing is left there however the run ends. ``FLYTE_HVD_SHM_COLLECTIVES``
(``auto``, ``on``, ``off``) picks the path; see docs/performance.md.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import mmap
import os
import platform
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flyte_hvd.core import state
from flyte_hvd.core.log import get_logger

if TYPE_CHECKING:
    from mpi4py import MPI

MODE_ENV = state.SHM_ENV
SHM_DIR = "/dev/shm"
SMALL_BYTES = 32 << 10
CHUNK_BYTES = 1 << 20
# Across hosts, shorter allreduces go to MPI: measured on 2 simulated hosts x 2 ranks, the
# hierarchical path took 1.3x MPICH's time at 64 KB, the same at 128 KB, 0.57x at 256 KB.
HIERARCHICAL_MIN_BYTES = 256 << 10
_STORE_ORDERED = ("x86_64", "amd64")
_MAX_VIEWS = 256  # cached typed views of the small slots
_LINE = 64  # bytes: one cache line per rank's counter and per rank's fingerprint
_WORDS = _LINE // 8
# Waiting: spins that only re-read the counter, then ``sched_yield`` (a core may be shared),
# then sleeps once the wait is long (the peer is computing, not about to arrive).
_SPINS = 64
_SLEEP_AFTER_S = 0.02
_SLEEP_S = 50e-6
_LIVENESS_EVERY_S = 0.05
# Before raising on a peer that died: a launcher that sees the death itself (its stall watch
# takes about 2 s for a rank that returned) stops this rank meanwhile and names the dead
# rank and how it ended (a signal, its error) as the run's cause.
DEAD_PEER_GRACE_S = 5.0

logger = get_logger(__name__)

# ufuncs of the reduction ops (reduce_ops.ReduceOp values): AVERAGE sums, then divides.
UFUNCS: dict[int, np.ufunc] = {
    0: np.add,
    1: np.add,
    3: np.minimum,
    4: np.maximum,
    5: np.multiply,
}


class PeerExitedError(RuntimeError):
    """A rank this one waited for in a shared-memory collective is no longer running."""


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22), None if gone or a
    zombie: together with the pid it names one process, not a later one with the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


class Steps:
    """How the ranks of a segment wait for one another: a counter per rank at the start of
    the segment (each rank posts its step, the others wait until it is there), and each
    rank's agreement pair per step beside them."""

    # Bytes at the start of a segment of ``size`` ranks that the counters and pairs take.
    @staticmethod
    def header_bytes(size: int) -> int:
        return size * _LINE + 2 * size * _LINE

    def __init__(
        self,
        mapped: mmap.mmap,
        rank: int,
        size: int,
        global_ranks: list[int],
        peers: list[tuple[int, int]],
    ):
        self.size = size
        self.rank = rank
        self.global_ranks = global_ranks
        self._peers = peers  # (pid, start time) per rank of the communicator
        self._epoch = 0
        self._map = mapped
        self._words = memoryview(mapped).cast("q")  # plain loads and stores, no numpy call
        self._counter = [r * _WORDS for r in range(size)]
        base = size * _LINE // 8
        # fingerprint pair of rank r for epoch parity p at word base + (p * size + r) * _WORDS
        self._fp_base = base
        self._firsts = [[base + (p * size + r) * _WORDS for r in range(size)] for p in range(2)]

    # -- waiting ---------------------------------------------------------------------------

    def _post(self) -> int:
        """Tell the others this rank reached the next step; returns the step's number."""
        self._epoch += 1
        self._words[self._counter[self.rank]] = self._epoch
        return self._epoch

    def _wait(self, epoch: int, what: Callable[[], str]) -> None:
        words = self._words
        for r in range(self.size):
            if words[self._counter[r]] < epoch:
                self._wait_for(r, epoch, what)

    def _wait_for(self, peer: int, epoch: int, what: Callable[[], str]) -> None:
        words, index = self._words, self._counter[peer]
        spins = 0
        start = checked = time.monotonic()
        while words[index] < epoch:
            spins += 1
            if spins < _SPINS:
                continue
            if spins % 64:
                os.sched_yield()
                continue
            now = time.monotonic()
            if now - checked > _LIVENESS_EVERY_S:
                checked = now
                self._check_alive(peer, what)
            if now - start > _SLEEP_AFTER_S:
                time.sleep(_SLEEP_S)
            else:
                os.sched_yield()

    def _check_alive(self, peer: int, what: Callable[[], str]) -> None:
        pid, started = self._peers[peer]
        if _start_time(pid) != started:
            time.sleep(DEAD_PEER_GRACE_S)
            kind = what().split("(", 1)[0]
            raise PeerExitedError(
                f"rank {self.global_ranks[peer]} (pid {pid}) exited while rank "
                f"{self.global_ranks[self.rank]} waited for it in `{kind}` on the shared-memory "
                f"path; the run cannot go on. Its own output says why it ended."
            )

    def _step(
        self, pair: tuple[int, int], what: Callable[[], str], first: bool
    ) -> tuple[int, int] | None:
        """Post, then wait for every rank. On a collective's first step this rank's agreement
        pair goes beside its data, and the result is None or, where the ranks' pairs differ,
        their max (see ``exchange``)."""
        epoch = self._epoch + 1
        if first:
            self._write_pair(epoch, pair)
        self._post()
        self._wait(epoch, what)
        return self._max_pair(epoch, pair) if first else None

    # -- agreement -------------------------------------------------------------------------

    def _write_pair(self, epoch: int, pair: tuple[int, int]) -> None:
        at = self._fp_base + ((epoch & 1) * self.size + self.rank) * _WORDS
        self._words[at] = pair[0]
        self._words[at + 1] = pair[1]

    def _max_pair(self, epoch: int, pair: tuple[int, int]) -> tuple[int, int] | None:
        """None when every rank wrote ``pair``; else the elementwise max over ranks.

        Pairs are ``(fp, -fp)`` with ``fp >= 0``, or ``(ABSENT, 1)`` from a joined rank
        (agreement.py): equal first words mean equal pairs."""
        words, at = self._words, self._fp_base + (epoch & 1) * self.size * _WORDS
        first = pair[0]
        if all(words[index] == first for index in self._firsts[epoch & 1]):
            return None
        pairs = [(words[at + r * _WORDS], words[at + r * _WORDS + 1]) for r in range(self.size)]
        return max(p[0] for p in pairs), max(p[1] for p in pairs)

    def exchange(self, pair: tuple[int, int], what: Callable[[], str]) -> tuple[int, int]:
        """The elementwise max of every rank's ``pair`` (what one MPI MAX allreduce of it
        gives), in one wait."""
        return self._step(pair, what, first=True) or pair


class Channel(Steps):
    """The shared segment of one communicator's ranks on one host (all of its ranks): after
    the counters, two small slots per rank, then two sets of chunk slots and result areas."""

    def __init__(self, comm: MPI.Comm, global_ranks: list[int], peers: list[tuple[int, int]]):
        size = comm.Get_size()
        header = Steps.header_bytes(size)
        small = 2 * size * SMALL_BYTES
        mapped = _shared_map(comm, header + small + 2 * (size + 1) * CHUNK_BYTES)
        super().__init__(mapped, comm.Get_rank(), size, global_ranks, peers)
        raw = np.frombuffer(mapped, np.uint8)
        self._small = [
            [raw[header + (p * size + r) * SMALL_BYTES :][:SMALL_BYTES] for r in range(size)]
            for p in range(2)
        ]
        offset = header + small
        # Two sets (chunks alternate): each rank's slot, then the set's result area.
        areas = [raw[offset + i * CHUNK_BYTES :][:CHUNK_BYTES] for i in range(2 * (size + 1))]
        # Each set's slots as one area, for a broadcast (one writer: bigger chunks, fewer
        # waits). Not the result areas: ranks copy the last result out after the last wait.
        whole = size * CHUNK_BYTES
        self._sets = [raw[offset + p * (whole + CHUNK_BYTES) :][:whole] for p in range(2)]
        self._slots = [areas[: size + 1], areas[size + 1 :]]
        self._results = [slots.pop() for slots in self._slots]
        self._views: dict[tuple[int, np.dtype, int], list[np.ndarray]] = {}

    # -- broadcast and allgather -------------------------------------------------------------

    def broadcast(
        self, buf: np.ndarray, root: int, pair: tuple[int, int], what: Callable[[], str]
    ) -> tuple[int, int] | None:
        """Copy ``root``'s bytes ``buf`` (1-D uint8, the same length on every rank) into
        every other rank's ``buf``. Up to ``SMALL_BYTES``: through the root's small slot, in
        one wait. Longer: in chunks as large as a set of slots; the root writes chunk k, every
        rank posts, and the others copy it out before they post again, so the root writes a
        set again only after every rank has read it. Returns as ``allreduce`` (a differing
        ``pair``: nothing was copied out)."""
        me_root = self.rank == root
        if buf.size <= SMALL_BYTES:
            slot = self._small[(self._epoch + 1) & 1][root][: buf.size]
            if me_root:
                slot[:] = buf
            differ = self._step(pair, what, first=True)
            if differ is None and not me_root:
                buf[:] = slot
            return differ
        step = self._sets[0].size
        for k, start in enumerate(range(0, buf.size, step)):
            stop = min(start + step, buf.size)
            area = self._sets[k & 1]
            if me_root:
                area[: stop - start] = buf[start:stop]
            differ = self._step(pair, what, first=k == 0)
            if differ is not None:
                return differ
            if not me_root:
                buf[start:stop] = area[: stop - start]
        self._wait(self._post(), what)  # every rank has read the last chunk
        return None

    def allgather(
        self, mine: np.ndarray, pair: tuple[int, int], what: Callable[[], str], allocate
    ) -> np.ndarray | tuple[int, int]:
        """Every rank's bytes ``mine`` (1-D uint8, lengths may differ), end to end in rank
        order, in the array ``allocate(lengths)`` returns (it gets each rank's byte count and
        returns the output and its bytes). The lengths ride on the first wait with ``pair``.
        A part up to ``SMALL_BYTES`` goes through its rank's small slot; when all parts do,
        that one wait is all. Returns the output, or the max pair when the ranks' pairs
        differ (nothing copied)."""
        size, rank, words = self.size, self.rank, self._words
        epoch = self._epoch + 1
        small = self._small[epoch & 1]
        first = small if mine.size <= SMALL_BYTES else self._slots[0]
        first[rank][: min(mine.size, CHUNK_BYTES)] = mine[:CHUNK_BYTES]
        at = self._fp_base + ((epoch & 1) * size + rank) * _WORDS + 2
        words[at] = mine.size  # beside the pair, in the same wait
        differ = self._step(pair, what, first=True)
        if differ is not None:
            return differ
        at -= rank * _WORDS
        lengths = [words[at + r * _WORDS] for r in range(size)]
        out, out_bytes = allocate(lengths)
        offsets = [0] * size
        for r in range(1, size):
            offsets[r] = offsets[r - 1] + lengths[r - 1]
        if max(lengths) <= SMALL_BYTES:
            for r, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
                out_bytes[offset : offset + length] = mine if r == rank else small[r][:length]
            return out
        sources = [
            small[r] if n <= SMALL_BYTES else self._slots[0][r] for r, n in enumerate(lengths)
        ]
        self._gather(mine, out_bytes, offsets, lengths, what, own=True, sources=sources)
        return out

    def share(self, buf: np.ndarray, bounds: list[int], what: Callable[[], str]) -> None:
        """Rank r's bytes ``buf[bounds[r]:bounds[r + 1]]`` (1-D uint8) into every rank's
        ``buf``: an allgather in place."""
        lengths = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        mine = buf[bounds[self.rank] : bounds[self.rank + 1]]
        self._slots[0][self.rank][: min(mine.size, CHUNK_BYTES)] = mine[:CHUNK_BYTES]
        self._wait(self._post(), what)
        self._gather(mine, buf, bounds[:-1], lengths, what, own=False, sources=self._slots[0])

    def _gather(
        self,
        mine: np.ndarray,
        out: np.ndarray,
        offsets: list[int],
        lengths: list[int],
        what: Callable[[], str],
        own: bool,
        sources: list[np.ndarray],
    ) -> None:
        """Copy every rank's chunk k into ``out`` (this rank's own from ``mine``, if ``own``),
        then write chunk k+1 into the next set of slots and wait, until the longest part is
        out. Chunk 0 of rank r is in ``sources[r]`` on entry. A set is written again only
        after every rank has posted past its reads of it; the last wait frees the slots for
        the next collective."""
        rank = self.rank
        k = 0
        while True:
            start = k * CHUNK_BYTES
            slots = sources if k == 0 else self._slots[k & 1]
            for r, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
                n = min(CHUNK_BYTES, length - start)
                if n <= 0 or (r == rank and not own):
                    continue
                source = mine[start : start + n] if r == rank else slots[r][:n]
                out[offset + start :][:n] = source
            k += 1
            if k * CHUNK_BYTES >= max(lengths):
                break
            piece = mine[k * CHUNK_BYTES : (k + 1) * CHUNK_BYTES]
            self._slots[k & 1][rank][: piece.size] = piece
            self._wait(self._post(), what)
        self._wait(self._post(), what)  # every rank has read the last chunk

    # -- allreduce -------------------------------------------------------------------------

    def allreduce(
        self,
        src: np.ndarray | Pieces,
        dst: np.ndarray,
        ufunc: np.ufunc,
        divisor: int,
        pair: tuple[int, int],
        what: Callable[[], str],
    ) -> tuple[int, int] | None:
        """Reduce the 1-D ``src`` of every rank with ``ufunc`` into the 1-D ``dst`` (may be
        ``src``), divided by ``divisor`` unless it is 1. ``src`` may be given as ``Pieces``
        (a fusion buffer's parts, packed straight into the segment).

        ``pair`` is this rank's agreement pair (see ``exchange``), written beside the first
        data. Returns None when done, or, with nothing reduced, the max pair when the ranks'
        pairs differ (the caller raises or serves joined ranks).
        """
        nbytes = dst.nbytes
        if nbytes <= SMALL_BYTES:  # first: the latency of small messages is all overhead
            return self.allreduce_small(src, dst, ufunc, divisor, pair, what)
        pieces = [(0, src.view(np.uint8))] if isinstance(src, np.ndarray) else src
        dtype, itemsize, size, rank = dst.dtype, dst.itemsize, self.size, self.rank
        dst_bytes = dst.view(np.uint8)
        step = CHUNK_BYTES - CHUNK_BYTES % itemsize
        starts = range(0, nbytes, step)
        # One wait per chunk (see the module's docstring): after it, chunk k-1's result is
        # complete and every rank's chunk k is in its slot.
        for k, start in enumerate(starts):
            stop = min(start + step, nbytes)
            count = (stop - start) // itemsize
            lo = count * rank // size * itemsize  # this rank's share, on item boundaries
            hi = count * (rank + 1) // size * itemsize
            slots = self._slots[k & 1]
            # Only what the others reduce: this rank reads its share from ``src``.
            fill_pieces(pieces, slots[rank][:lo], start, start + lo)
            fill_pieces(pieces, slots[rank][hi : stop - start], start + hi, stop)
            differ = self._step(pair, what, first=k == 0)
            if differ is not None:
                return differ
            if k:
                self._copy_out(k - 1, starts[k - 1], start, dst_bytes, dtype, divisor)
            self._reduce_share(k & 1, pieces, start, lo, hi, ufunc, dtype)
        self._wait(self._post(), what)
        last = len(starts) - 1
        self._copy_out(last, starts[last], nbytes, dst_bytes, dtype, divisor)
        return None

    def _reduce_share(
        self,
        parity: int,
        pieces: Pieces,
        start: int,
        lo: int,
        hi: int,
        ufunc: np.ufunc,
        dtype: np.dtype,
    ) -> None:
        """Reduce bytes ``[lo, hi)`` of the chunk at ``start`` into its result, operands in
        rank order (whichever rank reduces a share, all get the same result); this rank's
        operand is read from its input, piece by piece."""
        slots, result, rank = self._slots[parity], self._results[parity], self.rank
        for at, own in _pieces_in(pieces, start + lo, start + hi):
            a, b = at - start, at - start + own.size
            parts = [(own if r == rank else slot[a:b]).view(dtype) for r, slot in enumerate(slots)]
            out = result[a:b].view(dtype)
            ufunc(parts[0], parts[1], out)
            for part in parts[2:]:
                ufunc(out, part, out)

    def _copy_out(
        self,
        k: int,
        start: int,
        stop: int,
        dst_bytes: np.ndarray,
        dtype: np.dtype,
        divisor: int,
    ) -> None:
        result = self._results[k & 1][: stop - start].view(dtype)
        target = dst_bytes[start:stop].view(dtype)
        if divisor == 1:
            np.copyto(target, result)
        else:
            np.divide(result, divisor, target)

    def allreduce_small(
        self,
        src: np.ndarray | Pieces,
        dst: np.ndarray,
        ufunc: np.ufunc,
        divisor: int,
        pair: tuple[int, int],
        what: Callable[[], str],
    ) -> tuple[int, int] | None:
        """``allreduce`` of at most ``SMALL_BYTES`` (what it calls for those), for callers
        that know the size: one wait, every rank reducing all of it."""
        epoch = self._epoch + 1
        slots = self._views.get((epoch & 1, dst.dtype, dst.size))
        if slots is None:
            slots = self._small_views(epoch & 1, dst.dtype, dst.size)
        if isinstance(src, np.ndarray):
            np.copyto(slots[self.rank], src)
        else:  # a fusion buffer's parts; zeros in the gaps, which are reduced here too
            mine = slots[self.rank].view(np.uint8)
            mine[:] = 0
            fill_pieces(src, mine, 0, dst.nbytes)
        # _write_pair, _post and _wait's first look, inlined: a 4 KB call is mostly overhead.
        words, at = self._words, self._fp_base + ((epoch & 1) * self.size + self.rank) * _WORDS
        words[at], words[at + 1] = pair
        self._epoch = epoch
        words[self._counter[self.rank]] = epoch
        for r, index in enumerate(self._counter):
            if words[index] < epoch:
                self._wait_for(r, epoch, what)
        first = pair[0]
        if first:  # 0: the argument check is off on every rank
            for index in self._firsts[epoch & 1]:  # _max_pair's look, inlined
                if words[index] != first:
                    return self._max_pair(epoch, pair)
        # Every rank reduces all of it, in rank order: the same result everywhere, one wait.
        # (``out`` given by position: the keyword took 1 us more a call, measured.)
        ufunc(slots[0], slots[1], dst)
        for r in range(2, self.size):
            ufunc(dst, slots[r], dst)
        if divisor != 1:
            np.divide(dst, divisor, dst)
        return None

    def _small_views(self, parity: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Each rank's small slot of ``parity`` as ``count`` items of ``dtype``: kept, since a
        training loop reduces the same few shapes over and over (making views costs more
        than the reduction of a few KB)."""
        key = (parity, dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            nbytes = count * dtype.itemsize
            views = [slot[:nbytes].view(dtype) for slot in self._small[parity]]
            self._views[key] = views
        return views


class Hierarchy:
    """Ranks on several hosts, the same number on each: an allreduce reduces within each
    host through the host's segment, then each rank of a host allreduces its slice of the
    host's result over MPI with the ranks of the same local rank on the other hosts (every
    rank carries a share of the traffic between hosts), then the ranks of a host share their
    slices through the segment (Horovod's hierarchical allreduce, on shared memory)."""

    def __init__(self, comm: MPI.Comm, local: Channel, cross: MPI.Comm):
        self.comm = comm
        self.local = local
        self.cross = cross

    def allreduce(
        self,
        src: np.ndarray | Pieces,
        dst: np.ndarray,
        ufunc: np.ufunc,
        divisor: int,
        pair: tuple[int, int],
        what: Callable[[], str],
    ) -> tuple[int, int] | None:
        """As ``Channel.allreduce``, the ranks having agreed already (over MPI, by the
        transport: ``pair`` is (0, 0)); returns None."""
        from mpi4py import MPI

        assert pair == (0, 0), "the hierarchy's agreement is the transport's"
        self.local.allreduce(src, dst, ufunc, 1, (0, 0), what)
        count, ranks, me = dst.size, self.local.size, self.local.rank
        bounds = [count * r // ranks for r in range(ranks + 1)]
        mine = dst[bounds[me] : bounds[me + 1]]
        if mine.size:
            self.cross.Allreduce(MPI.IN_PLACE, mine, _mpi_op_names()[ufunc.__name__])
        self.local.share(dst.view(np.uint8), [b * dst.itemsize for b in bounds], what)
        if divisor != 1:
            np.divide(dst, divisor, dst)
        return None


@functools.cache
def _mpi_op_names() -> dict[str, MPI.Op]:
    from mpi4py import MPI

    return {"add": MPI.SUM, "minimum": MPI.MIN, "maximum": MPI.MAX, "multiply": MPI.PROD}


# A message given as parts: (byte offset, its bytes as a 1-D uint8 array), in order. Bytes
# between parts (a fusion buffer's padding) are neither copied nor reduced on the long path,
# so the result holds anything there.
Pieces = list[tuple[int, np.ndarray]]


def _pieces_in(pieces: Pieces, start: int, stop: int) -> list[tuple[int, np.ndarray]]:
    """Bytes ``[start, stop)`` of the message ``pieces`` make up, as (byte offset, bytes)."""
    if len(pieces) == 1:  # one array: no search
        return [(start, pieces[0][1][start:stop])] if start < stop else []
    found = []
    i = bisect.bisect_right(pieces, start, key=_offset) - 1
    while i < len(pieces) and pieces[i][0] < stop:
        offset, part = pieces[i]
        lo, hi = max(start, offset), min(stop, offset + part.size)
        if lo < hi:
            found.append((lo, part[lo - offset : hi - offset]))
        i += 1
    return found


def _offset(piece: tuple[int, np.ndarray]) -> int:
    return piece[0]


def fill_pieces(pieces: Pieces, target: np.ndarray, start: int, stop: int) -> None:
    """Copy bytes ``[start, stop)`` of the message ``pieces`` make up to ``target[0:]``."""
    for at, part in _pieces_in(pieces, start, stop):
        target[at - start : at - start + part.size] = part


def _shared_map(comm: MPI.Comm, total: int) -> mmap.mmap:
    """A ``total``-byte mapping shared by the ranks of ``comm``; its file in ``/dev/shm`` is
    gone before this returns (only the mappings keep the memory)."""
    path, fd, error = "", -1, ""
    if comm.Get_rank() == 0:
        path = os.path.join(SHM_DIR, f"flyte-hvd-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            # Claimed now: a full /dev/shm is an error here, not a SIGBUS on first touch.
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            error = f"cannot create {total} bytes in {SHM_DIR}: {e}"
            if fd >= 0:
                os.close(fd)
                os.unlink(path)
    path, error = comm.bcast((path, error), root=0)
    if error:
        raise OSError(error)
    try:
        if comm.Get_rank() != 0:
            fd = os.open(path, os.O_RDWR)
        mapped = mmap.mmap(fd, total)
    finally:
        if fd >= 0:
            os.close(fd)
        comm.Barrier()  # every rank has mapped it (or failed to)
        if comm.Get_rank() == 0:
            os.unlink(path)
    return mapped


# -- one channel per communicator -------------------------------------------------------------

_channels: dict[int, Channel | Hierarchy | None] = {}


def channel(comm: MPI.Comm) -> Channel | Hierarchy | None:
    """The shared-memory channel of ``comm``, made on first use (collective: every rank of
    ``comm`` gets here in the same collective), or None where MPI carries the collectives."""
    key = comm.py2f()
    if key in _channels:
        return _channels[key]
    made = _make(comm)
    _channels[key] = made
    return made


def _make(comm: MPI.Comm) -> Channel | Hierarchy | None:
    from mpi4py import MPI

    wanted = state.shm_mode()
    if wanted == "off" or comm.Get_size() == 1:
        return None
    # A rank stores its data, then its counter, and the others read them in that order: x86
    # keeps stores in order; weaker memory models (ARM) would need fences Python cannot give.
    if platform.machine().lower() not in _STORE_ORDERED:
        _refuse(wanted, f"this CPU ({platform.machine()}) may reorder stores")
        return None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_sizes = comm.allgather(local.Get_size())
    one_host = local_sizes[0] == comm.Get_size()
    why = ""
    if not one_host and not state.hierarchical():
        why = f"the ranks run on more than one host and {state.HIERARCHICAL_ENV}=0"
    elif not one_host and (min(local_sizes) != max(local_sizes) or local_sizes[0] == 1):
        why = (
            f"the ranks run on more than one host, not the same number of them (at least 2) "
            f"on each (ranks per host, by rank: {local_sizes})"
        )
    found = why or _local_channel(comm, local)
    local_rank = local.Get_rank()
    local.Free()
    if isinstance(found, str):
        _refuse(wanted, found)
        return None
    if one_host:
        return found
    return Hierarchy(comm, found, comm.Split(local_rank, comm.Get_rank()))


def _local_channel(comm: MPI.Comm, local: MPI.Comm) -> Channel | str:
    """The channel of ``local`` (this host's ranks of ``comm``), or why there is none (the
    same answer on every rank of ``comm``)."""
    from mpi4py import MPI

    me = (os.getpid(), _start_time(os.getpid()) or 0)
    peers = local.allgather(me)
    global_ranks = local.allgather(state.rank())
    # Liveness needs the others' processes: ranks in other PID namespaces (containers of a
    # pod) cannot see them.
    visible = comm.allreduce(int(all(_start_time(pid) == t for pid, t in peers)), op=MPI.MIN)
    if not visible:
        return "the ranks cannot see one another's processes (separate PID namespaces)"
    try:
        made: Channel | str = Channel(local, global_ranks, peers)
    except OSError as e:
        made = str(e)
    failed = comm.allgather(made if isinstance(made, str) else "")
    return next((why for why in failed if why), made)


def _refuse(wanted: str, why: str) -> None:
    """Where the segment cannot serve: an error if it was asked for (``on``), else a note."""
    if wanted == "on":
        raise RuntimeError(
            f"{MODE_ENV}=on, but {why}; set {MODE_ENV}=auto to let MPI carry these collectives."
        )
    logger.debug("collectives on MPI, not shared memory: %s", why)


def forget(comm: MPI.Comm) -> None:
    """Drop ``comm``'s channel (before the communicator is freed, on every rank of it); its
    memory goes when the last view of it does, a hierarchy's communicator across hosts now."""
    made = _channels.pop(comm.py2f(), None)
    if isinstance(made, Hierarchy):
        made.cross.Free()


def forget_all() -> None:
    _channels.clear()


state.on_shutdown(forget_all, order=2)
