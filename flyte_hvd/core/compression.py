"""Wire compression for reductions, with Horovod's ``Compression.none`` / ``Compression.fp16``."""

from __future__ import annotations

from typing import Any

import numpy as np


class Compressor:
    """Casts an array for the wire and back; ``ctx`` is what ``decompress`` needs to undo it."""

    @staticmethod
    def compress(array: np.ndarray) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(array: np.ndarray, ctx: Any) -> np.ndarray:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(array: np.ndarray) -> tuple[np.ndarray, Any]:
        return array, None

    @staticmethod
    def decompress(array: np.ndarray, ctx: Any) -> np.ndarray:
        return array


class FP16Compressor(Compressor):
    """Floating arrays travel as float16 (half the bytes); other dtypes pass unchanged.

    Takes numpy arrays and framework tensors alike (anything with a ``dtype`` whose
    ``is_floating_point`` is true and a ``.to(dtype)``, e.g. torch tensors)."""

    @staticmethod
    def compress(array: Any) -> tuple[Any, Any]:
        dtype = array.dtype
        if isinstance(dtype, np.dtype):
            if dtype.kind == "f" and dtype != np.float16:
                return array.astype(np.float16), dtype
            return array, None
        if getattr(dtype, "is_floating_point", False) and getattr(dtype, "itemsize", 2) > 2:
            return array.to(_half_like(array)), dtype
        return array, None

    @staticmethod
    def decompress(array: Any, ctx: Any) -> Any:
        if ctx is None:
            return array
        return array.astype(ctx) if isinstance(ctx, np.dtype) else array.to(ctx)


def _half_like(tensor: Any) -> Any:
    """The float16 dtype of ``tensor``'s own framework (its module's ``float16``)."""
    import sys

    module = sys.modules[type(tensor).__module__.split(".", 1)[0]]
    return module.float16


class Compression:
    """Namespace of the available compressors, as ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
