"""Wire compression for reductions, with Horovod's ``Compression.none`` / ``Compression.fp16``."""

from __future__ import annotations

from types import ModuleType
from typing import Any, TypeAlias

import numpy as np

from flyte_hvd.core.types import Tensor

# What ``decompress`` needs to undo ``compress``: the original dtype (numpy's, torch's or
# TensorFlow's), or None when nothing was changed.
Context: TypeAlias = Any


class Compressor:
    """Casts an array for the wire and back; ``ctx`` is what ``decompress`` needs to undo it."""

    @staticmethod
    def compress(array: Tensor) -> tuple[Tensor, Context]:
        raise NotImplementedError

    @staticmethod
    def decompress(array: Tensor, ctx: Context) -> Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(array: Tensor) -> tuple[Tensor, Context]:
        return array, None

    @staticmethod
    def decompress(array: Tensor, ctx: Context) -> Tensor:
        return array


class FP16Compressor(Compressor):
    """Floating arrays travel as float16 (half the bytes); other dtypes pass unchanged.

    Takes numpy arrays and framework tensors alike: torch tensors (``dtype.is_floating_point``,
    ``.to(dtype)``) and TensorFlow tensors (``dtype.is_floating``, ``tf.cast``), each cast by
    its own framework, so the result is a tensor of the same kind."""

    @staticmethod
    def compress(array: Tensor) -> tuple[Tensor, Context]:
        dtype = array.dtype
        if isinstance(dtype, np.dtype):
            if dtype.kind == "f" and dtype != np.float16:
                return array.astype(np.float16), dtype
            return array, None
        floating = getattr(dtype, "is_floating_point", None)
        if floating is None:
            floating = getattr(dtype, "is_floating", False)  # TensorFlow's DType
        width: int | None = getattr(dtype, "itemsize", None)
        if width is None:
            width = getattr(dtype, "size", 2)  # TensorFlow's DType
        if floating and width > 2:
            return _cast(array, _framework(array).float16), dtype
        return array, None

    @staticmethod
    def decompress(array: Tensor, ctx: Context) -> Tensor:
        if ctx is None:
            return array
        return array.astype(ctx) if isinstance(ctx, np.dtype) else _cast(array, ctx)


def _framework(tensor: Tensor) -> ModuleType:
    """The top-level module of ``tensor``'s framework (``torch``, ``tensorflow``)."""
    import sys

    return sys.modules[type(tensor).__module__.split(".", 1)[0]]


def _cast(tensor: Tensor, dtype: Context) -> Tensor:
    """``tensor`` as ``dtype``, by its own framework: ``.to`` (torch) or ``cast``
    (TensorFlow, whose tensors have no ``.to``)."""
    if hasattr(tensor, "to"):
        return tensor.to(dtype)
    return _framework(tensor).cast(tensor, dtype)


class Compression:
    """Namespace of the available compressors, as ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
