"""ArrowDataLoader on Parquet written here with pyarrow: disjoint balanced shards, the same
number of batches on every rank, shuffling, caching, the background reader, tf.data."""

from __future__ import annotations

import math
import os
import threading
import tracemalloc
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flyte_hvd.data.dataset import read_metadata_fs
from flyte_hvd.data.loader import (
    ArrowDataLoader,
    AsyncArrowDataLoader,
    AsyncDataLoaderMixin,
    BaseDataLoader,
)

# Uneven files, one of them empty, some with several row groups.
FILE_ROWS = [7, 0, 13, 1, 30, 2, 50]
TOTAL = sum(FILE_ROWS)


def write_dataset(root, file_rows=FILE_ROWS, row_group_size=8) -> str:
    """Files of rows with ``id`` 0..N-1, ``x`` = [id, id + 0.5, -id] and ``y`` = 2 * id."""
    os.makedirs(root, exist_ok=True)
    start = 0
    for i, n in enumerate(file_rows):
        ids = np.arange(start, start + n, dtype=np.int64)
        x = np.stack([ids, ids + 0.5, -ids], axis=1).astype(np.float32).reshape(-1)
        table = pa.table(
            {
                "id": ids,
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x), 3),
                "y": (2 * ids).astype(np.float32),
            }
        )
        pq.write_table(
            table, os.path.join(root, f"part-{i:03d}.parquet"), row_group_size=row_group_size
        )
        start += n
    return str(root)


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data")


def ids_of(batches) -> list[int]:
    return [int(i) for b in batches for i in b["id"]]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_shards_are_disjoint_balanced_and_equal_in_steps(dataset, size):
    bs = 4
    shards = []
    for rank in range(size):
        loader = ArrowDataLoader(dataset, bs, rank=rank, size=size, shuffle=False)
        batches = list(loader)
        assert len(loader) == len(batches) == math.ceil(TOTAL / (size * bs))
        assert all(len(b["id"]) == bs for b in batches)
        expected_rows = (rank + 1) * TOTAL // size - rank * TOTAL // size
        assert loader.shard_rows == expected_rows
        # Unshuffled, the shard comes first, in order, then wraps around.
        stream = ids_of(batches)
        shard = stream[:expected_rows]
        assert shard == list(range(rank * TOTAL // size, (rank + 1) * TOTAL // size))
        assert set(stream) == set(shard)
        shards.append(set(shard))
    assert set().union(*shards) == set(range(TOTAL))
    assert sum(len(s) for s in shards) == TOTAL


def test_short_shard_wraps_around(tmp_path):
    path = write_dataset(tmp_path / "d", [10])
    # Shards of 3, 3 and 4 rows; 3 steps of 4 rows means 12 rows from each shard.
    for rank, shard_rows in enumerate([3, 3, 4]):
        loader = ArrowDataLoader(path, 4, rank=rank, size=3, steps_per_epoch=3, seed=1)
        counts = Counter(ids_of(loader))
        assert sum(counts.values()) == 12
        assert len(counts) == shard_rows
        if shard_rows == 3:
            assert set(counts.values()) == {4}  # whole passes, each row once per pass


def test_one_parquet_file_is_a_dataset_too(tmp_path):
    """A path naming one Parquet file (not a folder of them) reads as a dataset of that file;
    a missing path is still refused by name."""
    path = str(tmp_path / "one.parquet")
    pq.write_table(pa.table({"id": np.arange(20), "x": np.arange(20.0)}), path, row_group_size=6)
    for rank, rows in enumerate([range(10), range(10, 20)]):
        loader = ArrowDataLoader(path, 5, rank=rank, size=2, shuffle=False)
        assert sorted(ids_of(loader)) == list(rows)
    with pytest.raises(ValueError, match=r"no Parquet dataset at `.*missing\.parquet`"):
        ArrowDataLoader(str(tmp_path / "missing.parquet"), 5)


def test_each_row_once_per_epoch_in_a_new_order(tmp_path):
    path = write_dataset(tmp_path / "d", [16] * 8)  # 128 rows, shards of 64
    loader = ArrowDataLoader(path, 8, rank=1, size=2, shuffle_buffer_size=16, seed=7)
    assert len(loader) == 8
    epochs = [ids_of(loader) for _ in range(3)]
    for ids in epochs:
        assert sorted(ids) == list(range(64, 128))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(64, 128))
    again = ArrowDataLoader(path, 8, rank=1, size=2, shuffle_buffer_size=16, seed=7)
    assert ids_of(again.iter_epoch(1)) == epochs[1]  # seeded by (seed, epoch, rank)


def test_shuffle_buffer_mixes_rows_across_row_groups(tmp_path):
    path = write_dataset(tmp_path / "d", [100] * 4, row_group_size=50)  # 8 row groups

    def groups_per_batch(buffer: int) -> list[int]:
        loader = ArrowDataLoader(path, 10, shuffle_buffer_size=buffer, seed=3)
        return [len({i // 50 for i in b["id"]}) for b in loader]

    # Without a buffer, a batch holds rows of one row group (50 rows: 5 whole batches), in
    # a shuffled order; with one, most batches mix rows of several.
    assert set(groups_per_batch(0)) == {1}
    first = ids_of(ArrowDataLoader(path, 10, shuffle_buffer_size=0))[:50]
    assert len({i // 50 for i in first}) == 1 and first != sorted(first)
    mixed = groups_per_batch(25)
    assert sum(n > 1 for n in mixed) > len(mixed) // 2, mixed


def test_batches_have_the_recorded_shapes(dataset):
    loader = ArrowDataLoader(dataset, 5, columns=["id", "x", "y"])
    assert loader.output_specs["x"] == (np.dtype("float32"), (5, 3))
    for batch in loader:
        assert batch["x"].shape == (5, 3) and batch["x"].dtype == np.float32
        assert batch["y"].shape == (5,)
        np.testing.assert_array_equal(batch["x"][:, 1], batch["id"] + 0.5)
        np.testing.assert_array_equal(batch["y"], 2 * batch["id"])


def test_inmemory_cache_reads_the_files_once(tmp_path):
    path = write_dataset(tmp_path / "d")
    cached = ArrowDataLoader(path, 4, rank=0, size=2, inmemory_cache_all=True, seed=3)
    streamed = ArrowDataLoader(path, 4, rank=0, size=2, seed=3)
    first = ids_of(cached)
    assert len(first) == len(ids_of(streamed)) == 4 * math.ceil(TOTAL / 8)
    assert set(first) == set(ids_of(streamed)) == set(range(TOTAL // 2))
    for name in os.listdir(path):
        os.remove(os.path.join(path, name))
    second = ids_of(cached)  # from memory: the files are gone
    assert set(second) == set(first) and len(second) == len(first) and second != first


def test_inmemory_cache_none_keeps_only_a_small_shard(tmp_path, monkeypatch):
    """``inmemory_cache_all=None`` (the estimators' default) keeps a shard in memory when it
    decodes to at most AUTO_CACHE_MAX_BYTES, and streams a larger one."""
    from flyte_hvd.data import loader as loader_module

    path = write_dataset(tmp_path / "d")
    auto = ArrowDataLoader(path, 4, rank=0, size=2, columns=["id", "x"], inmemory_cache_all=None)
    # id is int64, x float32 of shape (3,): 20 bytes a row.
    assert auto.shard_bytes == auto.shard_rows * 20 and auto.inmemory_cache_all
    monkeypatch.setattr(loader_module, "AUTO_CACHE_MAX_BYTES", auto.shard_bytes - 1)
    big = ArrowDataLoader(path, 4, rank=0, size=2, columns=["id", "x"], inmemory_cache_all=None)
    assert not big.inmemory_cache_all
    explicit = ArrowDataLoader(path, 4, rank=0, size=2, inmemory_cache_all=True)
    assert explicit.inmemory_cache_all


def test_spark_vector_layout_is_expanded(tmp_path):
    # Spark writes a VectorUDT column as struct<type, size, indices, values>: mix dense rows
    # (type 1) and sparse rows (type 0).
    vectors = pa.array(
        [
            {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0, 4.0]},
            {"type": 0, "size": 4, "indices": [1, 3], "values": [5.0, 6.0]},
            {"type": 0, "size": 4, "indices": [], "values": []},
            {"type": 1, "size": None, "indices": None, "values": [7.0, 8.0, 9.0, 10.0]},
        ],
        type=pa.struct(
            [
                ("type", pa.int8()),
                ("size", pa.int32()),
                ("indices", pa.list_(pa.int32())),
                ("values", pa.list_(pa.float64())),
            ]
        ),
    )
    os.makedirs(tmp_path / "v")
    pq.write_table(pa.table({"v": vectors, "y": [0, 1, 2, 3]}), tmp_path / "v" / "a.parquet")
    meta = read_metadata_fs(pa.fs.LocalFileSystem(), str(tmp_path / "v"))
    assert meta.column("v").shape == (4,) and meta.column("v").encoding == "vector_struct"
    batch = next(iter(ArrowDataLoader(str(tmp_path / "v"), 4, shuffle=False)))
    expected = [[1, 2, 3, 4], [0, 5, 0, 6], [0, 0, 0, 0], [7, 8, 9, 10]]
    np.testing.assert_array_equal(batch["v"], np.array(expected, dtype=np.float64))


def test_bad_arguments_and_data(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"`rank`=2 must be below `size`=2"):
        ArrowDataLoader(dataset, 4, rank=2, size=2)
    with pytest.raises(ValueError, match="`batch_size` must be an int >= 1; found 0"):
        ArrowDataLoader(dataset, 0)
    with pytest.raises(ValueError, match=r"column `nope` is not in the dataset.*'id'"):
        ArrowDataLoader(dataset, 4, columns=["nope"])
    tiny = write_dataset(tmp_path / "tiny", [2])
    with pytest.raises(ValueError, match="has 2 rows, fewer than the 3 ranks"):
        ArrowDataLoader(tiny, 1, rank=0, size=3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no Parquet files under"):
        ArrowDataLoader(str(tmp_path / "empty"), 1)
    ragged = tmp_path / "ragged"
    ragged.mkdir()
    pq.write_table(pa.table({"a": [[1.0, 2.0], [3.0]]}), ragged / "r.parquet")
    with pytest.raises(ValueError, match=r"column `a` has rows of lengths \[1, 2\]"):
        list(ArrowDataLoader(str(ragged), 2))


def test_memory_is_flat_across_epochs(tmp_path):
    path = write_dataset(tmp_path / "d", [4000] * 5, row_group_size=1000)
    loader = ArrowDataLoader(path, 64, rank=0, size=1, shuffle_buffer_size=2000)
    tracemalloc.start()
    try:
        after, arrow = [], []  # Python's allocations; Arrow's (where batches live)
        for _ in range(8):
            for _batch in loader:
                pass
            del _batch
            after.append(tracemalloc.get_traced_memory()[0])
            arrow.append(pa.total_allocated_bytes())
    finally:
        tracemalloc.stop()
    assert max(after[2:]) - after[1] < 256 * 1024, after
    assert max(arrow[2:]) - arrow[1] < 256 * 1024, arrow


# -- background reading ----------------------------------------------------------------------


def test_async_loader_yields_the_same_batches(dataset):
    sync = ArrowDataLoader(dataset, 4, rank=1, size=2, seed=5)
    background = AsyncArrowDataLoader(dataset, 4, rank=1, size=2, seed=5, async_loader_queue_size=2)
    for _ in range(2):
        assert ids_of(sync) == ids_of(background)


class _Broken(AsyncDataLoaderMixin, ArrowDataLoader):
    """Fails reading its third row group."""

    reads = 0

    def _read_piece(self, piece):
        self.reads += 1
        if self.reads == 3:
            raise OSError("disk on fire")
        return super()._read_piece(piece)


def _loader_threads() -> int:
    return sum(t.name.startswith("flyte-hvd") for t in threading.enumerate())


def test_async_error_surfaces_in_the_training_loop(dataset):
    baseline = _loader_threads()  # threads other tests left running
    loader = _Broken(dataset, 2, shuffle=False)
    got = []
    with pytest.raises(OSError, match="disk on fire"):
        for batch in loader:
            got.append(batch)
    assert got  # batches before the failure arrived first
    assert _loader_threads() <= baseline


def test_async_stopping_early_ends_the_thread(dataset):
    baseline = _loader_threads()  # threads other tests left running
    loader = AsyncArrowDataLoader(dataset, 1, async_loader_queue_size=1)
    epoch = iter(loader)
    next(epoch)
    assert _loader_threads() >= 2  # the loader's thread, and the epoch's reading threads
    epoch.close()
    assert _loader_threads() <= baseline


class _Counting(BaseDataLoader):
    """A user-defined loader: batches of ``i`` for i in range(3)."""

    def __len__(self):
        return 3

    def _iterate(self, epoch):
        for i in range(3):
            yield {"a": np.full((2, 1), i + 10 * epoch, np.float32), "b": np.zeros(2, np.int64)}

    @property
    def output_specs(self):
        return {"a": (np.dtype("float32"), (None, 1)), "b": (np.dtype("int64"), (None,))}


def test_tf_dataset_feeds_keras_one_epoch_per_pass(dataset):
    import keras
    import tensorflow as tf

    loader = ArrowDataLoader(dataset, 8, rank=0, size=2, columns=["x", "id", "y"])
    ds = loader.to_tf_dataset(["x", "id"], "y")
    x_spec, y_spec = ds.element_spec
    assert x_spec[0].shape == (8, 3) and x_spec[0].dtype == tf.float32
    assert x_spec[1].shape == (8,) and x_spec[1].dtype == tf.int64
    assert y_spec.shape == (8,)
    assert int(ds.cardinality()) == len(loader) == math.ceil(TOTAL / 16)
    # tf.data's tuning thread stalls each new iterator (Keras makes one per epoch) for seconds
    # with nothing to tune: the buffers are fixed.
    assert ds.options().autotune.enabled is False

    only_x = loader.to_tf_dataset("x")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    before = loader._epoch
    history = model.fit(loader.to_tf_dataset("x", "y"), epochs=2, verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 2
    assert loader._epoch - before == 2  # Keras re-iterated the dataset: one loader epoch each
    assert next(iter(only_x)).shape == (8, 3)

    user = _Counting().to_tf_dataset("a", "b")
    firsts = [float(x[0, 0]) for x, _ in user]
    assert firsts == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="`label_columns`='nope'"):
        _Counting().to_tf_dataset("a", "nope")


class _Ragged(BaseDataLoader):
    """A user's loader of 20 batches of 4 rows whose last batch has 1 row."""

    def __len__(self):
        return 20

    def _iterate(self, epoch):
        for i in range(20):
            rows = 1 if i == 19 else 4
            yield {"a": np.full((rows, 2), i, np.float32), "b": np.arange(rows)}

    @property
    def output_specs(self):
        return {"a": (np.dtype("float32"), (None, 2)), "b": (np.dtype("int64"), (None,))}


def test_tf_dataset_keeps_batch_order_and_sizes_across_groups():
    """Batches cross into tf.data in stacked groups; the dataset still yields each batch as
    the loader made it, in order, including a short last batch."""
    from flyte_hvd.data.loader import TF_GROUP_BATCHES

    assert len(_Ragged()) > TF_GROUP_BATCHES
    got = [(float(a[0, 0]), a.shape[0], b.numpy().tolist()) for a, b in
           _Ragged().to_tf_dataset("a", "b")]  # fmt: skip
    assert got == [(float(i), 4, [0, 1, 2, 3]) for i in range(19)] + [(19.0, 1, [0])]


@pytest.mark.parametrize(
    "options",
    [
        {"shuffle": True, "shuffle_buffer_size": 5},
        {"shuffle": False},
        {"shuffle": True, "inmemory_cache_all": True},
        {"shuffle": True, "steps_per_epoch": 9},  # more than the shard: it is read again
    ],
)
def test_tf_dataset_yields_the_loaders_batches_from_whole_blocks(tmp_path, options):
    """``to_tf_dataset`` feeds tf.data the decoded blocks the batches are cut from (no Python
    step per batch); its batches are still exactly the loader's, epoch by epoch, on every
    rank, with float64 columns cast when asked."""
    path = write_dataset(tmp_path / "data", [40, 33, 27], row_group_size=10)

    def make(rank=0):
        return ArrowDataLoader(path, 4, rank=rank, size=2, seed=3, **options)

    for rank in range(2):
        expected = [ids_of(make(rank).iter_epoch(epoch)) for epoch in range(2)]
        loader = make(rank)
        ds = loader.to_tf_dataset("id", "y", float64_as="float64")
        got = [[int(i) for ids, _ in ds for i in ids.numpy()] for _ in range(2)]
        assert got == expected
        assert int(ds.cardinality()) == len(loader)
    with pytest.raises(ValueError, match="`float64_as` must be a floating-point dtype"):
        make().to_tf_dataset("id", "y", float64_as="int32")


def test_tf_dataset_casts_float64_columns_only(tmp_path):
    root = tmp_path / "d"
    os.makedirs(root)
    pq.write_table(
        pa.table({"a": np.arange(8, dtype=np.float64), "b": np.arange(8, dtype=np.int64),
                  "c": np.arange(8, dtype=np.float16)}),
        os.path.join(root, "part-0.parquet"),
    )  # fmt: skip
    ds = ArrowDataLoader(str(root), 4, shuffle=False).to_tf_dataset(
        ["a", "b"], "c", float64_as="float32"
    )
    (a, b), c = next(iter(ds))
    assert (a.dtype.name, b.dtype.name, c.dtype.name) == ("float32", "int64", "float16")
    assert a.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("cached", [True, False])
def test_float64_columns_decode_as_asked(tmp_path, cached):
    root = tmp_path / "d"
    os.makedirs(root)
    values = np.linspace(0, 1, 8)
    pq.write_table(
        pa.table({"a": values, "b": np.arange(8, dtype=np.int64),
                  "v": pa.array([[x, -x] for x in values], pa.list_(pa.float64()))}),
        os.path.join(root, "part-0.parquet"),
    )  # fmt: skip

    def make(**kwargs):
        return ArrowDataLoader(str(root), 4, shuffle=False, inmemory_cache_all=cached, **kwargs)

    plain, narrow = make(), make(float64_as="float32")
    for got, want in zip(narrow.iter_epoch(0), plain.iter_epoch(0), strict=True):
        assert {k: v.dtype.name for k, v in got.items()} == {
            "a": "float32", "b": "int64", "v": "float32"
        }  # fmt: skip
        for k in got:
            np.testing.assert_array_equal(got[k], want[k].astype(got[k].dtype))
    assert narrow.output_specs["v"] == (np.dtype("float32"), (4, 2))
    assert narrow.shard_bytes == plain.shard_bytes - 8 * (4 + 2 * 4)
    with pytest.raises(ValueError, match=r"`float64_as` must be a floating-point dtype.*'int8'"):
        make(float64_as="int8")


def test_rank_side_modules_import_neither_spark_nor_tensorflow():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import flyte_hvd.data.loader, flyte_hvd.data.store, flyte_hvd.data.dataset\n"
        "import flyte_hvd.data.prepare\n"
        "print(sorted(m for m in ('pyspark', 'tensorflow', 'keras') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- a streamed fit's rank: its partition of the DataFrame, in memory (``table=``) --------------


def _partition(ids, is_val=None):
    """A partition as a rank of ``materialize=False`` receives it: ``x`` a Spark vector struct
    (dense rows), ``y`` a scalar, and the validation flag."""
    ids = np.asarray(ids, dtype=np.float64)
    vectors = [{"type": 1, "size": None, "indices": None, "values": [i, -i]} for i in ids]
    columns = {
        "x": pa.array(vectors, type=pa.struct([
            ("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
            ("values", pa.list_(pa.float64()))])),
        "y": pa.array(ids),
    }  # fmt: skip
    if is_val is not None:
        from flyte_hvd.data.split import SPLIT_COL

        columns[SPLIT_COL] = pa.array(is_val, type=pa.bool_())
    return pa.table(columns)


def _stream_infos():
    from flyte_hvd.data.dataset import ColumnInfo

    return (
        ColumnInfo("x", "dense_vector", "float64", (2,), "list"),
        ColumnInfo("y", "scalar", "float64"),
    )


def _stream_meta(rows):
    from flyte_hvd.data.dataset import DatasetMetadata

    return DatasetMetadata(columns=_stream_infos(), rows=rows, bytes=0, files=0, row_groups=0)


@pytest.mark.parametrize("in_files", [False, True])
def test_partition_splits_by_the_flag_into_the_stored_layout(tmp_path, in_files):
    """In memory, or written batch by batch to files in the partition's folder and read back
    memory-mapped (what a rank does: its memory then holds a batch at a time)."""
    from flyte_hvd.data.dataset import partition_splits

    table = pa.concat_tables(
        [_partition(range(3), [False, True, False]), _partition(range(3, 5), [False, True])]
    )
    folder = str(tmp_path) if in_files else None
    train, val = partition_splits(table, _stream_infos(), True, folder)
    assert train.column("y").to_pylist() == [0.0, 2.0, 3.0]
    assert val.column("y").to_pylist() == [1.0, 4.0]
    assert train.column("x").to_pylist()[1] == [2.0, -2.0] and train.column_names == ["x", "y"]
    expected = ["training.arrow", "validation.arrow"] if in_files else []
    assert sorted(os.listdir(tmp_path)) == expected
    alone, none = partition_splits(_partition(range(3)), _stream_infos(), False)
    assert alone.num_rows == 3 and none is None


@pytest.mark.parametrize("cached", [True, False])
def test_unequal_partitions_give_every_rank_the_same_steps_and_all_its_rows(cached):
    """Ranks of a streamed fit hold partitions of any sizes: each takes the steps given (from
    the split's rows over all ranks), cycling through its own rows, every row each pass."""
    from flyte_hvd.data.dataset import partition_splits

    sizes = {0: 23, 1: 5}
    steps = math.ceil(sum(sizes.values()) / (2 * 4))
    seen = {}
    for rank, rows in sizes.items():
        table, _ = partition_splits(_partition(range(rows)), _stream_infos(), False)
        loader = ArrowDataLoader(
            f"partition {rank}", 4, rank=rank, size=2, metadata=_stream_meta(28), table=table,
            steps_per_epoch=steps, inmemory_cache_all=cached, float64_as="float32",
        )  # fmt: skip
        batches = list(loader)
        assert len(batches) == len(loader) == steps
        assert all(b["x"].shape == (4, 2) and b["x"].dtype == np.float32 for b in batches)
        seen[rank] = Counter(float(y) for b in batches for y in b["y"])
        np.testing.assert_array_equal(batches[0]["x"][:, 0], -batches[0]["x"][:, 1])
    assert set(seen[1]) == {0.0, 1.0, 2.0, 3.0, 4.0}  # the small partition, wrapped around
    assert set(seen[0]) <= set(map(float, range(23))) and sum(seen[0].values()) == steps * 4


def test_a_loader_over_a_table_refuses_no_rows_and_no_metadata():
    from flyte_hvd.data.dataset import partition_splits

    empty, _ = partition_splits(_partition([]), _stream_infos(), False)
    with pytest.raises(ValueError, match=r"rank 1 has no rows of `p`; every rank needs"):
        ArrowDataLoader("p", 4, rank=1, size=2, metadata=_stream_meta(8), table=empty)
    with pytest.raises(ValueError, match=r"a loader over a `table` \(p\) needs its `metadata`"):
        ArrowDataLoader("p", 4, table=empty)


def test_a_rank_whose_partition_has_no_training_rows_says_so(tmp_path, monkeypatch):
    """A streamed fit's rank with only validation rows fails before its first step, naming
    itself, the split and what to do."""
    from flyte_hvd.estimators.training import TrainingSpec, make_loaders
    from flyte_hvd.launch.rendezvous import PARTITION_ENV

    path = str(tmp_path / "partition.arrow")
    table = _partition([1.0, 2.0], [True, True])
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    monkeypatch.setenv(PARTITION_ENV, path)
    spec = TrainingSpec(
        store=None, model_bytes=b"", features=["x"], labels=["y"], sample_weight_col=None,
        metadata=(_stream_meta(6), _stream_meta(4)), batch_size=2, val_batch_size=2, epochs=1,
        verbose=0, shuffle=True, shuffle_buffer_size=None, random_seed=None,
        train_steps_per_epoch=None, validation_steps_per_epoch=None, materialize=False,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"rank 1 received no training rows: .*\(6 training rows in all\)"
    ):
        make_loaders(spec, 1, 2)
    table = _partition([1.0, 2.0, 3.0], [False, True, False])
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    train, val = make_loaders(spec, 1, 2)
    assert len(train) == 2 and len(val) == 1  # 6 and 4 rows over 2 ranks, batches of 2
    assert sorted(float(y) for b in train for y in b["y"]) == [1.0, 1.0, 3.0, 3.0]
    # The splits are files beside the partition's, which its task removes with its folder.
    assert sorted(os.listdir(tmp_path)) == ["partition.arrow", "training.arrow", "validation.arrow"]
