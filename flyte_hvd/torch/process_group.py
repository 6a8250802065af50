"""Our torch collectives through ``torch.distributed``'s process group instead of MPI.

A rank that trains with DDP (or called ``init_process_group`` itself) has a process group; on
GPUs its backend is NCCL, which moves GPU tensors between GPUs directly, where the MPI route
copies them to host memory and back. ``FLYTE_HVD_TORCH_COLLECTIVES`` picks the route of
``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast`` and
their in-place and autograd forms:

- ``auto`` (the default): the process group when its backend is NCCL and every tensor is on a
  GPU; else MPI.
- ``process_group``: the process group whenever one is initialized, whatever its backend and
  the tensors' device (gloo on CPU tensors: how this route is tested without GPUs).
- ``mpi``: always MPI.

The process group is used only where it gives what MPI gives: the world's default group (its
rank and size are the collective core's), a ``process_set`` of every rank (a smaller set goes
through MPI: the default group cannot reduce among some ranks), no ``compression``, dense
tensors of float16/32/64, int8, uint8, int32 or int64 (booleans too for a broadcast). Any other
call goes through MPI. Averages, ``prescale_factor``/``postscale_factor`` and ``root_rank``
mean what they mean on the MPI route (integers scaled in float64, float16 in float32, integer
averages rounded toward zero). The ``*_async`` forms, ``alltoall`` and ``reducescatter`` always
use MPI.

The argument check is kept: with ``FLYTE_HVD_CHECK_COLLECTIVES`` on (the default) the ranks
first agree on the call over MPI (one 16-byte reduction), so mismatched shapes or dtypes raise
``CollectiveMismatchError`` on every rank; a rank whose call took the other route (a CPU tensor
where the others pass GPU ones) is a mismatch as well, not a hang. Ranks inside ``hvd.join()``
serve MPI reductions only: a process-group collective while some ranks have joined raises that
error on the ranks that have not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from flyte_hvd.core import collectives, state, timeline
from flyte_hvd.core.agreement import (
    allgather_call,
    allreduce_call,
    broadcast_call,
    compression_id,
)
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.fusion import fusion_buckets, fusion_threshold
from flyte_hvd.core.process_sets import ProcessSet
from flyte_hvd.core.reduce_ops import ReduceOp, mpi_op

ROUTE_ENV = "FLYTE_HVD_TORCH_COLLECTIVES"
ROUTES = ("auto", "process_group", "mpi")
# Added to the fields the ranks agree on, so that a call on one route never agrees with the
# same call on the other (each would wait in a different library).
_ROUTE_MARK = 0x5047

REDUCE_DTYPES = frozenset(
    {torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64}
)
BROADCAST_DTYPES = REDUCE_DTYPES | {torch.bool}
_TORCH_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


def route_setting() -> str:
    """``FLYTE_HVD_TORCH_COLLECTIVES``, checked: ``auto``, ``process_group`` or ``mpi``."""
    raw = os.environ.get(ROUTE_ENV, "").strip().lower() or "auto"
    if raw not in ROUTES:
        raise ValueError(
            f"{ROUTE_ENV}={os.environ[ROUTE_ENV]!r}: expected 'auto' (the process group for "
            f"GPU tensors when its backend is NCCL), 'process_group' (whenever one is "
            f"initialized) or 'mpi'."
        )
    return raw


def takes(
    tensors: Sequence[object],
    process_set: ProcessSet,
    dtypes: frozenset = REDUCE_DTYPES,
    compression: type[Compressor] = Compression.none,
) -> bool:
    """Whether a collective on ``tensors`` goes through the process group (module docstring)."""
    setting = route_setting()
    if setting == "mpi" or compression is not Compression.none or not tensors:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if process_set.size() != state.size() or dist.get_world_size() != state.size():
        return False
    if dist.get_rank() != state.rank():
        return False
    if not all(
        isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype in dtypes
        for t in tensors
    ):
        return False
    if setting == "process_group":
        return True
    return "nccl" in str(dist.get_backend()).lower() and all(
        t.is_cuda  # type: ignore[attr-defined]
        for t in tensors
    )


def _agree(fields: tuple, describe: Callable[[], str]) -> None:
    """The MPI route's argument check (``FLYTE_HVD_CHECK_COLLECTIVES``), marked as this route."""
    collectives.check_same(state.comm(), (*fields, _ROUTE_MARK), describe)


def _dtype(t: torch.Tensor) -> np.dtype:
    """The numpy dtype of ``t`` (its ``num`` is what the MPI route's agreement fields hold)."""
    return np.dtype(str(t.dtype).removeprefix("torch."))


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` in ``t``'s dtype, as the MPI route scales: float16 in float32, integers
    in float64 (truncated toward zero)."""
    if factor == 1.0:
        return t
    if t.dtype == torch.float16 or not t.is_floating_point():
        math = torch.float32 if t.dtype == torch.float16 else torch.float64
        return (t.to(math) * torch.tensor(factor, dtype=math, device=t.device)).to(t.dtype)
    return t * torch.tensor(factor, dtype=t.dtype, device=t.device)


def _finish_average(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """A summed ``t`` divided by the size for ``Average`` (integers round toward zero)."""
    size = state.size()
    if op is not ReduceOp.AVERAGE or size == 1:
        return t
    if t.is_floating_point():
        return t.div_(size)
    t -= torch.fmod(t, size)
    return t.floor_divide_(size)


def _reduce(
    flat: torch.Tensor, op: ReduceOp, pre: float, post: float, kind: str, name: str | None
) -> torch.Tensor:
    """Reduce the contiguous ``flat`` (this call's own copy) with ``op`` and the scales."""
    flat = _scaled(flat, pre)
    start = timeline.begin()
    dist.all_reduce(flat, _TORCH_OPS[op])
    timeline.end(kind, name, flat.nbytes, start)
    return _scaled(_finish_average(flat, op), post)


def allreduce(
    t: torch.Tensor, op: ReduceOp, name: str | None, pre: float, post: float
) -> torch.Tensor:
    """``functions.allreduce``'s plain form through the process group: a new tensor."""
    op, _ = mpi_op(op)  # Adasum and unknown ops: the MPI route's errors
    x = t.detach()
    shape, dtype = tuple(x.shape), _dtype(x)
    _agree(
        allreduce_call(op, dtype, shape)[0],  # the MPI route's fields, and this route's mark
        lambda: f"allreduce(op={op.name}, dtype={dtype}, shape={shape}, route=process group)",
    )
    flat = x.reshape(-1).clone()
    return _reduce(flat, op, pre, post, "allreduce", name).view(shape)


def grouped_allreduce(
    ts: Sequence[torch.Tensor], op: ReduceOp, name: str | None, pre: float, post: float
) -> list[torch.Tensor]:
    """``grouped_allreduce`` through the process group: the tensors of one dtype packed into
    buffers of at most ``HOROVOD_FUSION_THRESHOLD`` bytes, one reduction each, as on MPI."""
    op, _ = mpi_op(op)
    xs = [t.detach() for t in ts]
    described = [(_dtype(x), tuple(x.shape)) for x in xs]
    _agree(
        (
            2,
            op,
            compression_id(Compression.none),
            tuple((d.num, s) for d, s in described),
        ),
        lambda: (
            f"grouped_allreduce(op={op.name}, arrays={[(str(d), s) for d, s in described]}"
            f", route=process group)"
        ),
    )
    buckets = fusion_buckets(
        [(x.dtype, x.numel() * x.element_size()) for x in xs], fusion_threshold()
    )
    results: list[torch.Tensor | None] = [None] * len(xs)
    for members in buckets:
        flat = _reduce(
            torch.cat([xs[i].reshape(-1) for i in members]),
            op,
            pre,
            post,
            "grouped_allreduce",
            name,
        )
        for i, part in zip(members, flat.split([xs[i].numel() for i in members]), strict=True):
            results[i] = part.view(xs[i].shape)
    return results  # type: ignore[return-value]


def allgather(t: torch.Tensor, name: str | None) -> torch.Tensor:
    """``allgather`` through the process group: rows in rank order, ragged first dimension
    allowed (shorter ones are padded for the transfer)."""
    x = t.detach()
    x = (x.reshape(1) if x.dim() == 0 else x).contiguous()
    dtype, row_shape = _dtype(x), tuple(x.shape[1:])
    _agree(
        allgather_call(dtype, tuple(x.shape))[0],  # the MPI route's fields
        lambda: f"allgather(dtype={dtype}, shape=(*, {row_shape}), route=process group)",
    )
    rows = state.comm().allgather(x.shape[0])  # a few bytes, host to host
    most = max(rows)
    if x.shape[0] < most:
        x = torch.cat([x, x.new_zeros((most - x.shape[0], *row_shape))])
    parts = [torch.empty_like(x) for _ in rows]
    start = timeline.begin()
    dist.all_gather(parts, x)
    out = torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)])
    timeline.end("allgather", name, out.nbytes, start)
    return out


def broadcast(t: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
    """``broadcast`` through the process group: a new tensor, ``root_rank``'s values."""
    root = collectives.check_root(root_rank, "broadcast")
    x = t.detach()
    shape, dtype = tuple(x.shape), _dtype(x)
    _agree(
        broadcast_call(dtype, shape, root)[0],  # the MPI route's fields
        lambda: f"broadcast(dtype={dtype}, shape={shape}, root_rank={root}, route=process group)",
    )
    out = x.clone(memory_format=torch.contiguous_format)
    start = timeline.begin()
    dist.broadcast(out, src=root)
    timeline.end("broadcast", name, out.nbytes, start)
    return out
