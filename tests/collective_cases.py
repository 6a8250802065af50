"""Collective test cases, written once and run at size 1 (in the test process) and at sizes
2 and 3 (real rank processes). Each case asserts closed-form answers in ``rank`` and ``size``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import tempfile
import traceback

import numpy as np

import flyte_hvd.core as hvd
from flyte_hvd.core import shm

DTYPES = [np.float32, np.float64, np.int32, np.int64]
SHAPES = [(), (5,), (3, 4), (2, 3, 4)]
CASES: dict[str, object] = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def run_cases(names: list[str] | None = None) -> dict[str, str | None]:
    """Run every case on this rank; ``{name: None or traceback}``."""
    hvd.init()
    results: dict[str, str | None] = {}
    for name, fn in CASES.items():
        if names is not None and name not in names:
            continue
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
            # In the ranks' output too: if the ranks are now out of step, the run ends by the
            # stall bound, and this is where it started.
            print(f"case {name} failed on this rank:\n{results[name]}", file=sys.stderr)
    return results


def _base(shape, dtype):
    return (np.arange(math.prod(shape), dtype=np.int64) % 5 + 1).reshape(shape).astype(dtype)


@case
def allreduce_ops():
    r, n = hvd.rank(), hvd.size()
    for dtype in DTYPES:
        for shape in SHAPES:
            base = _base(shape, dtype)
            mine = base * (r + 1)
            out = hvd.allreduce(mine, op=hvd.Sum)
            assert out.dtype == dtype and out.shape == shape
            np.testing.assert_array_equal(out, base * (n * (n + 1) // 2))
            np.testing.assert_array_equal(hvd.allreduce(mine, op=hvd.Min), base)
            np.testing.assert_array_equal(hvd.allreduce(mine, op=hvd.Max), base * n)
            np.testing.assert_array_equal(
                hvd.allreduce(mine, op=hvd.Product), base**n * math.factorial(n)
            )
            avg = hvd.allreduce(mine, op=hvd.Average)
            if np.dtype(dtype).kind == "f":
                np.testing.assert_allclose(avg, base * (n + 1) / 2, rtol=1e-6)
            else:  # integer average rounds toward zero
                np.testing.assert_array_equal(avg, (base * (n * (n + 1) // 2)) // n)
            # The input is left untouched.
            np.testing.assert_array_equal(mine, base * (r + 1))


@case
def allreduce_of_several_chunks():
    """Longer than a shared-memory chunk (1 MiB), odd lengths, mismatch and join on the long
    path too: the copy in, the shares each rank reduces and the copy out meet exactly."""
    r, n = hvd.rank(), hvd.size()
    for dtype, count in ((np.float64, 300_001), (np.int32, 700_003), (np.float16, 1_000_001)):
        base = (np.arange(count, dtype=np.int64) % 7 + 1).astype(dtype)
        np.testing.assert_array_equal(hvd.allreduce(base * (r + 1), op=hvd.Max), base * n)
        if dtype != np.float16:
            total = hvd.allreduce(base * (r + 1), op=hvd.Sum)
            np.testing.assert_array_equal(total, base * (n * (n + 1) // 2))
    # A fusion buffer of several chunks, its parts packed straight into the segment.
    counts = [1 + (i * 7919) % 40_000 for i in range(40)]
    parts = [np.full(c, float(r + i), np.float32) for i, c in enumerate(counts)]
    fused = hvd.grouped_allreduce(parts, op=hvd.Sum, prescale_factor=2.0)
    for i, (c, got) in enumerate(zip(counts, fused, strict=True)):
        np.testing.assert_array_equal(got, np.full(c, 2.0 * (n * i + n * (n - 1) / 2)))
    halves = hvd.allreduce(np.full(400_001, r + 1.0), op=hvd.Average)
    np.testing.assert_allclose(halves, np.full(400_001, (n + 1) / 2))
    flat = np.full(300_000, float(r))  # the optimizers' in-place reduction
    from flyte_hvd.core.collectives import reduce_in_place
    from flyte_hvd.core.state import comm

    reduce_in_place(comm(), flat, hvd.Sum, hvd.Compression.none, 1.0, None, lambda: "flat")
    np.testing.assert_array_equal(flat, np.full(300_000, n * (n - 1) / 2))
    if n > 1:
        for count in (300_000, 600_000):  # 600_000 float64: two ranks' ring
            try:
                hvd.allreduce(np.ones(count + r))
            except hvd.CollectiveMismatchError as e:
                assert f"shape=({count},)" in str(e) and f"shape=({count + 1},)" in str(e), e
            else:
                raise AssertionError("long allreduces of different shapes ran")
        if r == 0:
            hvd.join()
        else:
            got = hvd.allreduce(np.ones(300_000), op=hvd.Sum)
            np.testing.assert_array_equal(got, np.full(300_000, n - 1.0))
            got = hvd.allreduce(np.ones(600_000), op=hvd.Sum)  # where two ranks go by the ring
            np.testing.assert_array_equal(got, np.full(600_000, n - 1.0))
            parts = [np.ones(1_100_000, np.float32), np.ones(600_000)]
            fused = hvd.grouped_allreduce(parts, op=hvd.Sum)
            assert [f.tolist() == [n - 1] * len(f) for f in fused] == [True, True]
            hvd.join()


@case
def long_allreduces_back_to_back():
    """Long reductions of different lengths, each right after the other: the two sets of
    slots and results alternate between chunks and calls without one call's copies
    overtaking the others' reads."""
    from flyte_hvd.core import state

    r, n = hvd.rank(), hvd.size()
    channel = shm.channel(state.comm()) if n > 1 else None
    channel = channel if isinstance(channel, shm.Channel) else None  # one host: counted waits
    for i, count in enumerate((900_000, 262_145, 70_000, 1_300_001, 10, 524_288)):
        value = float(i + 1)
        before = channel._epoch if channel else 0
        got = hvd.allreduce(np.full(count, value * (r + 1), np.float32), op=hvd.Sum)
        np.testing.assert_array_equal(got, np.full(count, value * n * (n + 1) / 2, np.float32))
        if channel and count * 4 > shm.SMALL_BYTES:  # one wait per chunk, and one at the end
            assert channel._epoch - before == -(-count * 4 // shm.CHUNK_BYTES) + 1


@case
def reductions_in_a_ring():
    """Reductions from 1 MB (two ranks; in place 32 MB) and 4 MB (more ranks; in place 8 MB),
    which ranks over MPI reduce in a ring of their own, in chunks: every op and dtype, odd
    lengths, out of place and in place, a fusion buffer of each dtype, and the same bits on
    every rank."""
    from flyte_hvd.core.collectives import reduce_in_place
    from flyte_hvd.core.state import comm

    r, n = hvd.rank(), hvd.size()
    for dtype, count in ((np.float64, 600_001), (np.int32, 1_100_003), (np.float32, 2_500_001)):
        base = (np.arange(count, dtype=np.int64) % 7 + 1).astype(dtype)
        np.testing.assert_array_equal(hvd.allreduce(base * (r + 1), op=hvd.Max), base * n)
        np.testing.assert_array_equal(hvd.allreduce(base * (r + 1), op=hvd.Min), base)
        total = hvd.allreduce(base * (r + 1), op=hvd.Sum)
        np.testing.assert_array_equal(total, base * (n * (n + 1) // 2))
    mean = hvd.allreduce(np.full(700_001, r + 1.0), op=hvd.Average)
    np.testing.assert_allclose(mean, np.full(700_001, (n + 1) / 2))
    product = hvd.allreduce(np.full(1_200_000, 2.0, np.float32), op=hvd.Product)
    np.testing.assert_array_equal(product, np.full(1_200_000, 2.0**n, np.float32))
    # The optimizers' in-place reduction: below both thresholds, the ring's with more ranks
    # only, and the ring's with any.
    for count in (1_300_001, 2_600_001, 8_400_001):
        values = (np.arange(count) % 1000).astype(np.float32)
        flat = values + r
        reduce_in_place(comm(), flat, hvd.Sum, hvd.Compression.none, 1.0, None, lambda: "flat")
        np.testing.assert_array_equal(flat, values * n + n * (n - 1) / 2)
        total = hvd.allreduce(values * (r + 1), op=hvd.Sum)
        np.testing.assert_array_equal(total, values * (n * (n + 1) // 2))
    parts = [np.full(1_100_000, r + 1.0, np.float32), np.full(600_000, r + 1.0)]
    parts += [np.full(5, r + 1.0, np.float32)]  # two buffers: one per dtype
    for got in hvd.grouped_allreduce(parts, op=hvd.Sum):
        np.testing.assert_array_equal(got, np.full(got.shape, n * (n + 1) / 2))
    rng = np.random.default_rng(r)
    for op in (hvd.Sum, hvd.Average, hvd.Product):
        got = hvd.allreduce(rng.normal(size=1_048_583).astype(np.float32), op=op)
        every = hvd.allgather(got[::97].reshape(1, -1))
        assert (every == every[0]).all(), op


@case
def allreduce_scale_factors():
    n = hvd.size()
    out = hvd.allreduce(
        np.ones(4, np.float32), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5
    )
    np.testing.assert_allclose(out, np.full(4, n, np.float32))


@case
def grouped_allreduce_matches_one_by_one():
    r = hvd.rank()
    sizes = np.random.default_rng(1234).integers(1, 50, size=200)  # same shapes on all ranks
    rng = np.random.default_rng(r)
    arrays = [rng.normal(size=int(n)).astype(np.float32) for n in sizes]
    arrays += [np.full((2, 2), r, np.int64), np.full(3, r + 0.5, np.float64)]
    one_by_one = [hvd.allreduce(a, op=hvd.Average) for a in arrays]
    fused = hvd.grouped_allreduce(arrays, op=hvd.Average)
    assert len(fused) == len(arrays)
    for a, b in zip(one_by_one, fused, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        # The routes may add in different orders (a small array in the agreement's records in
        # rank order, a fused one by MPI's algorithm): float32 rounding, near zero too.
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@case
def grouped_allreduce_with_small_fusion_threshold():
    n = hvd.size()
    old = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "64"  # 16 float32 per buffer: many buffers
    try:
        arrays = [np.full(7, i, np.float32) for i in range(30)]
        out = hvd.grouped_allreduce(arrays, op=hvd.Sum)
    finally:
        if old is None:
            del os.environ["HOROVOD_FUSION_THRESHOLD"]
        else:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = old
    for i, a in enumerate(out):
        np.testing.assert_array_equal(a, np.full(7, i * n, np.float32))


@case
def fp16_compression_within_tolerance():
    r, n = hvd.rank(), hvd.size()
    x = np.linspace(-1, 1, 1000, dtype=np.float32) * (r + 1)
    exact = np.linspace(-1, 1, 1000, dtype=np.float32) * (n + 1) / 2
    out = hvd.allreduce(x, op=hvd.Average, compression=hvd.Compression.fp16)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, exact, atol=5e-3)
    grouped = hvd.grouped_allreduce([x, x * 2], compression=hvd.Compression.fp16)
    np.testing.assert_allclose(grouped[1], exact * 2, atol=1e-2)


@case
def allgather_ragged():
    r, n = hvd.rank(), hvd.size()
    for dtype in DTYPES:
        mine = np.full((r + 1, 3), r, dtype=dtype)
        out = hvd.allgather(mine)
        expected = np.concatenate([np.full((k + 1, 3), k, dtype=dtype) for k in range(n)])
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(hvd.allgather(np.int64(r)), np.arange(n))
    # Parts of no bytes: rows of no width, no rows on any rank, rank 0's one row alone.
    assert hvd.allgather(np.ones((2, 0))).shape == (2 * n, 0)
    assert hvd.allgather(np.ones((0, 3))).shape == (0, 3)
    np.testing.assert_array_equal(
        hvd.allgather(np.full((0 if r else 1, 3), 7.0)), np.full((1, 3), 7.0)
    )
    # Parts on both sides of what the agreement's record carries over MPI (256 KB between two
    # ranks, 64 KB for more; from 32 KB sent from the caller's array): in the records, some
    # in and some not, none in; between two ranks the other's part received into the output
    # and longer or shorter than this rank's.
    for rows in (
        [1, 2, 3],
        [1, 20_000, 3],
        [5_000, 20_000, 3],
        [20_000, 60_000, 3],
        [40_000, 50_000, 45_000],
    ):
        mine = np.full((rows[r % 3], 2), r, np.float32)
        out = hvd.allgather(mine)
        expected = np.concatenate([np.full((rows[k % 3], 2), k, np.float32) for k in range(n)])
        np.testing.assert_array_equal(out, expected)


@case
def calls_of_32_to_256_kib_give_every_rank_the_same_bits():
    """Over MPI such calls ride in the agreement's records, sent from the caller's array
    behind the record's header (no copy into the record): every rank reduces to the same bits,
    broadcasts land whole from any root, and the callers' arrays are left as they were."""
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(7 + r)
    for count in (4_000, 6_000, 10_000, 40_000, 70_000):  # 16 KB to 280 KB of float32
        x = rng.normal(size=count).astype(np.float32)
        kept = x.copy()
        parts = hvd.allgather(x[None])  # every rank's input, in rank order
        for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Average):
            out = hvd.allreduce(x, op=op)
            everyone = hvd.allgather(out[None])
            assert (everyone == everyone[0]).all(), (count, op)
        np.testing.assert_allclose(
            hvd.allreduce(x, op=hvd.Sum), parts.sum(axis=0), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Max), parts.max(axis=0))
        # A fusion buffer is reduced in place: on every rank its own part is the output too.
        for got, times in zip(hvd.grouped_allreduce([x, x * 2], op=hvd.Sum), (1, 2), strict=True):
            everyone = hvd.allgather(got[None])
            assert (everyone == everyone[0]).all(), count
            np.testing.assert_allclose(got, parts.sum(axis=0) * times, rtol=1e-5, atol=1e-5)
        for root in range(n):
            np.testing.assert_array_equal(hvd.broadcast(x, root_rank=root), parts[root])
            y = x.copy()
            assert hvd.broadcast(y, root_rank=root, in_place=True) is y
            np.testing.assert_array_equal(y, parts[root])
        np.testing.assert_array_equal(x, kept)


@case
def long_gathers_and_broadcasts():
    """Allgathers and broadcasts longer than a chunk, ragged, with empty ranks, between long
    allreduces: each rank's bytes land at its offset, and no call's copies overtake another
    call's reads of the shared segment."""
    from flyte_hvd.core import state

    r, n = hvd.rank(), hvd.size()
    channel = shm.channel(state.comm()) if n > 1 else None
    channel = channel if isinstance(channel, shm.Channel) else None  # one host: counted waits
    rows = [(k * 700_001) % 900_000 for k in range(n)]  # rank 0 sends no rows
    for i, row_items in enumerate((1, 3)):
        mine = np.full((rows[r], row_items), r + 10 * i, np.float32)
        before = channel._epoch if channel else 0
        out = hvd.allgather(mine)
        if channel:  # one wait per chunk of the longest part, and one at the end
            assert channel._epoch - before == -(-max(rows) * row_items * 4 // shm.CHUNK_BYTES) + 1
        expected = np.concatenate(
            [np.full((rows[k], row_items), k + 10 * i, np.float32) for k in range(n)]
        )
        np.testing.assert_array_equal(out, expected)
        got = hvd.allreduce(np.full(600_000, r + 1.0, np.float32), op=hvd.Sum)
        np.testing.assert_array_equal(got, np.full(600_000, n * (n + 1) / 2, np.float32))
    empty = hvd.allgather(np.zeros((0, 2), np.int64))
    assert empty.shape == (0, 2), empty.shape
    assert hvd.allgather(np.zeros((2, 0))).shape == (2 * n, 0)
    assert hvd.allgather(np.zeros((r + 1, 0))).shape == (n * (n + 1) // 2, 0)  # ragged
    # On one host: 3.1 MB through the segment in chunks, 16.8 MB over MPI (from 4 MiB).
    for root, length in itertools.product(range(n), (390_001, 2_100_003)):
        long = np.arange(length, dtype=np.int64) * (r == root) + root
        out = hvd.broadcast(long, root_rank=root)
        np.testing.assert_array_equal(out, np.arange(length, dtype=np.int64) + root)
        got = hvd.allreduce(np.full(700_000, float(r)), op=hvd.Max)
        np.testing.assert_array_equal(got, np.full(700_000, n - 1.0))
    assert hvd.broadcast(np.zeros((0, 3)), root_rank=0).shape == (0, 3)
    # Long broadcasts from the caller's own array: the root's output is a copy of it (made
    # while it is sent), a strided array is made contiguous once, async calls send their copy.
    mine = np.full(600_000, float(r))
    out = hvd.broadcast(mine, root_rank=0)
    mine[:] = -1.0
    np.testing.assert_array_equal(out, np.zeros(600_000))
    base = np.arange(2_200_000, dtype=np.float64).reshape(-1, 2) * (r == n - 1)
    out = hvd.broadcast(base[:, 0], root_rank=n - 1)
    np.testing.assert_array_equal(out, np.arange(0, 2_200_000, 2, dtype=np.float64))
    assert not np.shares_memory(out, base)
    handle = hvd.broadcast_async(np.full(600_000, float(r)), root_rank=n - 1)
    np.testing.assert_array_equal(hvd.synchronize(handle), np.full(600_000, n - 1.0))
    if n > 1:  # a mismatch on the long path raises on every rank, and the next call works
        try:
            hvd.broadcast(np.ones(2_000_000 + r), root_rank=0)
        except hvd.CollectiveMismatchError as e:
            assert "shape=(2000000,)" in str(e) and "shape=(2000001,)" in str(e), str(e)
        else:
            raise AssertionError("broadcasts of different shapes ran")
        assert hvd.broadcast(np.full(3, float(r)), root_rank=n - 1).tolist() == [n - 1.0] * 3


@case
def broadcast_from_every_root():
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        for dtype in DTYPES:
            out = hvd.broadcast(np.full((2, 3), r * 10, dtype=dtype), root_rank=root)
            np.testing.assert_array_equal(out, np.full((2, 3), root * 10, dtype=dtype))
        flags = hvd.broadcast(np.array([r == root, True]), root_rank=root)
        assert flags.dtype == np.bool_ and flags.tolist() == [True, True]


@case
def small_calls_of_one_kind_return_arrays_of_their_own():
    """Small allgathers and broadcasts (their data in the agreement's records, what depends on
    their kind worked out once): repeated calls of one kind each get their own values, never a
    view of the records the next call overwrites; a scalar and a strided array (the general
    path) alike."""
    r, n = hvd.rank(), hvd.size()
    gathered, broadcast = [], []
    for i in range(3):
        mine = np.full((2, 3), 10 * i + r, np.int16)
        gathered.append(hvd.allgather(mine))
        broadcast.append(hvd.broadcast(mine, root_rank=n - 1))
        assert not np.shares_memory(broadcast[-1], mine)
    for i in range(3):
        expected = np.repeat(10 * i + np.arange(n), 2)[:, None] * np.ones(3, np.int64)
        np.testing.assert_array_equal(gathered[i], expected)
        np.testing.assert_array_equal(broadcast[i], np.full((2, 3), 10 * i + n - 1))
    scalar = hvd.broadcast(np.array(float(r)), root_rank=0)
    assert scalar.shape == () and scalar == 0.0
    strided = np.arange(8, dtype=np.float32).reshape(2, 4)[:, ::2] + r
    np.testing.assert_array_equal(
        hvd.allgather(strided), np.concatenate([strided - r + k for k in range(n)])
    )


@case
def arrays_in_another_byte_order_take_part_by_value():
    """A big-endian array (read from a file in that order, say) takes part by its values, with
    ranks whose arrays are native: MPI moves native numbers only, and the agreement sees the
    same dtype number for both orders."""
    r, n = hvd.rank(), hvd.size()
    order = ">" if r % 2 == 0 else "<"
    ints = np.array([r + 1, 1000 * (r + 1)], np.dtype(f"{order}i4"))
    np.testing.assert_array_equal(
        hvd.allreduce(ints, op=hvd.Sum), [n * (n + 1) // 2, 1000 * n * (n + 1) // 2]
    )
    np.testing.assert_array_equal(
        hvd.allgather(ints), np.concatenate([[k + 1, 1000 * (k + 1)] for k in range(n)])
    )
    floats = np.full(3, r + 0.5, np.dtype(f"{order}f8"))
    np.testing.assert_array_equal(hvd.broadcast(floats, root_rank=0), np.full(3, 0.5))
    hvd.broadcast(floats, root_rank=n - 1, in_place=True)  # into the caller's array
    np.testing.assert_array_equal(floats, np.full(3, n - 0.5))


@case
def alltoall_with_and_without_splits():
    r, n = hvd.rank(), hvd.size()
    # Rank r sends (i + 1) rows of value 100 * r + i to rank i.
    splits = [i + 1 for i in range(n)]
    rows = np.concatenate([np.full((i + 1, 2), 100 * r + i) for i in range(n)]).astype(np.float32)
    out, received = hvd.alltoall(rows, splits=splits)
    np.testing.assert_array_equal(received, np.full(n, r + 1))
    expected = np.concatenate([np.full((r + 1, 2), 100 * k + r) for k in range(n)])
    np.testing.assert_array_equal(out, expected.astype(np.float32))
    even, received = hvd.alltoall(np.arange(2 * n, dtype=np.int32) + 1000 * r)
    expected = np.concatenate([[1000 * k + 2 * r, 1000 * k + 2 * r + 1] for k in range(n)])
    np.testing.assert_array_equal(even, expected)


@case
def reducescatter_uneven_rows():
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1
    x = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * (r + 1)
    out = hvd.reducescatter(x, op=hvd.Sum)
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    count = base + (1 if r < extra else 0)
    full = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * (n * (n + 1) / 2)
    np.testing.assert_array_equal(out, full[start : start + count])
    avg = hvd.reducescatter(x, op=hvd.Average)
    np.testing.assert_allclose(avg, full[start : start + count] / n)


@case
def barrier_and_join():
    hvd.barrier()
    last = hvd.join()
    assert 0 <= last < hvd.size()
    assert hvd.allgather(np.int64(last)).tolist() == [last] * hvd.size()


@case
def objects():
    r, n = hvd.rank(), hvd.size()
    got = hvd.broadcast_object({"rank": r, "f": lambda x: x + r}, root_rank=n - 1)
    assert got["rank"] == n - 1 and got["f"](1) == n
    assert hvd.allgather_object(("r", r)) == [("r", k) for k in range(n)]


@case
def topology_single_host():
    r, n = hvd.rank(), hvd.size()
    assert (hvd.local_rank(), hvd.local_size()) == (r, n)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() and hvd.is_initialized() and hvd.mpi_enabled()


@case
def mismatched_shapes_raise_on_every_rank():
    if hvd.size() == 1:
        return
    r = hvd.rank()
    kept = np.full(10_000 + 20_000 * r, -1.0, np.float32)
    for call in (
        lambda: hvd.allreduce(np.ones(3 + r, np.float32)),
        lambda: hvd.allreduce(np.ones(3, np.float32 if r else np.float64)),
        # One rank on the small path's shortcut, the other on the general path.
        lambda: hvd.allreduce(
            np.ones(3), compression=hvd.Compression.fp16 if r else hvd.Compression.none
        ),
        lambda: hvd.broadcast(np.ones((2, 2 + r)), root_rank=0),
        lambda: hvd.allgather(np.ones((2, 1 + r))),
        lambda: hvd.allgather(np.ones((2, r))),  # rank 0's rows hold no bytes
        lambda: hvd.allgather(np.ones((1 + r, 2), np.float32 if r else np.float64)),  # ragged
        lambda: hvd.grouped_allreduce([np.ones(2), np.ones(2 + r)]),
        lambda: hvd.broadcast(np.ones(2), root_rank=r),
        # Over MPI, one rank's data fits the agreement's record (64 KB) and the other's not.
        lambda: hvd.allreduce(np.ones(10_000 + 20_000 * r, np.float32)),
        lambda: hvd.broadcast(np.ones(10_000 + 20_000 * r, np.float32), root_rank=0),
        # On one host, one rank's broadcast goes through the segment (under 4 MiB), the
        # other's over MPI.
        lambda: hvd.broadcast(np.ones(400_000 + 400_000 * r), root_rank=0),
        lambda: hvd.allgather(np.ones((10, 1000 + 2000 * r), np.float32)),
        lambda: hvd.allreduce(np.ones(3), op=hvd.Sum if r else hvd.Max),
        lambda: hvd.broadcast(kept, root_rank=0, in_place=True),
    ):
        try:
            call()
        except hvd.CollectiveMismatchError as e:
            assert isinstance(e, RuntimeError) and isinstance(e, ValueError)
            assert "rank 0:" in str(e) and "rank 1:" in str(e), str(e)
        else:
            raise AssertionError("mismatch was not detected")
    # A failed in-place broadcast left the receivers' arrays as they were.
    np.testing.assert_array_equal(kept, np.full(10_000 + 20_000 * r, -1.0, np.float32))
    # The communicator is still usable afterwards.
    assert hvd.allreduce(np.ones(1), op=hvd.Sum)[0] == hvd.size()


@case
def bad_arguments_raise():
    n = hvd.size()
    try:
        hvd.allreduce(np.ones(2), op=42)
    except ValueError as e:
        assert "op" in str(e).lower()
    else:
        raise AssertionError("bad op accepted")
    for adasum in (
        lambda: hvd.allreduce(np.ones(2), op=hvd.Adasum),
        lambda: hvd.reducescatter(np.ones(2), op=hvd.Adasum),
    ):
        try:
            adasum()
        except NotImplementedError as e:  # a RuntimeError, as Horovod raises
            assert "Adasum" in str(e) and "not supported" in str(e)
        else:
            raise AssertionError("Adasum accepted")
    for root in (n, -1, "0"):
        try:
            hvd.broadcast(np.ones(2), root_rank=root)
        except ValueError as e:
            assert "does not exist" in str(e)
        else:
            raise AssertionError(f"root_rank={root!r} accepted")
    try:
        hvd.allreduce(np.array(["a", "b"]))
    except ValueError as e:
        assert "numeric" in str(e)
    else:
        raise AssertionError("string array accepted")


@case
def timeline_records_each_collective():
    n = hvd.size()
    folder = tempfile.mkdtemp() if hvd.rank() == 0 else None
    path = os.path.join(hvd.broadcast_object(folder), "timeline.json")
    hvd.start_timeline(path)
    hvd.allreduce(np.ones(10, np.float32), name="grad.0")
    hvd.allgather(np.ones((1, 2)))
    hvd.broadcast(np.ones(3), root_rank=0)
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path) as f:
            trace = json.load(f)
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert len(events) == 3 * n, events
        assert sorted({e["pid"] for e in events}) == list(range(n))
        names = {e["name"] for e in events}
        assert {"grad.0", "allgather", "broadcast"} <= names
        assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in events)
    hvd.barrier()


@case
def small_allreduces_in_every_form():
    """Small allreduces take a shortcut where they can (C-contiguous ndarray, no compression
    or scaling): every other form, and a mix of forms across ranks, gives the same result."""
    r, n = hvd.rank(), hvd.size()
    total = n * (n + 1) // 2
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    for _ in range(3):  # the same kind of call again, as a training loop makes it
        got = hvd.allreduce(base * (r + 1), op=hvd.Sum)
        assert got.shape == (3, 4) and got.dtype == np.float32
        np.testing.assert_array_equal(got, base * total)
    strided = (np.arange(24, dtype=np.float64) * (r + 1))[::2]  # not contiguous
    np.testing.assert_array_equal(hvd.allreduce(strided, op=hvd.Sum), np.arange(0, 24, 2) * total)
    # One rank passes a list, the others an array: the same call, the same result.
    mine = [1.0, 2.0] if r == 0 else np.array([1.0, 2.0])
    np.testing.assert_array_equal(hvd.allreduce(mine, op=hvd.Sum), [n, 2.0 * n])
    scalar = hvd.allreduce(np.float64(r + 1), op=hvd.Max)
    assert scalar.shape == () and scalar == n
    assert hvd.allreduce(np.array([r], np.int32), op=1)[0] == n * (n - 1) // 2  # op as an int
    np.testing.assert_array_equal(
        hvd.allreduce(np.array([r + 1, -(r + 1)], np.int64)),  # Average of ints: toward zero
        np.trunc(np.array([total, -total]) / n).astype(np.int64),
    )
    np.testing.assert_allclose(
        hvd.allreduce(np.full(2, r + 1.0), prescale_factor=2.0), np.full(2, 2.0 * total / n)
    )
    out = hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum)
    out += 1  # the caller owns the result: the next call does not overwrite it
    hvd.allreduce(np.zeros(2, np.float32), op=hvd.Sum)
    np.testing.assert_array_equal(out, np.full(2, n + 1.0))
    try:
        hvd.allreduce(np.ones(2), op=1.0)
    except ValueError as e:
        assert "unknown reduction op" in str(e), str(e)
    else:
        raise AssertionError("a float op was accepted")


@case
def every_rank_gets_the_same_bits():
    """Float sums depend on the order of the additions; whatever route a reduction takes,
    every rank must get the same result (a model's replicas must not drift apart)."""
    rng = np.random.default_rng(hvd.rank())
    for count in (1, 7, 1000, 5000, 300_000):
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            got = hvd.allreduce(rng.normal(size=count).astype(np.float32), op=op)
            every = hvd.allgather(got.reshape(1, -1))
            assert (every == every[0]).all(), (count, op)


@case
def records_in_one_allgather_above_eight_ranks():
    """Over MPI above ``P2P_MAX_RANKS`` ranks the records go in one Allgather of fixed-size
    records: the same collectives and the same errors, here on a communicator of this run
    that takes that way."""
    from flyte_hvd.core import collectives, state, transport
    from flyte_hvd.core.transport import mpi, records

    comm = state.comm().Dup()
    limit, records.P2P_MAX_RANKS = records.P2P_MAX_RANKS, 1
    try:
        route = transport.of(comm)
        if type(route) is not mpi.MpiTransport or route.size == 1:
            return  # shared memory or one rank: no records over MPI
        assert not route.records.p2p and route.eager <= 65536 // route.size
        r, n = hvd.rank(), hvd.size()
        for count in (3, 5000, 100_000):  # in the records, then not
            got = collectives.allreduce_on(comm, np.full(count, r + 1.0), hvd.Sum)
            np.testing.assert_array_equal(got, np.full(count, n * (n + 1) / 2))
            part = np.full((r + 1, count // 100 + 1), r, np.float32)
            gathered = collectives.allgather_on(comm, part)
            assert gathered.shape[0] == n * (n + 1) // 2
            assert (gathered[-n:] == n - 1).all()
            sent = np.arange(count, dtype=np.float32) + (r == n - 1)
            np.testing.assert_array_equal(
                collectives.broadcast_on(comm, sent, n - 1), np.arange(count) + 1.0
            )
        if state.checks_collectives():
            try:
                collectives.allreduce_on(comm, np.ones(3 + r), hvd.Sum)
            except hvd.CollectiveMismatchError as e:
                assert "rank 0:" in str(e) and "rank 1:" in str(e), str(e)
            else:
                raise AssertionError("mismatch was not detected")
    finally:
        records.P2P_MAX_RANKS = limit
        transport.forget(comm)
        comm.Free()


@case
def integer_average_rounds_toward_zero():
    r, n = hvd.rank(), hvd.size()
    mine = np.array([-3, 3, -1], np.int64) * (r + 1)
    total = np.array([-3, 3, -1], np.int64) * (n * (n + 1) // 2)
    expected = np.trunc(total / n).astype(np.int64)
    np.testing.assert_array_equal(hvd.allreduce(mine), expected)


@case
def join_serves_reductions_of_the_other_ranks():
    r, n = hvd.rank(), hvd.size()
    for early in range(n):
        if r == early:
            last = hvd.join()
        else:
            got = hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum, name="rows")
            np.testing.assert_array_equal(got, np.full(3, n - 1, np.float32))
            lo = hvd.allreduce(np.array([r + 1.0]), op=hvd.Min)  # the joined rank adds +inf
            assert lo[0] == (2.0 if early == 0 else 1.0), lo
            fused = hvd.grouped_allreduce([np.ones(2), np.ones(5, np.int32)], op=hvd.Sum)
            assert fused[0].tolist() == [n - 1] * 2 and fused[1].tolist() == [n - 1] * 5
            handle = hvd.allreduce_async(np.full(2, 2.0), op=hvd.Average)
            np.testing.assert_allclose(hvd.synchronize(handle), np.full(2, 2.0 * (n - 1) / n))
            for refused in (
                lambda: hvd.allgather(np.ones(1)),
                lambda early=early: hvd.broadcast(np.ones(1), root_rank=early),
                # Data in the records for the joined rank, which takes none.
                lambda: hvd.allgather(np.ones(8_000)),
                lambda early=early: hvd.broadcast(np.ones(8_000), (early + 1) % n),
            ):
                try:
                    refused()
                except hvd.CollectiveMismatchError as e:
                    assert f"rank(s) [{early}] are inside hvd.join()" in str(e), str(e)
                else:
                    raise AssertionError("a collective other than allreduce ran with a joined rank")
            last = hvd.join()
        if n > 1:
            assert last != early
        assert hvd.allgather_object(last) == [last] * n


@case
def process_set_of_some_ranks():
    r, n = hvd.rank(), hvd.size()
    ranks = [0, n - 1] if n > 2 else [n - 1]  # never all ranks: that is the global set
    if n == 1:
        try:
            hvd.add_process_set(ranks)
        except ValueError as e:
            assert "already registered" in str(e)
        else:
            raise AssertionError("a set of all ranks was accepted")
        return
    k = len(ranks)
    ends = hvd.add_process_set(ranks)
    try:
        assert ends.ranks == ranks and ends.size() == k and ends.included() == (r in ranks)
        if ends.included():
            got = hvd.allreduce(np.full(2, float(r)), op=hvd.Sum, process_set=ends)
            np.testing.assert_array_equal(got, np.full(2, float(sum(ranks))))
            assert hvd.allgather(np.array([r]), process_set=ends).tolist() == ranks
            # root_rank is a global rank
            assert hvd.broadcast(np.array([r]), root_rank=n - 1, process_set=ends)[0] == n - 1
            out, received = hvd.alltoall(np.array([r] * k), process_set=ends)
            assert out.tolist() == ranks and received.tolist() == [1] * k
            rs = hvd.reducescatter(np.ones(2 * k), op=hvd.Sum, process_set=ends)
            assert rs.tolist() == [k, k]
            h = hvd.allreduce_async(np.ones(1), op=hvd.Sum, process_set=ends)
            assert hvd.synchronize(h).tolist() == [float(k)]
            hvd.barrier(process_set=ends)
        else:
            try:
                hvd.allreduce(np.ones(1), process_set=ends)
            except ValueError as e:
                assert "is not in" in str(e)
            else:
                raise AssertionError("a non-member ran a collective on the set")
        assert hvd.allreduce(np.ones(1), op=hvd.Sum)[0] == n  # the global set still works
    finally:
        assert hvd.remove_process_set(ends)
    for bad in ([], [0, 0], [n]):
        try:
            hvd.add_process_set(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"process set {bad} accepted")


@case
def async_ops_return_handles():
    r, n = hvd.rank(), hvd.size()
    handles = [
        hvd.allreduce_async(np.ones(3) * r, op=hvd.Sum, name="a"),
        hvd.allgather_async(np.array([r]), name="g"),
        hvd.broadcast_async(np.array([r]), root_rank=n - 1),
        hvd.reducescatter_async(np.ones(n), op=hvd.Sum),
        hvd.grouped_allgather_async([np.array([r]), np.array([r, r])]),
        hvd.grouped_reducescatter_async([np.ones(n)], op=hvd.Sum),
        hvd.alltoall_async(np.arange(n) + 10 * r),
    ]
    a, g, b, rs, gg, grs, (a2a, _) = [hvd.synchronize(h) for h in handles]
    assert a.tolist() == [n * (n - 1) / 2] * 3 and g.tolist() == list(range(n))
    assert b.tolist() == [n - 1] and rs.tolist() == [float(n)]
    assert gg[0].tolist() == list(range(n)) and grs[0].tolist() == [float(n)]
    assert a2a.tolist() == [r + 10 * k for k in range(n)]
    try:
        hvd.synchronize(object())
    except ValueError as e:
        assert "takes the handle" in str(e)
    else:
        raise AssertionError("synchronize accepted a non-handle")
