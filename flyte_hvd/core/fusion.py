"""Fusion: many small tensors reduced as few large buffers (Horovod's tensor fusion).

``HOROVOD_FUSION_THRESHOLD`` bounds a buffer; each part starts on a 64-byte boundary, so a
framework can adopt a result without a copy.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import numpy as np

from flyte_hvd.core import shm
from flyte_hvd.core.buffers import ALIGNMENT

FUSION_THRESHOLD_ENV = "HOROVOD_FUSION_THRESHOLD"
DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024


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


def pieces(parts: list[np.ndarray], offsets: list[int], itemsize: int) -> shm.Pieces:
    """A fusion buffer's parts as ``shm.Pieces``. The padding between parts is left out: no
    rank copies or reduces it (a numpy call per gap cost as much as one per part), and no
    result is a view of it, so what it holds is never read or scaled."""
    return [
        (offset * itemsize, part.reshape(-1).view(np.uint8))
        for part, offset in zip(parts, offsets, strict=True)
    ]
