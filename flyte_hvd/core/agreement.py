"""How ranks agree on a collective before it runs, and how joined ranks are served.

Before each collective the ranks compare a fingerprint of what they were called with (op,
dtype, shape, root): the elementwise MAX of every rank's ``[fingerprint, -fingerprint]``
(fingerprints are >= 0), which a transport carries (``Transport.exchange``; on shared memory
beside the data's first wait, over MPI in one exchange of every rank's record, with small
calls' data). Equal fingerprints come back unchanged. A rank inside ``join()`` sends
``[ABSENT, 1]`` instead: below every fingerprint and above every -fingerprint, so the others
see a positive second slot. Then a collective with a reduction goes on with the joined ranks
contributing the op's identity, and any other collective raises on every rank; differing
fingerprints raise ``CollectiveMismatchError`` on every rank, naming each rank's call.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.errors import CollectiveMismatchError
from flyte_hvd.core.reduce_ops import ReduceOp, identity, mpi_op

if TYPE_CHECKING:
    from mpi4py import MPI

ABSENT = np.iinfo(np.int64).min

# A reduction's wire buffers, for joined ranks to match: [(dtype str, element count, op)].
ReductionSpec = list[tuple[str, int, int]]
# What a collective tells the agreement about the reduction that follows: its (op, wire
# array), or a function returning its ``ReductionSpec`` (several buffers).
Reduction = tuple[ReduceOp, np.ndarray] | Callable[[], ReductionSpec] | None
# Everything the ranks agree on before a reduction: the fields, how this rank's call reads
# in an error (made only when one is raised), and the reduction.
Agreement = tuple[tuple, Callable[[], str], Reduction]

_COMPRESSION_IDS: dict[type, int] = {}


def fingerprint(fields: tuple) -> int:
    """Hash of ints and tuples of ints only: those hash alike in every process (str does not)."""
    return hash(fields) & 0x7FFFFFFFFFFFFFFF


def compression_id(compression: type[Compressor]) -> int:
    """A compressor as an agreement field (the same number in every process)."""
    if compression not in _COMPRESSION_IDS:
        _COMPRESSION_IDS[compression] = zlib.crc32(compression.__qualname__.encode())
    return _COMPRESSION_IDS[compression]


def allreduce_call(
    op: ReduceOp,
    dtype: np.dtype,
    shape: tuple[int, ...],
    compression: type[Compressor] = Compression.none,
) -> tuple[tuple, Callable[[], str]]:
    """An allreduce's agreement fields and how it reads in an error: one definition, for the
    general path and the transports' shortcuts alike (each must agree with the other)."""
    fields = (1, op, dtype.num, shape, compression_id(compression))
    return (
        fields,
        lambda: (
            f"allreduce(op={op.name}, dtype={dtype}, shape={shape}, "
            f"compression={compression.__name__})"
        ),
    )


def allgather_call(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[tuple, Callable[[], str]]:
    """An allgather's agreement fields and how it reads in an error (the first dimension may
    differ between ranks: it is not agreed on), for the general path and the transports'
    shortcut alike."""
    rows = shape[1:]
    return (3, dtype.num, rows), lambda: f"allgather(dtype={dtype}, shape=(*, {rows}))"


def broadcast_call(
    dtype: np.dtype, shape: tuple[int, ...], root: int
) -> tuple[tuple, Callable[[], str]]:
    """A broadcast's agreement fields and how it reads in an error (``root``: a rank of the
    communicator), for the general path and the transports' shortcut alike."""
    return (
        (4, dtype.num, shape, root),
        lambda: f"broadcast(dtype={dtype}, shape={shape}, root_rank={root})",
    )


def settle(
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
        raise_mismatch(comm.allgather(describe()))


def raise_mismatch(descriptions: list[str | None]) -> None:
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
        raise_mismatch([None if e is None else e[1] for e in entries])
    if reduction is None:
        joined = [r for r, e in enumerate(entries) if e is None]
        kind = description.split("(", 1)[0]
        raise CollectiveMismatchError(
            f"`{kind}` cannot run while rank(s) {joined} are inside hvd.join(): only "
            f"allreduce (and grouped_allreduce, the optimizers' reductions) goes on with "
            f"joined ranks. Call `{kind}` before hvd.join() on every rank."
        )


def serve_joined_round(comm: MPI.Comm) -> int:
    """A joined rank's side of one collective of the active ranks: contribute the identity of
    the op to each of its reductions (over MPI, where the active ranks reduce while some have
    joined). Returns 1 if a reduction was served."""
    from mpi4py import MPI

    active = [e for e in comm.allgather(None) if e is not None]
    if len({e[0] for e in active}) != 1 or active[0][2] is None:
        return 0  # the active ranks raise
    for dtype_str, count, op in active[0][2]:
        rop, mop = mpi_op(op)
        comm.Allreduce(MPI.IN_PLACE, identity(np.dtype(dtype_str), rop, count), mop)
    return 1
