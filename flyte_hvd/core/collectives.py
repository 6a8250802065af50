"""Horovod's collectives on numpy buffers, over the communicator ``init()`` set up.

Arrays travel through mpi4py's buffer (uppercase) methods, never pickled. Before each
collective the ranks compare a fingerprint of what they were called with (op, dtype, shape,
root) in one tiny reduction, so a mismatch raises the same clear error on every rank instead
of hanging or corrupting memory.
"""

from __future__ import annotations

import enum
import os
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from flyte_hvd.core import state, timeline
from flyte_hvd.core.buffers import ALIGNMENT, pool
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.errors import CollectiveMismatchError

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
_MPI_OPS: dict[int, Any] = {}


def _mpi_ops() -> dict[int, Any]:
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


def _mpi_op(op: Any) -> tuple[ReduceOp, Any]:
    mpi_op = _mpi_ops().get(op) if isinstance(op, int) else None
    if mpi_op is None:
        if op == ReduceOp.ADASUM:
            raise ValueError("`op=Adasum` is not supported; use hvd.Average or hvd.Sum.")
        raise ValueError(
            f"unknown reduction op {op!r}: expected one of hvd.Average, hvd.Sum, hvd.Min, "
            f"hvd.Max, hvd.Product."
        )
    return ReduceOp(op), mpi_op


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


def _as_array(value: Any, what: str) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in _SUPPORTED_KINDS:
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


def check_optimizer_args(backward_passes_per_step: Any, op: Any,
                         gradient_predivide_factor: float) -> None:  # fmt: skip
    """The checks every framework's ``DistributedOptimizer`` makes of its reduction args."""
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise ValueError(
            f"`backward_passes_per_step` must be an int >= 1; found {backward_passes_per_step!r}."
        )
    if backward_passes_per_step < 1:
        raise ValueError(
            f"`backward_passes_per_step` must be >= 1; found {backward_passes_per_step}."
        )
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer `op` must be hvd.Average or hvd.Sum; found {op!r}.")
    if gradient_predivide_factor <= 0:
        raise ValueError(
            f"`gradient_predivide_factor` must be > 0; found {gradient_predivide_factor}."
        )
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("`gradient_predivide_factor` applies only with op=hvd.Average.")


def _check_same(comm: Any, fields: tuple, describe: Callable[[], str]) -> None:
    """Raise on every rank if any rank's ``fields`` differ: one 16-byte MAX reduction.

    ``describe`` renders this rank's call for the error message; it runs only on a mismatch.
    """
    if comm.Get_size() == 1 or not state.checks_collectives():
        return
    fp = _fingerprint(fields)
    pair = np.array([fp, -fp], dtype=np.int64)
    comm.Allreduce(_in_place(), pair, _mpi_ops()[ReduceOp.MAX])
    if pair[0] == fp and -pair[1] == fp:
        return
    _raise_mismatch(comm, describe())


def _raise_mismatch(comm: Any, description: str) -> None:
    descriptions = comm.allgather(description)
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(descriptions))
    kind = description.split("(", 1)[0]
    raise CollectiveMismatchError(
        f"ranks called `{kind}` with different arguments; every rank must pass the same "
        f"op, dtype and shape (except where the collective allows a ragged first dimension). "
        f"Found:\n{lines}"
    )


def _begin() -> int:
    return time.time_ns() if timeline.current() is not None else 0


def _end(kind: str, name: str | None, nbytes: int, start_ns: int) -> None:
    tl = timeline.current()
    if tl is not None:
        tl.record(kind, name, nbytes, start_ns)


def _scale(array: np.ndarray, factor: float, what: str) -> np.ndarray:
    if factor == 1.0:
        return array
    _check_floating(array, factor, what)
    return array * np.asarray(factor, dtype=array.dtype)


def _scale_in_place(array: np.ndarray, factor: float, what: str) -> None:
    if factor != 1.0:
        _check_floating(array, factor, what)
        array *= np.asarray(factor, dtype=array.dtype)


def _check_floating(array: np.ndarray, factor: float, what: str) -> None:
    if array.dtype.kind not in "fc":
        raise ValueError(
            f"`{what}`={factor} applies only to floating arrays; found dtype {array.dtype}."
        )


def _finish_average(buf: np.ndarray, size: int, op: ReduceOp) -> None:
    if op is not ReduceOp.AVERAGE or size == 1:
        return
    if buf.dtype.kind in "fc":
        buf /= size
    else:
        buf //= size  # integer average rounds down, as integer division does


def allreduce(
    array: Any,
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> np.ndarray:
    """Reduce ``array`` across ranks; every rank gets the result as a new array.

    ``Average`` on integer arrays rounds down. ``prescale_factor``/``postscale_factor`` multiply
    the input before and the result after the reduction (floating arrays only).
    """
    comm = state.comm()
    arr = _as_array(array, "allreduce")
    op, mpi_op = _mpi_op(op)
    _check_same(
        comm,
        (1, op, arr.dtype.num, arr.shape, _compression_id(compression)),
        lambda: (
            f"allreduce(op={op.name}, dtype={arr.dtype}, shape={arr.shape}, "
            f"compression={compression.__name__})"
        ),
    )
    wire, ctx = compression.compress(arr)
    wire = np.asarray(_scale(wire, prescale_factor, "prescale_factor"), order="C")
    out = pool.empty(wire.shape, wire.dtype)
    start = _begin()
    if out.nbytes >= _IN_PLACE_BYTES:
        # Copy, then reduce in place: measured faster than MPICH's out-of-place path.
        np.copyto(out, wire)
        comm.Allreduce(_in_place(), out, mpi_op)
    else:
        comm.Allreduce(wire, out, mpi_op)
    _end("allreduce", name, out.nbytes, start)
    _finish_average(out, comm.Get_size(), op)
    _scale_in_place(out, postscale_factor, "postscale_factor")
    return compression.decompress(out, ctx)


def grouped_allreduce(
    arrays: Sequence[Any],
    op: ReduceOp = Average,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[np.ndarray]:
    """Reduce many arrays with as few reductions as the fusion threshold allows.

    Arrays of one wire dtype are packed, in order, into fusion buffers of at most
    ``HOROVOD_FUSION_THRESHOLD`` bytes (an array larger than that travels alone), each buffer
    is reduced in place with one MPI call, and the results are views into those buffers.
    """
    comm = state.comm()
    arrs = [_as_array(a, "grouped_allreduce") for a in arrays]
    op, mpi_op = _mpi_op(op)
    _check_same(
        comm,
        (2, op, _compression_id(compression), tuple((a.dtype.num, a.shape) for a in arrs)),
        lambda: (
            f"grouped_allreduce(op={op.name}, compression={compression.__name__}, "
            f"arrays={[(str(a.dtype), a.shape) for a in arrs]})"
        ),
    )
    compressed = [compression.compress(a) for a in arrs]
    results: list[np.ndarray | None] = [None] * len(arrs)
    for members in _fusion_groups([c[0] for c in compressed], fusion_threshold()):
        dtype = compressed[members[0]][0].dtype
        # Each array starts on a 64-byte boundary, so TensorFlow can adopt its result
        # without a copy.
        step = max(1, ALIGNMENT // dtype.itemsize)
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += -(-compressed[i][0].size // step) * step
        buf = pool.empty((total,), dtype)
        for i, offset in zip(members, offsets, strict=True):
            part = compressed[i][0]
            buf[offset : offset + part.size] = part.reshape(-1)
            buf[offset + part.size : offset + -(-part.size // step) * step] = 0
        _scale_in_place(buf, prescale_factor, "prescale_factor")
        start = _begin()
        comm.Allreduce(_in_place(), buf, mpi_op)
        _end("grouped_allreduce", name, buf.nbytes, start)
        _finish_average(buf, comm.Get_size(), op)
        _scale_in_place(buf, postscale_factor, "postscale_factor")
        for i, offset in zip(members, offsets, strict=True):
            part, ctx = compressed[i]
            view = buf[offset : offset + part.size].reshape(part.shape)
            results[i] = compression.decompress(view, ctx)
    return results  # type: ignore[return-value]


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE


def _fusion_groups(arrays: list[np.ndarray], threshold: int) -> list[list[int]]:
    """Indices of ``arrays`` grouped into fusion buffers: same dtype, at most ``threshold``
    bytes each, order kept within a dtype."""
    groups: list[list[int]] = []
    open_group: dict[np.dtype, tuple[list[int], int]] = {}
    for i, a in enumerate(arrays):
        members, used = open_group.get(a.dtype, ([], 0))
        if members and used + a.nbytes > threshold:
            groups.append(members)
            members, used = [], 0
        members.append(i)
        open_group[a.dtype] = (members, used + a.nbytes)
    groups.extend(members for members, _ in open_group.values() if members)
    return groups


def allgather(array: Any, name: str | None = None) -> np.ndarray:
    """Concatenate every rank's array along the first dimension, in rank order.

    The first dimension may differ between ranks (ragged); the others and the dtype may not.
    """
    comm = state.comm()
    arr = np.asarray(_as_array(array, "allgather"), order="C")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    fp = _fingerprint((3, arr.dtype.num, arr.shape[1:]))
    size = comm.Get_size()
    meta = np.empty((size, 2), dtype=np.int64)
    comm.Allgather(np.array([fp, arr.shape[0]], dtype=np.int64), meta)
    if not (meta[:, 0] == fp).all():
        _raise_mismatch(comm, f"allgather(dtype={arr.dtype}, shape=(*, {arr.shape[1:]}))")
    rows = meta[:, 1]
    row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
    out = pool.empty((int(rows.sum()), *arr.shape[1:]), arr.dtype)
    counts = rows * row_items
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    start = _begin()
    comm.Allgatherv(arr, [out, counts, displs, _mpi_type(arr.dtype)])
    _end("allgather", name, out.nbytes, start)
    return out


def _mpi_type(dtype: np.dtype):
    from mpi4py import MPI

    return MPI._typedict[dtype.char]


def _check_root(root_rank: Any, what: str) -> int:
    size = state.size()
    if not isinstance(root_rank, int | np.integer) or not 0 <= root_rank < size:
        raise ValueError(
            f"`{what}` root_rank={root_rank!r} does not exist: expected an int in [0, {size - 1}] "
            f"(size is {size})."
        )
    return int(root_rank)


def broadcast(array: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """Every rank gets ``root_rank``'s array (same shape and dtype on every rank)."""
    comm = state.comm()
    root = _check_root(root_rank, "broadcast")
    arr = _as_array(array, "broadcast")
    _check_same(
        comm,
        (4, arr.dtype.num, arr.shape, root),
        lambda: f"broadcast(dtype={arr.dtype}, shape={arr.shape}, root_rank={root})",
    )
    out = pool.empty(arr.shape, arr.dtype)
    if comm.Get_rank() == root:
        out[...] = arr
    start = _begin()
    comm.Bcast(out, root=root)
    _end("broadcast", name, out.nbytes, start)
    return out


def alltoall(
    array: Any, splits: Sequence[int] | None = None, name: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows (first dimension) of ``array`` to rank ``i``.

    Without ``splits`` the first dimension is divided evenly. Returns the rows received from
    every rank, concatenated in rank order, and how many rows came from each rank.
    """
    comm = state.comm()
    size = comm.Get_size()
    arr = np.asarray(_as_array(array, "alltoall"), order="C")
    if arr.ndim == 0:
        raise ValueError("`alltoall` needs an array with at least one dimension; found a scalar.")
    if splits is None:
        if arr.shape[0] % size:
            raise ValueError(
                f"`alltoall` without `splits` divides the first dimension evenly, but "
                f"{arr.shape[0]} rows do not divide by size {size}; pass `splits`."
            )
        send_rows = np.full(size, arr.shape[0] // size, dtype=np.int64)
    else:
        send_rows = np.asarray(splits, dtype=np.int64).reshape(-1)
        if send_rows.size != size or (send_rows < 0).any() or send_rows.sum() != arr.shape[0]:
            raise ValueError(
                f"`alltoall` splits={list(splits)}: expected {size} non-negative ints summing "
                f"to the first dimension ({arr.shape[0]})."
            )
    _check_same(
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


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def reducescatter(array: Any, op: ReduceOp = Average, name: str | None = None) -> np.ndarray:
    """Reduce across ranks, then give rank ``i`` its slice of the first dimension.

    Rows are divided as evenly as possible; the first ``rows % size`` ranks get one more.
    """
    comm = state.comm()
    size, rank = comm.Get_size(), comm.Get_rank()
    arr = np.asarray(_as_array(array, "reducescatter"), order="C")
    op, mpi_op = _mpi_op(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"`reducescatter` supports hvd.Average and hvd.Sum; found {op.name}.")
    if arr.ndim == 0:
        raise ValueError("`reducescatter` needs at least one dimension; found a scalar.")
    _check_same(
        comm,
        (6, op, arr.dtype.num, arr.shape),
        lambda: f"reducescatter(op={op.name}, dtype={arr.dtype}, shape={arr.shape})",
    )
    base, extra = divmod(arr.shape[0], size)
    rows = np.array([base + (1 if r < extra else 0) for r in range(size)], dtype=np.int64)
    row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
    out = np.empty((int(rows[rank]), *arr.shape[1:]), dtype=arr.dtype)
    start = _begin()
    comm.Reduce_scatter(arr, out, recvcounts=(rows * row_items).tolist(), op=mpi_op)
    _end("reducescatter", name, out.nbytes, start)
    _finish_average(out, size, op)
    return out


def barrier() -> None:
    """Block until every rank reaches this call."""
    comm = state.comm()
    _check_same(comm, (8,), lambda: "barrier()")
    start = _begin()
    comm.Barrier()
    _end("barrier", None, 0, start)


def join() -> int:
    """Wait for every rank to reach ``join()``; return the rank that arrived last.

    Arrival is each rank's wall clock when it entered. Ranks here always run the same number
    of steps (the data loaders equalize shards), so unlike Horovod a joined rank does not
    stand in for collectives of the others.
    """
    comm = state.comm()
    arrived = np.array([time.time_ns()], dtype=np.int64)
    everyone = np.empty(comm.Get_size(), dtype=np.int64)
    start = _begin()
    comm.Allgather(arrived, everyone)
    _end("join", None, everyone.nbytes, start)
    return int(np.argmax(everyone))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Every rank gets ``root_rank``'s object (cloudpickled, so lambdas travel too)."""
    comm = state.comm()
    root = _check_root(root_rank, "broadcast_object")
    _check_same(comm, (7, root), lambda: f"broadcast_object(root_rank={root})")
    payload = cloudpickle.dumps(obj) if comm.Get_rank() == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    comm.Bcast(length, root=root)
    buf = bytearray(payload) if comm.Get_rank() == root else bytearray(int(length[0]))
    start = _begin()
    comm.Bcast(buf, root=root)
    _end("broadcast_object", name, len(buf), start)
    return obj if comm.Get_rank() == root else cloudpickle.loads(bytes(buf))


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's object, in rank order (cloudpickled)."""
    comm = state.comm()
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
