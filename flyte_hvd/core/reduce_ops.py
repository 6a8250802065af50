"""Horovod's reduction ops and the arithmetic around a reduction: the MPI op of each, the
pre- and post-scaling, the average, and each op's identity (what a joined rank contributes).

Integers and float16 are scaled as Horovod does on the CPU: integers in float64 (truncated
toward zero), float16 in float32; an integer average rounds toward zero.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI


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

_MPI_OPS: dict[int, MPI.Op] = {}
# What ``mpi_op`` found before, by the caller's value: no enum call per collective.
_KNOWN_OPS: dict[int, tuple[ReduceOp, MPI.Op]] = {}


def mpi_ops() -> dict[int, MPI.Op]:
    """The MPI op of each supported ``ReduceOp`` (mpi4py imported on first use)."""
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
    known = _KNOWN_OPS.get(op) if isinstance(op, int) else None
    if known is not None:
        return known
    found = mpi_ops().get(op) if isinstance(op, int) else None
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


def known_op(op: int) -> ReduceOp | None:
    """``op`` as a ``ReduceOp`` if ``mpi_op`` has accepted it before (a dict lookup), else
    None: the small-call paths' check, which leave anything new to the general path."""
    known = _KNOWN_OPS.get(op)
    return None if known is None else known[0]


def scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array * factor`` in ``array``'s dtype (a new array; the module's rules)."""
    if array.dtype.kind in "iu" or array.dtype == np.float16:
        math_dtype = np.float64 if array.dtype.kind in "iu" else np.float32
        result = array.astype(math_dtype) * math_dtype(factor)  # type: ignore[operator]
        return result.astype(array.dtype)
    return array * np.asarray(factor, dtype=array.dtype)


def scale(array: np.ndarray, factor: float) -> np.ndarray:
    """``array`` itself for a factor of 1, else ``scaled``."""
    return array if factor == 1.0 else scaled(array, factor)


def scale_in_place(array: np.ndarray, factor: float) -> None:
    """Multiply ``array`` by ``factor`` in place (the rules of ``scaled``)."""
    if factor == 1.0:
        return
    if array.dtype.kind in "fc" and array.dtype != np.float16:
        array *= np.asarray(factor, dtype=array.dtype)
    else:
        array[...] = scaled(array, factor)


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


def identity(dtype: np.dtype, op: ReduceOp, count: int) -> np.ndarray:
    """``count`` items that ``op`` leaves any value unchanged with (a joined rank's share)."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return np.zeros(count, dtype)
    if op == ReduceOp.PRODUCT:
        return np.ones(count, dtype)
    info = np.finfo(dtype) if dtype.kind in "fc" else np.iinfo(dtype)
    if dtype.kind == "f":
        return np.full(count, np.inf if op == ReduceOp.MIN else -np.inf, dtype)
    return np.full(count, info.max if op == ReduceOp.MIN else info.min, dtype)
