"""A model's parameters and an optimizer's state made the same on every rank, as Horovod's
``broadcast_parameters`` and ``broadcast_optimizer_state`` do."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeAlias

import torch

from flyte_hvd.core import collectives, model_sync, state

# What ``broadcast_parameters`` takes: a state_dict, named_parameters() or a list of tensors.
Params: TypeAlias = (
    "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor]"
)


def _named(params: object) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        return sorted(params.items(), key=lambda kv: kv[0])
    if isinstance(params, Iterable):
        named = []
        for i, item in enumerate(params):
            if isinstance(item, tuple) and len(item) == 2:
                named.append((str(item[0]), item[1]))
            else:
                named.append((f"tensor.{i}", item))
        return named
    raise ValueError(
        f"`broadcast_parameters` takes a state_dict, named_parameters() or a list of tensors; "
        f"found {type(params).__name__}."
    )


def broadcast_parameters(params: Params, root_rank: int = 0) -> None:
    """Set every rank's tensors to ``root_rank``'s, in place: ``model.state_dict()`` or
    ``model.named_parameters()``. One broadcast per dtype; ranks whose tensors differ in names,
    shapes or dtypes get an error naming the first difference."""
    named = [(n, t) for n, t in _named(params) if isinstance(t, torch.Tensor)]
    described = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    model_sync.check_same_tensors(described, root_rank, compare_names=True, noun="tensor")
    with torch.no_grad():
        # bfloat16 has no numpy dtype: it travels as float32.
        values = [
            (t.detach().float() if t.dtype == torch.bfloat16 else t.detach()).cpu().numpy()
            for _, t in named
        ]
        tensors = [t for _, t in named]
        model_sync.broadcast_by_dtype(
            values,
            root_rank,
            "broadcast_parameters",
            lambda i, value: tensors[i].copy_(torch.from_numpy(value).view(tensors[i].shape)),
        )


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (``state_dict``).

    An optimizer that has not stepped yet has no state to send: as Horovod does, it first
    takes one step with zero gradients to create it (the parameters are restored afterwards;
    parameters without a gradient are left with a zero one)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"`broadcast_optimizer_state` takes a torch.optim.Optimizer; found "
            f"{type(optimizer).__name__}."
        )
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer)
    mine = optimizer.state_dict() if state.rank() == root_rank else None
    theirs = collectives.broadcast_object(mine, root_rank=root_rank, name="optimizer_state")
    if state.rank() != root_rank:
        try:
            optimizer.load_state_dict(theirs)
        except ValueError as error:
            raise ValueError(
                f"rank {root_rank}'s optimizer state does not fit this rank's optimizer "
                f"({error}); every rank must build the same optimizer over the same model."
            ) from None


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """One local step of ``optimizer``'s own class with zero gradients, parameters kept."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
    local_step(optimizer)
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def local_step(optimizer: torch.optim.Optimizer) -> None:
    """``step()`` of the optimizer's own class: no reduction, even when ``DistributedOptimizer``
    wrapped it (a wrapped optimizer carries ``_hvd`` and its class's own ``step`` is two
    classes up the MRO, behind the distributed mixin)."""
    if hasattr(optimizer, "_hvd"):
        type(optimizer).__mro__[2].step(optimizer)  # type: ignore[attr-defined]
    else:
        optimizer.step()
