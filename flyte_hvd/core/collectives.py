"""Horovod's collectives on numpy buffers, over the communicator ``init()`` set up.

This module is the API: it checks the arguments, fuses many arrays into few buffers
(``fusion.py``), compresses and scales (``reduce_ops.py``), and hands the buffers to the
communicator's transport (``transport/``: shared memory on one host, MPI across hosts), which
moves them. Before each collective the ranks agree on what they were called with
(``agreement.py``), so a mismatch raises the same clear error on every rank instead of hanging
or corrupting memory; ranks inside ``join()`` take part in reductions with the op's identity
(zeros for a sum) and every other collective raises on every rank.

Every collective takes ``process_set=`` (default: all ranks; see ``process_sets.py``); each
has an ``*_async`` twin that runs on the background thread and returns a handle for
``synchronize``/``poll`` (``background.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import cloudpickle
import numpy as np

from flyte_hvd.core import background, process_sets, shm, state, timeline, transport
from flyte_hvd.core.agreement import (
    Agreement,
    Reduction,
    ReductionSpec,
    allgather_call,
    allreduce_call,
    broadcast_call,
    compression_id,
)
from flyte_hvd.core.buffers import MIN_POOLED_BYTES, pool
from flyte_hvd.core.checks import require_int
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.fusion import (
    fusion_buckets,
    fusion_threshold,
    packed_offsets,
    pieces,
)
from flyte_hvd.core.process_sets import (
    ProcessSet,
    async_comm_of,
    comm_of,
    global_process_set,
    translate_root,
)
from flyte_hvd.core.reduce_ops import (
    Adasum,
    Average,
    ReduceOp,
    Sum,
    finish_average,
    mpi_op,
    scale,
    scale_in_place,
)
from flyte_hvd.core.transport.mpi import displacements, mpi_type
from flyte_hvd.core.types import UserValue

if TYPE_CHECKING:
    from mpi4py import MPI
    from numpy.typing import ArrayLike

_SUPPORTED_KINDS = "fiuc"
_BROADCAST_KINDS = _SUPPORTED_KINDS + "b"  # booleans too


def _as_array(value: ArrayLike, what: str, kinds: str = _SUPPORTED_KINDS) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in kinds:
        raise ValueError(
            f"`{what}` needs a numeric array (float, int, uint or complex); found dtype "
            f"{array.dtype}. Cast it first, e.g. `array.astype(np.float32)`."
        )
    if not array.dtype.isnative:
        # The same values in this machine's byte order: MPI moves native numbers only, and
        # a rank's big-endian call would otherwise agree with another's little-endian one.
        return array.astype(array.dtype.newbyteorder("="))
    return array


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
    start = timeline.begin()
    entered = time.time_ns()
    served = 0
    if size > 1 and state.checks_collectives():
        # Blocking and nonblocking collectives do not match in MPI, so each communicator is
        # served with blocking calls from its own thread: the background thread serves the
        # others' background collectives (after finishing this rank's own), this one the rest.
        handle = background.submit(_serve_joined, state.async_comm())
        served = _serve_joined(comm) + background.synchronize(handle)
    everyone = np.empty((size, 2), dtype=np.int64)
    comm.Allgather(np.array([served, entered], dtype=np.int64), everyone)
    timeline.end("join", None, everyone.nbytes, start)
    # The last rank to join served nothing; among ranks that served equally, the latest.
    fewest = everyone[:, 0].min()
    candidates = [r for r in range(size) if everyone[r, 0] == fewest]
    return int(max(candidates, key=lambda r: everyone[r, 1]))


def _serve_joined(comm: MPI.Comm) -> int:
    return transport.of(comm).serve_joined()


def check_same(
    comm: MPI.Comm, fields: tuple, describe: Callable[[], str], reduction: Reduction = None
) -> None:
    """Agree with the other ranks of ``comm`` before a collective (``agreement``): raises
    ``CollectiveMismatchError`` on every rank if any rank's ``fields`` (ints and tuples of
    ints) differ; ``describe`` renders this rank's call for the message and runs only then."""
    transport.of(comm).check_same(fields, describe, reduction)


# -- helpers ---------------------------------------------------------------------------------


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
    route = transport.of(comm)
    if (
        type(array) is np.ndarray
        and array.dtype.isnative
        and array.nbytes <= shm.SMALL_BYTES
        and compression is Compression.none
        and prescale_factor == 1.0
        and postscale_factor == 1.0
        and array.flags.c_contiguous
        and route.size > 1
    ):
        done = route.allreduce_small(array, op, name)
        if done is not None:
            return done
    arr = _as_array(array, "allreduce")
    op, _ = mpi_op(op)
    wire, ctx = compression.compress(arr)
    fields, describe = allreduce_call(op, arr.dtype, arr.shape, compression)
    agreement: Agreement = (fields, describe, (op, wire))
    wire = np.asarray(scale(wire, prescale_factor), order="C")
    small = wire.nbytes < MIN_POOLED_BYTES  # the pool's bookkeeping is a tenth of a 4 KB call
    out = np.empty(wire.shape, wire.dtype) if small else pool.empty(wire.shape, wire.dtype)
    route.reduce(agreement, op, wire, out, "allreduce", name)
    scale_in_place(out, postscale_factor)
    return compression.decompress(out, ctx)


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

    first: Agreement = (
        (2, op, compression_id(compression), tuple((a.dtype.num, a.shape) for a in arrs)),
        lambda: (
            f"grouped_allreduce(op={op.name}, compression={compression.__name__}, "
            f"arrays={[(str(a.dtype), a.shape) for a in arrs]})"
        ),
        spec,
    )
    route = transport.of(comm)
    if not layouts:  # nothing to reduce, but the ranks still agree on that
        route.check_same(*first)
    agreement: Agreement | None = first
    results: list[np.ndarray | None] = [None] * len(arrs)
    as_pieces = route.takes_pieces and route.size > 1
    mpi_only = False
    for members, offsets, total in layouts:
        dtype = wires[members[0]].dtype
        buf = pool.empty((total,), dtype)
        if as_pieces:  # the parts go straight to the transport: no packing pass
            parts = [np.ascontiguousarray(scale(wires[i], prescale_factor)) for i in members]
            src: np.ndarray | shm.Pieces = pieces(parts, offsets, dtype.itemsize)
        else:
            for i, offset, end in zip(members, offsets, [*offsets[1:], total], strict=True):
                part = wires[i]
                buf[offset : offset + part.size] = part.reshape(-1)
                buf[offset + part.size : end] = 0
            scale_in_place(buf, prescale_factor)
            src = buf
        # The first buffer carries the agreement; the others follow its route.
        mpi_only = not route.reduce(agreement, op, src, buf, "grouped_allreduce", name, mpi_only)
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
    fields = (8, op, flat.dtype.num, flat.shape, compression_id(compression))
    transport.of(comm).reduce((fields, describe, (op, wire)), op, wire, wire, "allreduce", name)
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
    route = transport.of(comm)
    if (
        type(array) is np.ndarray
        and array.ndim
        and array.dtype.isnative
        and array.dtype.kind in _SUPPORTED_KINDS
        and array.flags.c_contiguous
    ):
        done = route.allgather_small(array, name)
        if done is not None:
            return done
    arr = np.asarray(_as_array(array, "allgather"), order="C")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    return route.allgather(arr, *allgather_call(arr.dtype, arr.shape), name)


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
    in_place: bool = False,
) -> np.ndarray:
    """Every rank gets ``root_rank``'s array (same shape and dtype on every rank; numbers or
    booleans).

    ``root_rank`` is a global rank, also with a ``process_set``. ``in_place``: when ``array``
    is a writable C-contiguous numpy array, the root sends from it and every other rank
    receives into it, with no other buffer (it is what is returned); else a new array.
    """
    root = translate_root(process_set, check_root(root_rank, "broadcast"))
    return broadcast_on(comm_of(process_set), array, root, name, owned=in_place)


def check_root(root_rank: object, what: str) -> int:
    """``root_rank`` as an int, or a ``ValueError`` naming ``what`` if no such rank exists."""
    size = state.size()
    if not isinstance(root_rank, int | np.integer) or not 0 <= root_rank < size:
        raise ValueError(
            f"`{what}` root_rank={root_rank!r} does not exist: expected an int in [0, {size - 1}] "
            f"(size is {size})."
        )
    return int(root_rank)


def broadcast_on(
    comm: MPI.Comm, array: ArrayLike, root: int, name: str | None = None, owned: bool = False
) -> np.ndarray:
    """``broadcast`` on the given communicator (``root`` is a rank of ``comm``). ``owned``:
    ``array`` may be sent from and received into with no other buffer when it is a writable
    C-contiguous numpy array (the async calls' own copy; an in-place broadcast's target)."""
    route = transport.of(comm)
    if (
        not owned
        and type(array) is np.ndarray
        and array.dtype.isnative
        and array.dtype.kind in _BROADCAST_KINDS
        and array.flags.c_contiguous
    ):
        done = route.broadcast_small(array, root, name)
        if done is not None:
            return done
    arr = _as_array(array, "broadcast", _BROADCAST_KINDS)
    at_root = comm.Get_rank() == root
    source = None
    if owned and arr.flags.c_contiguous and arr.flags.writeable:
        out = arr
    elif at_root and not arr.flags.c_contiguous:
        out = np.ascontiguousarray(arr)  # a copy already: it is the output
    else:
        out = pool.empty(arr.shape, arr.dtype)
        # The root's values reach `out` as the transport sees fit: over MPI, copied while
        # they are sent from `arr` itself.
        source = arr if at_root else None
    fields, describe = broadcast_call(arr.dtype, arr.shape, root)
    route.broadcast(out, root, fields, describe, name, source, buf_is_new=out is not arr)
    if (
        out is arr
        and isinstance(array, np.ndarray)
        and array is not arr  # ``arr``: a native copy of it, in another byte order
        and array.flags.c_contiguous
        and array.flags.writeable
    ):
        array[...] = out  # in place, as asked
        return array
    return out


def alltoall_rows(
    arr: np.ndarray, splits: Sequence[int] | np.ndarray | None, size: int
) -> np.ndarray:
    """How many rows of ``arr`` go to each of ``size`` ranks: ``splits`` checked, or the
    first dimension divided evenly."""
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
    route = transport.of(comm)
    arr = np.asarray(_as_array(array, "alltoall"), order="C")
    send_rows = alltoall_rows(arr, splits, route.size)
    route.check_same(
        (5, arr.dtype.num, arr.shape[1:]),
        lambda: f"alltoall(dtype={arr.dtype}, shape=(*, {arr.shape[1:]}))",
    )
    return route.alltoall(arr, send_rows, name)


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
    route = transport.of(comm)
    arr = np.asarray(_as_array(array, "reducescatter"), order="C")
    op, _ = mpi_op(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"`reducescatter` supports hvd.Average and hvd.Sum; found {op.name}.")
    if arr.ndim == 0:
        raise ValueError("`reducescatter` needs at least one dimension; found a scalar.")
    route.check_same(
        (6, op, arr.dtype.num, arr.shape),
        lambda: f"reducescatter(op={op.name}, dtype={arr.dtype}, shape={arr.shape})",
    )
    arr = np.ascontiguousarray(scale(arr, prescale_factor))
    size = route.size
    base, extra = divmod(arr.shape[0], size)
    rows = np.array([base + (1 if r < extra else 0) for r in range(size)], dtype=np.int64)
    out = route.reducescatter(arr, rows, op, name)
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
    transport.of(comm_of(process_set)).barrier()


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
    root = translate_root(process_set, check_root(root_rank, "broadcast_object"))
    comm = comm_of(process_set)
    check_same(comm, (7, root), lambda: f"broadcast_object(root_rank={root_rank})")
    payload = cloudpickle.dumps(obj) if comm.Get_rank() == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    comm.Bcast(length, root=root)
    buf = bytearray(payload) if comm.Get_rank() == root else bytearray(int(length[0]))
    start = timeline.begin()
    comm.Bcast(buf, root=root)
    timeline.end("broadcast_object", name, len(buf), start)
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
    start = timeline.begin()
    comm.Allgatherv(payload, [out, lengths, displacements(lengths), mpi_type(out.dtype)])
    timeline.end("allgather_object", name, out.nbytes, start)
    offsets = displacements(lengths)
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
    root = translate_root(process_set, check_root(root_rank, "broadcast_async"))
    return _submit(process_set, name, lambda c: broadcast_on(c, arr, root, name, owned=True))


def alltoall_async(
    array: ArrayLike,
    splits: Sequence[int] | np.ndarray | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> background.Handle:
    """``alltoall`` on the background thread (see ``allreduce_async``)."""
    arr = _copy(array, "alltoall_async")
    alltoall_rows(arr, splits, process_set.size())  # bad splits fail here, not on the thread
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
