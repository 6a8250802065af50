"""Output buffers for collectives, reused once the caller has dropped every view of them.

A fresh large numpy array is fresh pages from the kernel: on the machines measured, faulting
them in cost more than the reduction itself (a 1 MB allreduce took 1.0 ms into a new array,
0.2 ms into a reused one). Collectives return views of pooled backing arrays; a backing array
is handed out again only when nothing but the pool refers to it (numpy views keep their base
alive, so a live result can never be overwritten).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

# Below this, malloc serves from the heap without page faults: pooling would not pay.
MIN_POOLED_BYTES = 32 * 1024
MAX_PER_SIZE = 4
MAX_POOLED_BYTES = 1 << 30

# References to a free backing array while it is checked: its entry in the pool, the loop
# variable, and getrefcount's own argument.
_FREE_REFCOUNT = 3


# TensorFlow adopts a numpy result without copying only if it is 64-byte aligned; malloc
# gives 16.
ALIGNMENT = 64


class BufferPool:
    def __init__(self) -> None:
        # Raw allocations by usable size, each with the offset of its aligned start (reading
        # an address, ``ctypes.data``, is 2.4 us: half of a call here). Views of them have the
        # raw array as ``base``, so the raw array's reference count tells whether a caller
        # still holds a view.
        self._by_size: dict[int, list[tuple[np.ndarray, int]]] = {}
        self._pooled_bytes = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized C-contiguous, 64-byte aligned array, like ``np.empty``, maybe
        from the pool."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES:
            return np.empty(shape, dtype)
        with self._lock:
            raws = self._by_size.setdefault(nbytes, [])
            for raw, offset in raws:
                if sys.getrefcount(raw) == _FREE_REFCOUNT:
                    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
            raw = np.empty(nbytes + ALIGNMENT, np.uint8)
            offset = -raw.ctypes.data % ALIGNMENT
            if len(raws) < MAX_PER_SIZE and self._pooled_bytes + nbytes <= MAX_POOLED_BYTES:
                raws.append((raw, offset))
                self._pooled_bytes += nbytes
        return raw[offset : offset + nbytes].view(dtype).reshape(shape)

    def clear(self) -> None:
        with self._lock:
            self._by_size.clear()
            self._pooled_bytes = 0


pool = BufferPool()
