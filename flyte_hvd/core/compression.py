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
    """Floating arrays travel as float16 (half the bytes); other dtypes pass unchanged."""

    @staticmethod
    def compress(array: np.ndarray) -> tuple[np.ndarray, Any]:
        if array.dtype.kind == "f" and array.dtype != np.float16:
            return array.astype(np.float16), array.dtype
        return array, None

    @staticmethod
    def decompress(array: np.ndarray, ctx: Any) -> np.ndarray:
        return array if ctx is None else array.astype(ctx)


class Compression:
    """Namespace of the available compressors, as ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
