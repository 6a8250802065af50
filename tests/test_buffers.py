"""The output-buffer pool must never hand out memory a caller still holds."""

import numpy as np

from flyte_hvd.core.buffers import ALIGNMENT, MIN_POOLED_BYTES, BufferPool


def test_buffer_is_reused_only_after_every_view_is_dropped():
    pool = BufferPool()
    shape = (MIN_POOLED_BYTES,)  # float32: 4x the pooling minimum
    first = pool.empty(shape, np.float32)
    address = first.ctypes.data
    second = pool.empty(shape, np.float32)
    assert second.ctypes.data != address  # `first` is still held
    part = first[5:9].reshape(2, 2)  # a view of a view keeps the memory too
    del first
    third = pool.empty(shape, np.float32)
    assert third.ctypes.data != address
    del part
    assert pool.empty(shape, np.float32).ctypes.data == address


def test_buffers_are_aligned_and_small_ones_not_pooled():
    pool = BufferPool()
    big = pool.empty((MIN_POOLED_BYTES, 3), np.float64)
    assert big.ctypes.data % ALIGNMENT == 0 and big.shape == (MIN_POOLED_BYTES, 3)
    small = pool.empty((4,), np.float32)
    del small
    assert pool._pooled_bytes == big.nbytes


def test_pool_stops_growing_at_its_limit():
    pool = BufferPool()
    held = [pool.empty((MIN_POOLED_BYTES,), np.uint8) for _ in range(10)]
    assert len(pool._by_size[MIN_POOLED_BYTES]) == 4  # MAX_PER_SIZE; the rest are plain arrays
    assert len({a.ctypes.data for a in held}) == 10
