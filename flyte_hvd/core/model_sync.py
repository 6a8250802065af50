"""Giving every rank the same model: one check that the ranks hold the same tensors, and one
broadcast per dtype. Keras' ``broadcast_variables`` and PyTorch's ``broadcast_parameters``
describe their tensors and hand over numpy views; this module does the rest."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flyte_hvd.core import collectives, state

# (name, shape, dtype) of one tensor, as a framework describes it.
Described = tuple[str, tuple[int, ...], str]


def check_same_tensors(
    described: list[Described], root_rank: int, *, compare_names: bool, noun: str
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks describe the same tensors as
    ``root_rank`` (shapes and dtypes, and names when ``compare_names``); the message names the
    first difference. ``noun`` is what the framework calls a tensor ("variable", "tensor")."""
    everyone = collectives.allgather_object(described)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        root_rank_ok = False
    else:
        root_rank_ok = 0 <= root_rank < len(everyone)
    if not root_rank_ok:
        raise ValueError(
            f"`root_rank`={root_rank!r} does not exist: expected [0, {len(everyone) - 1}]."
        )

    def key(d: Described) -> tuple:
        return tuple(d) if compare_names else tuple(d[1:])

    root = everyone[root_rank]
    for rank, theirs in enumerate(everyone):
        if [key(d) for d in theirs] != [key(d) for d in root]:
            raise ValueError(_mismatch(root_rank, root, rank, theirs, key, noun))


def _mismatch(
    root_rank: int,
    root: list[Described],
    rank: int,
    theirs: list[Described],
    key: Callable[[Described], tuple],
    noun: str,
) -> str:
    if len(root) != len(theirs):
        detail = f"rank {root_rank} has {len(root)} {noun}s, rank {rank} has {len(theirs)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(root, theirs, strict=True)) if key(a) != key(b))
        detail = (
            f"{noun} {i}: rank {root_rank} has `{root[i][0]}` {root[i][1]} {root[i][2]}, "
            f"rank {rank} has `{theirs[i][0]}` {theirs[i][1]} {theirs[i][2]}"
        )
    return (
        f"ranks built different models, so their {noun}s cannot be broadcast: {detail}. "
        f"Every rank must build the same architecture."
    )


def broadcast_by_dtype(
    arrays: list[np.ndarray], root_rank: int, name: str, write: Callable[[int, np.ndarray], object]
) -> None:
    """Give every rank ``root_rank``'s values of ``arrays``: one broadcast per dtype of all
    arrays of that dtype, end to end, then ``write(i, value)`` for each array on every rank but
    the root (whose values they are). The buffer is this function's own, so the broadcast sends
    from it and receives into it (no copy of the model besides the root's concatenation), and
    the other ranks receive into an empty one: their values are not read."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    at_root = state.rank() == root_rank
    for dtype, indices in by_dtype.items():
        if at_root:
            flat = np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in indices])
        else:
            flat = np.empty(sum(arrays[i].size for i in indices), dtype)
        collectives.broadcast(flat, root_rank=root_rank, name=name, in_place=True)
        if at_root:
            continue
        offset = 0
        for i in indices:
            n = arrays[i].size
            write(i, flat[offset : offset + n].reshape(arrays[i].shape))
            offset += n
