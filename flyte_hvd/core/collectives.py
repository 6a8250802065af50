"""Horovod's collectives on numpy buffers, over the communicator ``init()`` set up.

Arrays travel through mpi4py's buffer (uppercase) methods, never pickled. Before each
collective the ranks compare a fingerprint of what they were called with (op, dtype, shape,
root) in one tiny reduction, so a mismatch raises the same clear error on every rank instead
of hanging or corrupting memory. The same reduction tells the ranks whether some of them have
called ``join()``: those then take part in reductions with the op's identity (zeros for a sum)
and every other collective raises on every rank.

Every collective takes ``process_set=`` (default: all ranks; see ``process_sets.py``); each
has an ``*_async`` twin that runs on the background thread and returns a handle for
``synchronize``/``poll`` (``background.py``).
"""

from __future__ import annotations

import enum
import math
import os
import time
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import cloudpickle
import numpy as np

from flyte_hvd.core import background, process_sets, shm, state, timeline
from flyte_hvd.core.buffers import ALIGNMENT, MIN_POOLED_BYTES, pool
from flyte_hvd.core.checks import require_int
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.errors import CollectiveMismatchError
from flyte_hvd.core.process_sets import (
    ProcessSet,
    async_comm_of,
    comm_of,
    global_process_set,
    translate_root,
)
from flyte_hvd.core.types import UserValue

if TYPE_CHECKING:
    from mpi4py import MPI
    from numpy.typing import ArrayLike

FUSION_THRESHOLD_ENV = "HOROVOD_FUSION_THRESHOLD"
DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024
_IN_PLACE_BYTES = 8 << 20


class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_SUPPORTED_KINDS = "fiuc"
_MPI_OPS: dict[int, MPI.Op] = {}


def _mpi_ops() -> dict[int, MPI.Op]:
    if not _MPI_OPS:
        from mpi4py import MPI

        _MPI_OPS.update(
            {
                ReduceOp.AVERAGE: MPI.SUM,
                ReduceOp.SUM: MPI.SUM,
                ReduceOp.MIN: MPI.MIN,
                ReduceOp.MAX: MPI.MAX,
                ReduceOp.PRODUCT: MPI.PROD,
            }
        )
    return _MPI_OPS


def mpi_op(op: int) -> tuple[ReduceOp, MPI.Op]:
    """``(ReduceOp, MPI op)`` for a Horovod op; ``NotImplementedError`` for ``Adasum``,
    ``ValueError`` for anything else unknown."""
    known = _KNOWN_OPS.get(op) if isinstance(op, int) else None  # no enum call per collective
    if known is not None:
        return known
    found = _mpi_ops().get(op) if isinstance(op, int) else None
    if found is None:
        if op == ReduceOp.ADASUM:
            raise NotImplementedError(
                "`op=hvd.Adasum` is not supported by flyte-hvd; use hvd.Average or hvd.Sum."
            )
        raise ValueError(
            f"unknown reduction op {op!r}: expected one of hvd.Average, hvd.Sum, hvd.Min, "
            f"hvd.Max, hvd.Product."
        )
    _KNOWN_OPS[op] = (ReduceOp(op), found)
    return _KNOWN_OPS[op]


_KNOWN_OPS: dict[int, tuple[ReduceOp, MPI.Op]] = {}


def fusion_threshold() -> int:
    """Bytes per fusion buffer, from ``HOROVOD_FUSION_THRESHOLD`` (Horovod's default 128 MiB)."""
    raw = os.environ.get(FUSION_THRESHOLD_ENV)
    if raw is None:
        return DEFAULT_FUSION_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{FUSION_THRESHOLD_ENV}={raw!r}: expected a number of bytes (e.g. 67108864)."
        ) from None
    if value < 0:
        raise ValueError(
            f"{FUSION_THRESHOLD_ENV}={value}: expected bytes >= 0 (0 disables fusion)."
        )
    return value


def fusion_buckets(items: Sequence[tuple[Hashable, int]], threshold: int) -> list[list[int]]:
    """Indices of ``items`` (``(dtype, nbytes)`` pairs, any framework's dtype) grouped into
    fusion buffers: one dtype each, at most ``threshold`` bytes (a larger item gets a buffer of
    its own), order kept within a dtype. Buffers are listed in the order they close, then the
    open ones."""
    groups: list[list[int]] = []
    open_group: dict[Hashable, tuple[list[int], int]] = {}
    for i, (dtype, nbytes) in enumerate(items):
        members, used = open_group.get(dtype, ([], 0))
        if members and used + nbytes > threshold:
            groups.append(members)
            members, used = [], 0
        members.append(i)
        open_group[dtype] = (members, used + nbytes)
    groups.extend(members for members, _ in open_group.values() if members)
    return groups


def packed_offsets(counts: Sequence[int], itemsize: int) -> tuple[list[int], int]:
    """Where each of ``counts`` elements starts in a fusion buffer, and the buffer's length:
    every part starts on a 64-byte boundary, so TensorFlow can adopt a result without a copy."""
    step = max(1, ALIGNMENT // itemsize)
    offsets, total = [], 0
    for n in counts:
        offsets.append(total)
        total += -(-n // step) * step
    return offsets, total


def _as_array(value: ArrayLike, what: str, kinds: str = _SUPPORTED_KINDS) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in kinds:
        raise ValueError(
            f"`{what}` needs a numeric array (float, int, uint or complex); found dtype "
            f"{array.dtype}. Cast it first, e.g. `array.astype(np.float32)`."
        )
    return array


_COMPRESSION_IDS: dict[type, int] = {}


def _compression_id(compression: type[Compressor]) -> int:
    if compression not in _COMPRESSION_IDS:
        _COMPRESSION_IDS[compression] = zlib.crc32(compression.__qualname__.encode())
    return _COMPRESSION_IDS[compression]


def _fingerprint(fields: tuple) -> int:
    """Hash of ints and tuples of ints only: those hash alike in every process (str does not)."""
    return hash(fields) & 0x7FFFFFFFFFFFFFFF


def check_optimizer_args(backward_passes_per_step: int, op: int,
                         gradient_predivide_factor: float) -> None:  # fmt: skip
    """The checks every framework's ``DistributedOptimizer`` makes of its reduction args."""
    require_int("backward_passes_per_step", backward_passes_per_step, 1)
    if op == Adasum:
        mpi_op(op)  # the not-supported error
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer `op` must be hvd.Average or hvd.Sum; found {op!r}.")
    if gradient_predivide_factor <= 0:
        raise ValueError(
            f"`gradient_predivide_factor` must be > 0; found {gradient_predivide_factor}."
        )
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("`gradient_predivide_factor` applies only with op=hvd.Average.")


# -- agreement between ranks, and joined ranks -------------------------------------------------

# Agreement is one MAX reduction of [fingerprint, -fingerprint] (fingerprints are >= 0): equal
# fingerprints come back unchanged. A rank inside join() sends [_ABSENT, 1] instead: below every
# fingerprint, and above every -fingerprint, so the others see a positive second slot.
_ABSENT = np.iinfo(np.int64).min

# A reduction's wire buffers, for joined ranks to match: [(dtype str, element count, op)].
ReductionSpec = list[tuple[str, int, int]]
# What a collective tells ``check_same`` about the reduction that follows: its (op, wire
# array), or a function returning its ``ReductionSpec`` (several buffers).
Reduction = tuple[ReduceOp, np.ndarray] | Callable[[], ReductionSpec] | None


def check_same(
    comm: MPI.Comm,
    fields: tuple,
    describe: Callable[[], str],
    reduction: Reduction = None,
) -> None:
    """Agree with the other ranks of ``comm`` before a collective: one 16-byte MAX reduction.

    Raises ``CollectiveMismatchError`` on every rank if any rank's ``fields`` (ints and tuples
    of ints) differ; ``describe`` renders this rank's call for the message and runs only then.
    If some ranks have called ``join()``, a collective with a ``reduction`` (``(op, wire
    array)`` or a function returning the wire buffers' ``ReductionSpec``) goes ahead with them
    contributing the op's identity; any other collective raises on every rank.
    """
    if comm.Get_size() == 1 or not state.checks_collectives():
        return
    fp = _fingerprint(fields)
    _settle(comm, fp, _agree(comm, (fp, -fp), describe), describe, reduction)


def _agree(comm: MPI.Comm, pair: tuple[int, int], describe: Callable[[], str]) -> tuple[int, int]:
    """The elementwise max of every rank's ``pair``: in the shared segment where ``comm`` has
    one (every agreement on ``comm`` must then go there, joined ranks' too), else one MPI
    reduction."""
    channel = shm.channel(comm)
    if channel is not None:
        return channel.exchange(pair, describe)
    buf = np.array(pair, dtype=np.int64)
    comm.Allreduce(_in_place(), buf, _mpi_ops()[ReduceOp.MAX])
    return int(buf[0]), int(buf[1])


def _settle(
    comm: MPI.Comm,
    fp: int,
    agreed: tuple[int, int],
    describe: Callable[[], str],
    reduction: Reduction,
) -> None:
    """Go on (all ranks sent ``fp``), serve joined ranks, or raise the mismatch."""
    if agreed[0] == fp and -agreed[1] == fp:
        return
    if agreed[1] > 0:
        _meet_joined(comm, fp, describe, reduction)
    else:
        _raise_mismatch(comm.allgather(describe()))


def _raise_mismatch(descriptions: list[str | None]) -> None:
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(descriptions) if d is not None)
    kind = next(d for d in descriptions if d is not None).split("(", 1)[0]
    raise CollectiveMismatchError(
        f"ranks called `{kind}` with different arguments; every rank must pass the same "
        f"op, dtype and shape (except where the collective allows a ragged first dimension). "
        f"Found:\n{lines}"
    )


def _reduction_spec(reduction: Reduction) -> ReductionSpec | None:
    if reduction is None or callable(reduction):
        return None if reduction is None else reduction()
    op, wire = reduction
    return [(wire.dtype.str, int(wire.size), int(op))]


def _meet_joined(
    comm: MPI.Comm, fp: int, describe: Callable[[], str], reduction: Reduction
) -> None:
    """The active ranks' side of a collective while some ranks are inside ``join()``."""
    description = describe()
    entries = comm.allgather((fp, description, _reduction_spec(reduction)))  # joined: None
    active = [e for e in entries if e is not None]
    if len({e[0] for e in active}) > 1:
        _raise_mismatch([None if e is None else e[1] for e in entries])
    if reduction is None:
        joined = [r for r, e in enumerate(entries) if e is None]
        kind = description.split("(", 1)[0]
        raise CollectiveMismatchError(
            f"`{kind}` cannot run while rank(s) {joined} are inside hvd.join(): only "
            f"allreduce (and grouped_allreduce, the optimizers' reductions) goes on with "
            f"joined ranks. Call `{kind}` before hvd.join() on every rank."
        )


def _serve_joined_round(comm: MPI.Comm) -> int:
    """A joined rank's side of one collective of the active ranks: contribute the identity of
    the op to each of its reductions. Returns 1 if a reduction was served."""
    active = [e for e in comm.allgather(None) if e is not None]
    if len({e[0] for e in active}) != 1 or active[0][2] is None:
        return 0  # the active ranks raise
    for dtype_str, count, op in active[0][2]:
        rop, mop = mpi_op(op)
        buf = _identity(np.dtype(dtype_str), rop, count)
        comm.Allreduce(_in_place(), buf, mop)
    return 1


def _identity(dtype: np.dtype, op: ReduceOp, count: int) -> np.ndarray:
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return np.zeros(count, dtype)
    if op == ReduceOp.PRODUCT:
        return np.ones(count, dtype)
    info = np.finfo(dtype) if dtype.kind in "fc" else np.iinfo(dtype)
    if dtype.kind == "f":
        return np.full(count, np.inf if op == ReduceOp.MIN else -np.inf, dtype)
    return np.full(count, info.max if op == ReduceOp.MIN else info.min, dtype)


def _serve_until_all_joined(comm: MPI.Comm) -> int:
    """Take part in the active ranks' collectives on ``comm`` until every rank has joined;
    returns how many reductions this rank served."""
    served = 0
    while True:
        if _agree(comm, (_ABSENT, 1), lambda: "join()")[0] == _ABSENT:  # no rank is active
            return served
        served += _serve_joined_round(comm)


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; returns the rank that joined last (the same
    on every rank).

    Until every rank has joined, a joined rank takes part in the other ranks' allreduces
    (synchronous, ``*_async`` and optimizer reductions) with the op's identity (zeros for
    ``Sum``/``Average``, so an average is over all ranks); their other collectives raise
    ``CollectiveMismatchError`` on every rank. Collectives on process sets are not served.
    ``device`` is accepted for Horovod compatibility.

    With ``FLYTE_HVD_CHECK_COLLECTIVES=0`` there is no agreement step to serve from: every
    rank must then call ``join()`` with no collectives in between.
    """
    comm = state.comm()
    size = comm.Get_size()
    start = _begin()
    entered = time.time_ns()
    served = 0
    if size > 1 and state.checks_collectives():
        # Blocking and nonblocking collectives do not match in MPI, so each communicator is
        # served with blocking calls from its own thread: the background thread serves the
        # others' background collectives (after finishing this rank's own), this one the rest.
        handle = background.submit(_serve_until_all_joined, state.async_comm())
        served = _serve_until_all_joined(comm) + background.synchronize(handle)
    everyone = np.empty((size, 2), dtype=np.int64)
    comm.Allgather(np.array([served, entered], dtype=np.int64), everyone)
    _end("join", None, everyone.nbytes, start)
    # The last rank to join served nothing; among ranks that served equally, the latest.
    fewest = everyone[:, 0].min()
    candidates = [r for r in range(size) if everyone[r, 0] == fewest]
    return int(max(candidates, key=lambda r: everyone[r, 1]))


# -- helpers ---------------------------------------------------------------------------------


def _begin() -> int:
    return time.time_ns() if timeline.current() is not None else 0


def _end(kind: str, name: str | None, nbytes: int, start_ns: int) -> None:
    tl = timeline.current()
    if tl is not None:
        tl.record(kind, name, nbytes, start_ns)


def _scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array * factor`` in ``array``'s dtype: float16 is scaled in float32 and integers in
    float64 (then truncated toward zero), as Horovod does on the CPU."""
    if array.dtype.kind in "iu" or array.dtype == np.float16:
        math_dtype = np.float64 if array.dtype.kind in "iu" else np.float32
        scaled = array.astype(math_dtype) * math_dtype(factor)  # type: ignore[operator]
        return scaled.astype(array.dtype)
    return array * np.asarray(factor, dtype=array.dtype)


def _scale(array: np.ndarray, factor: float) -> np.ndarray:
    return array if factor == 1.0 else _scaled(array, factor)


def scale_in_place(array: np.ndarray, factor: float) -> None:
    """Multiply ``array`` by ``factor`` in place (dtype rules of ``_scaled``)."""
    if factor == 1.0:
        return
    if array.dtype.kind in "fc" and array.dtype != np.float16:
        array *= np.asarray(factor, dtype=array.dtype)
    else:
        array[...] = _scaled(array, factor)


def finish_average(buf: np.ndarray, size: int, op: ReduceOp) -> None:
    """Divide a summed ``buf`` by ``size`` if ``op`` is Average (integers round toward zero,
    as Horovod's do)."""
    if op is not ReduceOp.AVERAGE or size == 1:
        return
    if buf.dtype.kind in "fc":
        buf /= size
    else:
        buf -= np.fmod(buf, size)
        buf //= size


def average_as_sum(op: ReduceOp, gradient_predivide_factor: float, size: int, floating: bool):
    """``(op, prescale, postscale)`` for a reduction, folding ``Average`` into the scale
    factors for floating data so no extra pass divides the result.

    Horovod's ``gradient_predivide_factor`` f divides by f before the sum and by size/f after.
    """
    if op is not ReduceOp.AVERAGE or not floating:
        return op, 1.0, 1.0
    f = gradient_predivide_factor
    if f == 1.0:
        return ReduceOp.SUM, 1.0 / size, 1.0
    return ReduceOp.SUM, 1.0 / f, f / size


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE


def _mpi_type(dtype: np.dtype):
    from mpi4py import MPI

    return MPI._typedict[dtype.char]


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def _submit(
    process_set: ProcessSet, name: str | None, fn: Callable[[MPI.Comm], background.Result]
) -> background.Handle:
    return background.submit(fn, async_comm_of(process_set), name)


# -- allreduce -------------------------------------------------------------------------------


def allreduce(
    array: ArrayLike,
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """Reduce ``array`` across ranks; every rank gets the result as a new array.

    ``Average`` on integer arrays rounds toward zero. ``prescale_factor``/``postscale_factor``
    multiply the input before and the result after the reduction (integers in float64,
    truncated back).
    """
    return allreduce_on(
        comm_of(process_set), array, op, name, compression, prescale_factor, postscale_factor
    )


def allreduce_on(
    comm: MPI.Comm,
    array: ArrayLike,
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> np.ndarray:
    """``allreduce`` on the given communicator (what the process-set and async forms run)."""
    if (
        type(array) is np.ndarray
        and array.nbytes <= shm.SMALL_BYTES
        and compression is Compression.none
        and prescale_factor == 1.0
        and postscale_factor == 1.0
        and array.flags.c_contiguous
        and comm.Get_size() > 1
    ):
        done = _small_shared_allreduce(comm, array, op, name)
        if done is not None:
            return done
    arr = _as_array(array, "allreduce")
    op, _ = mpi_op(op)
    wire, ctx = compression.compress(arr)
    agreement: _Agreement = (
        (1, op, arr.dtype.num, arr.shape, _compression_id(compression)),
        _allreduce_text(op, arr.dtype, arr.shape, compression),
        (op, wire),
    )
    wire = np.asarray(_scale(wire, prescale_factor), order="C")
    small = wire.nbytes < MIN_POOLED_BYTES  # the pool's bookkeeping is a tenth of a 4 KB call
    out = np.empty(wire.shape, wire.dtype) if small else pool.empty(wire.shape, wire.dtype)
    _reduce(comm, agreement, op, wire, out, "allreduce", name)
    scale_in_place(out, postscale_factor)
    return compression.decompress(out, ctx)


def _allreduce_text(
    op: ReduceOp, dtype: np.dtype, shape: tuple[int, ...], compression: type[Compressor]
) -> Callable[[], str]:
    """How an allreduce's arguments read in a mismatch error (made only when one is raised)."""
    return lambda: (
        f"allreduce(op={op.name}, dtype={dtype}, shape={shape}, compression={compression.__name__})"
    )


def _small_shared_allreduce(
    comm: MPI.Comm, arr: np.ndarray, op: ReduceOp, name: str | None
) -> np.ndarray | None:
    """``allreduce_on`` of a small, C-contiguous, uncompressed and unscaled array through
    ``comm``'s shared-memory segment, or None where that path does not apply (the general
    one then runs and raises what it raises). The same steps, agreement and result as the
    general path, with what depends only on the kind of call (op, dtype, shape) worked out
    once per channel: at 4 KB the general path's per-call work took longer than the
    reduction itself (measured: 9 of 16 us)."""
    if type(op) is not ReduceOp and type(op) is not int:  # not a float equal to an op
        return None
    channel = shm.channel(comm)
    if type(channel) is not shm.Channel:
        return None
    key = (op, arr.dtype, arr.shape)
    plan = channel.plans.get(key)
    if plan is None:
        plan = _small_plan(channel, op, arr)
        if plan is None:
            return None
        if len(channel.plans) >= _MAX_PLANS:
            channel.plans.clear()
        channel.plans[key] = plan
    reduce_op, pair, ufunc, divisor, average_after, describe = plan
    out = np.empty(arr.shape, arr.dtype)
    start = _begin()
    differ = channel.allreduce_small(
        arr.reshape(-1) if arr.ndim != 1 else arr,
        out.reshape(-1) if out.ndim != 1 else out,
        ufunc, divisor, pair, describe,
    )  # fmt: skip
    if differ is None:
        _end("allreduce", name, out.nbytes, start)
        if average_after:
            finish_average(out, channel.size, ReduceOp.AVERAGE)
        return out
    _settle(comm, pair[0], differ, describe, (reduce_op, arr))  # raises unless ranks joined
    _reduce_over_mpi(comm, reduce_op, arr, out, "allreduce", name)
    return out


_MAX_PLANS = 256  # kinds of small allreduce kept per channel


def _small_plan(channel: shm.Channel, op: ReduceOp, arr: np.ndarray) -> tuple | None:
    """``(op, pair, ufunc, divisor, average_after, describe)`` for a small allreduce of ``op``
    on arrays like ``arr``, or None where the shared path does not take it."""
    known = _KNOWN_OPS.get(op)
    if known is None or arr.dtype.kind not in "fiu":
        return None
    op = known[0]
    fp = (
        _fingerprint((1, op, arr.dtype.num, arr.shape, _compression_id(Compression.none)))
        if state.checks_collectives()
        else 0
    )
    # As ``_reduce``: floats are divided while copied out; integers after (toward zero).
    floating = arr.dtype.kind == "f"
    divisor = channel.size if op is ReduceOp.AVERAGE and floating else 1
    average_after = op is ReduceOp.AVERAGE and not floating
    describe = _allreduce_text(op, arr.dtype, arr.shape, Compression.none)
    return op, (fp, -fp), shm.UFUNCS[op], divisor, average_after, describe


def _pieces(parts: list[np.ndarray], offsets: list[int], itemsize: int) -> shm.Pieces:
    """A fusion buffer's parts as ``shm.Pieces``. The padding between parts is left out: no
    rank copies or reduces it (a numpy call per gap cost as much as one per part), and no
    result is a view of it, so what it holds is never read or scaled."""
    return [
        (offset * itemsize, part.reshape(-1).view(np.uint8))
        for part, offset in zip(parts, offsets, strict=True)
    ]


def _shared_channel(comm: MPI.Comm) -> shm.Channel | shm.Hierarchy | None:
    return shm.channel(comm) if comm.Get_size() > 1 else None


def _host_channel(comm: MPI.Comm) -> shm.Channel | None:
    """``comm``'s segment where all of its ranks share it (not a ``Hierarchy``)."""
    channel = _shared_channel(comm)
    return channel if isinstance(channel, shm.Channel) else None


# What the ranks agree on before a reduction: ``check_same``'s fields, describe, reduction.
_Agreement = tuple[tuple, Callable[[], str], Reduction]


def _reduce(
    comm: MPI.Comm,
    agreement: _Agreement | None,
    op: ReduceOp,
    wire: np.ndarray | shm.Pieces,
    out: np.ndarray,
    kind: str,
    name: str | None,
    shared: bool = True,
) -> bool:
    """Reduce the C-contiguous ``wire`` of every rank of ``comm`` into ``out`` (``wire``
    itself for in place), averaged for ``Average``, once the ranks agree (``agreement``; None:
    they already did). Returns whether it went through shared memory (``shared=False``
    forbids it: later buffers of a reduction whose first one went over MPI).

    On the shared-memory path the agreement rides on the reduction's first wait; where ranks
    have joined, the reduction goes over MPI, which they serve. ``wire`` may be the parts of
    a fusion buffer (``shm.Pieces``, only where the path is shared memory; ``out`` is then
    packed from them for MPI).
    """
    size = comm.Get_size()
    channel = shm.channel(comm) if shared and size > 1 else None
    if isinstance(channel, shm.Hierarchy) and out.nbytes < shm.HIERARCHICAL_MIN_BYTES:
        channel = None  # short messages: MPICH's own algorithm is faster across hosts
    if channel is not None and (out.dtype.kind != "c" or op not in (ReduceOp.MIN, ReduceOp.MAX)):
        fp = _fingerprint(agreement[0]) if agreement and state.checks_collectives() else 0
        describe = agreement[1] if agreement else (lambda: kind)
        # Floats are divided while copied out; integers after (rounded toward zero).
        divisor = size if op is ReduceOp.AVERAGE and out.dtype.kind in "fc" else 1
        start = _begin()
        src = wire.reshape(-1) if isinstance(wire, np.ndarray) and wire.ndim != 1 else wire
        flat = out if out.ndim == 1 else out.reshape(-1)
        differ = channel.allreduce(src, flat, shm.UFUNCS[op], divisor, (fp, -fp), describe)
        if differ is None:
            _end(kind, name, out.nbytes, start)
            if divisor == 1 and op is ReduceOp.AVERAGE:
                finish_average(out, size, op)
            return True
        assert agreement is not None  # only a fingerprint can differ
        _settle(comm, fp, differ, describe, agreement[2])  # raises unless ranks joined
    elif agreement is not None:
        check_same(comm, *agreement)
    if not isinstance(wire, np.ndarray):  # a fusion buffer's parts: pack them for MPI
        shm.fill_pieces(wire, out.reshape(-1).view(np.uint8), 0, out.nbytes)
        wire = out
    _reduce_over_mpi(comm, op, wire, out, kind, name)
    return False


def _reduce_over_mpi(
    comm: MPI.Comm, op: ReduceOp, wire: np.ndarray, out: np.ndarray, kind: str, name: str | None
) -> None:
    """``_reduce``'s MPI path, once the ranks agree."""
    mop = _mpi_ops()[op]
    start = _begin()
    if out is wire:
        comm.Allreduce(_in_place(), out, mop)
    elif out.nbytes >= _IN_PLACE_BYTES:
        # Copy, then reduce in place: measured faster than MPICH's out-of-place path.
        np.copyto(out, wire)
        comm.Allreduce(_in_place(), out, mop)
    else:
        comm.Allreduce(wire, out, mop)
    _end(kind, name, out.nbytes, start)
    finish_average(out, comm.Get_size(), op)


def grouped_allreduce(
    arrays: Sequence[ArrayLike],
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[np.ndarray]:
    """Reduce many arrays with as few reductions as the fusion threshold allows.

    Arrays of one wire dtype are packed, in order, into fusion buffers of at most
    ``HOROVOD_FUSION_THRESHOLD`` bytes (an array larger than that travels alone), each buffer
    is reduced in place with one MPI call, and the results are views into those buffers.
    """
    return grouped_allreduce_on(
        comm_of(process_set), arrays, op, name, compression, prescale_factor, postscale_factor
    )


def grouped_allreduce_on(
    comm: MPI.Comm,
    arrays: Sequence[ArrayLike],
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[np.ndarray]:
    """``grouped_allreduce`` on the given communicator."""
    arrs = [_as_array(a, "grouped_allreduce") for a in arrays]
    op, _ = mpi_op(op)
    compressed = [compression.compress(a) for a in arrs]
    wires = [c[0] for c in compressed]
    buckets = fusion_buckets([(w.dtype, w.nbytes) for w in wires], fusion_threshold())
    layouts = [
        (members, *packed_offsets([wires[i].size for i in members], wires[members[0]].itemsize))
        for members in buckets
    ]

    def spec() -> ReductionSpec:
        return [(wires[m[0]].dtype.str, total, int(op)) for m, _, total in layouts]

    first: _Agreement = (
        (2, op, _compression_id(compression), tuple((a.dtype.num, a.shape) for a in arrs)),
        lambda: (
            f"grouped_allreduce(op={op.name}, compression={compression.__name__}, "
            f"arrays={[(str(a.dtype), a.shape) for a in arrs]})"
        ),
        spec,
    )
    if not layouts:  # nothing to reduce, but the ranks still agree on that
        check_same(comm, *first)
    agreement: _Agreement | None = first
    results: list[np.ndarray | None] = [None] * len(arrs)
    shared = _shared_channel(comm) is not None
    for members, offsets, total in layouts:
        dtype = wires[members[0]].dtype
        buf = pool.empty((total,), dtype)
        if shared:  # the parts go straight into the shared segment: no packing pass
            parts = [np.ascontiguousarray(_scale(wires[i], prescale_factor)) for i in members]
            src: np.ndarray | shm.Pieces = _pieces(parts, offsets, dtype.itemsize)
        else:
            for i, offset, end in zip(members, offsets, [*offsets[1:], total], strict=True):
                part = wires[i]
                buf[offset : offset + part.size] = part.reshape(-1)
                buf[offset + part.size : end] = 0
            scale_in_place(buf, prescale_factor)
            src = buf
        # The first buffer carries the agreement; the others follow its path.
        if not _reduce(comm, agreement, op, src, buf, "grouped_allreduce", name, shared):
            shared = False
        agreement = None
        for i, offset in zip(members, offsets, strict=True):
            part, ctx = compressed[i]
            view = buf[offset : offset + part.size].reshape(part.shape)
            scale_in_place(view, postscale_factor)  # the parts only: padding holds anything
            results[i] = compression.decompress(view, ctx)
    return results  # type: ignore[return-value]


def reduce_in_place(
    comm: MPI.Comm,
    flat: np.ndarray,
    op: ReduceOp,
    compression: type[Compressor],
    postscale_factor: float,
    name: str | None,
    describe: Callable[[], str],
) -> None:
    """Reduce the 1-D ``flat`` across the ranks of ``comm`` in place, with one MPI call: the
    primitive under the optimizers' gradient buckets and ``allreduce_async_``.

    Any prescaling has already been applied by the caller (folded into the copy that filled
    ``flat``). The ranks first agree on (op, dtype, length, compression); ``describe`` renders
    this rank's call for the error raised on a mismatch.
    """
    op, _ = mpi_op(op)
    wire, ctx = compression.compress(flat)
    wire = np.ascontiguousarray(wire)
    fields = (8, op, flat.dtype.num, flat.shape, _compression_id(compression))
    _reduce(comm, (fields, describe, (op, wire)), op, wire, wire, "allreduce", name)
    scale_in_place(wire, postscale_factor)
    if wire is not flat:
        flat[...] = compression.decompress(wire, ctx)


# -- allgather, broadcast, alltoall, reducescatter ----------------------------------------------


def allgather(
    array: ArrayLike, name: str | None = None, process_set: ProcessSet = global_process_set
) -> np.ndarray:
    """Concatenate every rank's array along the first dimension, in rank order.

    The first dimension may differ between ranks (ragged); the others and the dtype may not.
    A 0-dim array counts as one row.
    """
    return allgather_on(comm_of(process_set), array, name)


def allgather_on(comm: MPI.Comm, array: ArrayLike, name: str | None = None) -> np.ndarray:
    """``allgather`` on the given communicator."""
    arr = np.asarray(_as_array(array, "allgather"), order="C")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    fields = (3, arr.dtype.num, arr.shape[1:])

    def describe() -> str:
        return f"allgather(dtype={arr.dtype}, shape=(*, {arr.shape[1:]}))"

    row_items = math.prod(arr.shape[1:])
    channel = _host_channel(comm) if row_items else None  # else: rows of no bytes
    if channel is not None:
        row_bytes = row_items * arr.itemsize

        def allocate(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
            out = pool.empty((sum(lengths) // row_bytes, *arr.shape[1:]), arr.dtype)
            return out, out.reshape(-1).view(np.uint8)

        fp = _fingerprint(fields) if state.checks_collectives() else 0
        start = _begin()
        got = channel.allgather(arr.reshape(-1).view(np.uint8), (fp, -fp), describe, allocate)
        if isinstance(got, np.ndarray):
            _end("allgather", name, got.nbytes, start)
            return got
        _settle(comm, fp, got, describe, None)  # raises: a mismatch, or joined ranks
    check_same(comm, fields, describe)
    size = comm.Get_size()
    rows = np.empty(size, dtype=np.int64)
    comm.Allgather(np.array([arr.shape[0]], dtype=np.int64), rows)
    out = pool.empty((int(rows.sum()), *arr.shape[1:]), arr.dtype)
    start = _begin()
    mpi_type = _mpi_type(arr.dtype)
    if (rows == rows[0]).all():
        # Equal parts (the common case): MPICH's Allgatherv over TCP took twice Allgather's
        # time from 1 MB (2 ranks on 2 hosts: 16 MB 18.3-18.6 ms against 9.5-11.1 ms).
        comm.Allgather([arr, mpi_type], [out, mpi_type])
    else:
        counts = rows * row_items
        comm.Allgatherv(arr, [out, counts, _displacements(counts), mpi_type])
    _end("allgather", name, out.nbytes, start)
    return out


def grouped_allgather(
    arrays: Sequence[ArrayLike],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[np.ndarray]:
    """``allgather`` of each array, in order."""
    comm = comm_of(process_set)
    return [allgather_on(comm, a, name) for a in arrays]


def broadcast(
    array: ArrayLike,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """Every rank gets ``root_rank``'s array (same shape and dtype on every rank; numbers or
    booleans).

    ``root_rank`` is a global rank, also with a ``process_set``.
    """
    root = translate_root(process_set, _check_root(root_rank, "broadcast"))
    return broadcast_on(comm_of(process_set), array, root, name)


def _check_root(root_rank: object, what: str) -> int:
    size = state.size()
    if not isinstance(root_rank, int | np.integer) or not 0 <= root_rank < size:
        raise ValueError(
            f"`{what}` root_rank={root_rank!r} does not exist: expected an int in [0, {size - 1}] "
            f"(size is {size})."
        )
    return int(root_rank)


def broadcast_on(
    comm: MPI.Comm, array: ArrayLike, root: int, name: str | None = None
) -> np.ndarray:
    """``broadcast`` on the given communicator (``root`` is a rank of ``comm``)."""
    arr = _as_array(array, "broadcast", _SUPPORTED_KINDS + "b")  # a copy: booleans too
    fields = (4, arr.dtype.num, arr.shape, root)

    def describe() -> str:
        return f"broadcast(dtype={arr.dtype}, shape={arr.shape}, root_rank={root})"

    out = pool.empty(arr.shape, arr.dtype)
    if comm.Get_rank() == root:
        out[...] = arr
    channel = _host_channel(comm)
    if channel is not None:
        fp = _fingerprint(fields) if state.checks_collectives() else 0
        start = _begin()
        differ = channel.broadcast(out.reshape(-1).view(np.uint8), root, (fp, -fp), describe)
        if differ is None:
            _end("broadcast", name, out.nbytes, start)
            return out
        _settle(comm, fp, differ, describe, None)  # raises: a mismatch, or joined ranks
    check_same(comm, fields, describe)
    start = _begin()
    comm.Bcast(out, root=root)
    _end("broadcast", name, out.nbytes, start)
    return out


def _send_rows(arr: np.ndarray, splits: Sequence[int] | np.ndarray | None, size: int) -> np.ndarray:
    if arr.ndim == 0:
        raise ValueError("`alltoall` needs an array with at least one dimension; found a scalar.")
    if splits is None:
        if arr.shape[0] % size:
            raise ValueError(
                f"`alltoall` without `splits` divides the first dimension evenly, but "
                f"{arr.shape[0]} rows do not divide by size {size}; pass `splits`."
            )
        return np.full(size, arr.shape[0] // size, dtype=np.int64)
    raw = np.asarray(splits).reshape(-1)
    if raw.dtype.kind not in "iu":
        raise ValueError(
            f"`alltoall` splits must be integers (rows per rank); found dtype {raw.dtype}: "
            f"{raw.tolist()}."
        )
    send_rows = raw.astype(np.int64)
    if send_rows.size != size or (send_rows < 0).any() or send_rows.sum() != arr.shape[0]:
        raise ValueError(
            f"`alltoall` splits={send_rows.tolist()}: expected {size} non-negative ints summing "
            f"to the first dimension ({arr.shape[0]})."
        )
    return send_rows


def alltoall(
    array: ArrayLike,
    splits: Sequence[int] | np.ndarray | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows (first dimension) of ``array`` to rank ``i`` of the set.

    Without ``splits`` the first dimension is divided evenly. Returns the rows received from
    every rank, concatenated in rank order, and how many rows came from each rank.
    """
    return alltoall_on(comm_of(process_set), array, splits, name)


def alltoall_on(
    comm: MPI.Comm,
    array: ArrayLike,
    splits: Sequence[int] | np.ndarray | None = None,
    name: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``alltoall`` on the given communicator."""
    size = comm.Get_size()
    arr = np.asarray(_as_array(array, "alltoall"), order="C")
    send_rows = _send_rows(arr, splits, size)
    check_same(
        comm,
        (5, arr.dtype.num, arr.shape[1:]),
        lambda: f"alltoall(dtype={arr.dtype}, shape=(*, {arr.shape[1:]}))",
    )
    recv_rows = np.empty(size, dtype=np.int64)
    comm.Alltoall(send_rows, recv_rows)
    row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
    out = np.empty((int(recv_rows.sum()), *arr.shape[1:]), dtype=arr.dtype)
    send_counts, recv_counts = send_rows * row_items, recv_rows * row_items
    mpi_type = _mpi_type(arr.dtype)
    start = _begin()
    comm.Alltoallv(
        [arr, send_counts, _displacements(send_counts), mpi_type],
        [out, recv_counts, _displacements(recv_counts), mpi_type],
    )
    _end("alltoall", name, out.nbytes, start)
    return out, recv_rows


def reducescatter(
    array: ArrayLike,
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """Reduce across ranks, then give rank ``i`` its slice of the first dimension.

    Rows are divided as evenly as possible; the first ``rows % size`` ranks get one more.
    """
    return reducescatter_on(
        comm_of(process_set), array, op, name, prescale_factor, postscale_factor
    )


def reducescatter_on(
    comm: MPI.Comm,
    array: ArrayLike,
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> np.ndarray:
    """``reducescatter`` on the given communicator."""
    size, rank = comm.Get_size(), comm.Get_rank()
    arr = np.asarray(_as_array(array, "reducescatter"), order="C")
    op, mop = mpi_op(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"`reducescatter` supports hvd.Average and hvd.Sum; found {op.name}.")
    if arr.ndim == 0:
        raise ValueError("`reducescatter` needs at least one dimension; found a scalar.")
    check_same(
        comm,
        (6, op, arr.dtype.num, arr.shape),
        lambda: f"reducescatter(op={op.name}, dtype={arr.dtype}, shape={arr.shape})",
    )
    arr = np.ascontiguousarray(_scale(arr, prescale_factor))
    base, extra = divmod(arr.shape[0], size)
    rows = np.array([base + (1 if r < extra else 0) for r in range(size)], dtype=np.int64)
    row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
    out = np.empty((int(rows[rank]), *arr.shape[1:]), dtype=arr.dtype)
    start = _begin()
    comm.Reduce_scatter(arr, out, recvcounts=(rows * row_items).tolist(), op=mop)
    _end("reducescatter", name, out.nbytes, start)
    finish_average(out, size, op)
    scale_in_place(out, postscale_factor)
    return out


def grouped_reducescatter(
    arrays: Sequence[ArrayLike],
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[np.ndarray]:
    """``reducescatter`` of each array, in order (every array checked before any is sent)."""
    arrs = [np.asarray(_as_array(a, "grouped_reducescatter")) for a in arrays]
    if any(a.ndim == 0 for a in arrs):
        raise ValueError(
            "`grouped_reducescatter` needs arrays with at least one dimension; found a scalar."
        )
    comm = comm_of(process_set)
    return [reducescatter_on(comm, a, op, name, prescale_factor, postscale_factor) for a in arrs]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of ``process_set``) reaches this call."""
    comm = comm_of(process_set)
    check_same(comm, (8,), lambda: "barrier()")
    start = _begin()
    comm.Barrier()
    _end("barrier", None, 0, start)


# -- process sets (collective over all ranks) ------------------------------------------------


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective over all ranks: each must call it, with the same
    ranks, in the same order). Returns the registered ``ProcessSet``."""
    from mpi4py import MPI

    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps is global_process_set or ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered.")
    world = state.comm()
    size = world.Get_size()
    ranks = ps.ranks
    if ranks[-1] >= size:
        raise ValueError(f"process set ranks {ranks} do not exist: size is {size}.")
    if ranks == list(range(size)) or any(p.ranks == ranks for p in process_sets.registered()):
        raise ValueError(
            f"a process set with ranks {ranks} is already registered; reuse it "
            f"(hvd.global_process_set for all ranks)."
        )
    check_same(world, (9, tuple(ranks)), lambda: f"add_process_set(ranks={ranks})")
    member = world.Get_rank() in ranks
    sub = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
    if member:
        ps.comm = sub
        ps.async_comm = sub.Dup()
    process_sets.register(ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and free its communicators (call on every rank). Returns
    whether it was registered."""
    if process_set is global_process_set:
        raise ValueError("hvd.global_process_set cannot be removed.")
    if not process_sets.unregister(process_set):
        return False
    process_sets.free(process_set)
    return True


# -- objects -------------------------------------------------------------------------------------


def broadcast_object(
    obj: UserValue,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> UserValue:
    """Every rank gets ``root_rank``'s object (cloudpickled, so lambdas travel too)."""
    root = translate_root(process_set, _check_root(root_rank, "broadcast_object"))
    comm = comm_of(process_set)
    check_same(comm, (7, root), lambda: f"broadcast_object(root_rank={root_rank})")
    payload = cloudpickle.dumps(obj) if comm.Get_rank() == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    comm.Bcast(length, root=root)
    buf = bytearray(payload) if comm.Get_rank() == root else bytearray(int(length[0]))
    start = _begin()
    comm.Bcast(buf, root=root)
    _end("broadcast_object", name, len(buf), start)
    return obj if comm.Get_rank() == root else cloudpickle.loads(bytes(buf))


def allgather_object(
    obj: UserValue, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[UserValue]:
    """Every rank's object, in rank order (cloudpickled)."""
    comm = comm_of(process_set)
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    size = comm.Get_size()
    lengths = np.empty(size, dtype=np.int64)
    comm.Allgather(np.array([payload.size], dtype=np.int64), lengths)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    start = _begin()
    comm.Allgatherv(payload, [out, lengths, _displacements(lengths), _mpi_type(out.dtype)])
    _end("allgather_object", name, out.nbytes, start)
    offsets = _displacements(lengths)
    return [
        cloudpickle.loads(out[o : o + n].tobytes()) for o, n in zip(offsets, lengths, strict=True)
    ]


# -- async ---------------------------------------------------------------------------------------


def _copy(array: ArrayLike, what: str) -> np.ndarray:
    return np.array(_as_array(array, what), copy=True, order="C")


def allreduce_async(
    array: ArrayLike,
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``allreduce`` on the background thread: returns a handle; ``synchronize(handle)``
    gives the result. The input is copied first, so it may change meanwhile."""
    arr = _copy(array, "allreduce_async")
    mpi_op(op)
    return _submit(
        process_set, name,
        lambda c: allreduce_on(c, arr, op, name, compression, prescale_factor, postscale_factor),
    )  # fmt: skip


def grouped_allreduce_async(
    arrays: Sequence[ArrayLike],
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``grouped_allreduce`` on the background thread (see ``allreduce_async``)."""
    arrs = [_copy(a, "grouped_allreduce_async") for a in arrays]
    mpi_op(op)
    return _submit(
        process_set, name,
        lambda c: grouped_allreduce_on(
            c, arrs, op, name, compression, prescale_factor, postscale_factor
        ),
    )  # fmt: skip


def allgather_async(
    array: ArrayLike, name: str | None = None, process_set: ProcessSet = global_process_set
) -> background.Handle:
    """``allgather`` on the background thread (see ``allreduce_async``)."""
    arr = _copy(array, "allgather_async")
    return _submit(process_set, name, lambda c: allgather_on(c, arr, name))


def grouped_allgather_async(
    arrays: Sequence[ArrayLike],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``grouped_allgather`` on the background thread (see ``allreduce_async``)."""
    arrs = [_copy(a, "grouped_allgather_async") for a in arrays]
    return _submit(process_set, name, lambda c: [allgather_on(c, a, name) for a in arrs])


def broadcast_async(
    array: ArrayLike,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``broadcast`` on the background thread (see ``allreduce_async``)."""
    arr = _copy(array, "broadcast_async")
    root = translate_root(process_set, _check_root(root_rank, "broadcast_async"))
    return _submit(process_set, name, lambda c: broadcast_on(c, arr, root, name))


def alltoall_async(
    array: ArrayLike,
    splits: Sequence[int] | np.ndarray | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``alltoall`` on the background thread (see ``allreduce_async``)."""
    arr = _copy(array, "alltoall_async")
    _send_rows(arr, splits, process_set.size())  # bad splits fail here, not on the thread
    return _submit(process_set, name, lambda c: alltoall_on(c, arr, splits, name))


def reducescatter_async(
    array: ArrayLike,
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``reducescatter`` on the background thread (see ``allreduce_async``)."""
    arr = _copy(array, "reducescatter_async")
    mpi_op(op)
    return _submit(
        process_set, name,
        lambda c: reducescatter_on(c, arr, op, name, prescale_factor, postscale_factor),
    )  # fmt: skip


def grouped_reducescatter_async(
    arrays: Sequence[ArrayLike],
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``grouped_reducescatter`` on the background thread (see ``allreduce_async``)."""
    arrs = [_copy(a, "grouped_reducescatter_async") for a in arrays]
    mpi_op(op)
    return _submit(
        process_set, name,
        lambda c: [
            reducescatter_on(c, a, op, name, prescale_factor, postscale_factor) for a in arrs
        ],
    )  # fmt: skip


synchronize = background.synchronize
poll = background.poll
