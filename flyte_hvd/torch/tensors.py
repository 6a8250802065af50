"""Tensors into the numpy collective core and back, and the argument checks the torch
collectives share: their synchronous (``functions``) and background (``async_collectives``)
forms convert and check the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch

from flyte_hvd.core.reduce_ops import Average, ReduceOp, Sum

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

# How many rows go to each rank: a tensor or a list of ints (None: evenly).
Splits: TypeAlias = "torch.Tensor | Sequence[int] | None"


def as_array(tensor: torch.Tensor | ArrayLike, what: str) -> np.ndarray:
    """A numpy view (or, off the CPU, a copy) of ``tensor``; other values go through
    ``np.asarray``."""
    if not isinstance(tensor, torch.Tensor):
        return np.asarray(tensor)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        raise ValueError(
            f"`{what}` cannot take a bfloat16 tensor (numpy has no bfloat16); cast it first, "
            f"e.g. `tensor.float()`."
        )
    if t.is_sparse:
        t = t.to_dense()
    return t.resolve_conj().resolve_neg().contiguous().numpy()


def as_tensor(array: np.ndarray, like: object) -> torch.Tensor:
    """``array`` as a tensor (sharing its memory when it is C-contiguous), on ``like``'s device
    when ``like`` is a tensor off the CPU."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    out = torch.from_numpy(array)
    if isinstance(like, torch.Tensor) and like.device.type != "cpu":
        out = out.to(like.device)
    return out


def resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    """Horovod's deprecated ``average=`` argument and ``op=`` are exclusive."""
    if average is not None and op is not None:
        raise ValueError("pass either `op` or the deprecated `average`, not both.")
    if op is not None:
        return op
    return Average if average is None or average else Sum


def raw_splits(splits: Splits) -> np.ndarray | Sequence[int] | None:
    """``alltoall``'s splits as the core takes them."""
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().numpy()
    return splits


def check_grouped_reducescatter(tensors: Sequence[torch.Tensor]) -> None:
    """Every tensor of a grouped reducescatter has a first dimension to scatter."""
    if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors):
        raise ValueError(
            "`grouped_reducescatter` needs tensors with at least one dimension; found a scalar."
        )
