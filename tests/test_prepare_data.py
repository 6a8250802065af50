"""prepare_data on a real local[2] SparkSession: layout, metadata, reuse, vectors, bad input,
and the staged upload to a real S3 endpoint (moto's server)."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest

from flyte_hvd.data.dataset import METADATA_FILENAME, get_dataset_metadata, read_metadata
from flyte_hvd.data.loader import ArrowDataLoader
from flyte_hvd.data.prepare import prepare_data
from flyte_hvd.data.store import Store

pytestmark = pytest.mark.spark

N = 60


@pytest.fixture
def vectors_df(spark_local2):
    """N rows: a dense vector, a sparse vector, an array, a scalar feature, a label, a weight
    and a validation flag (every fifth row), all functions of `id`."""
    from pyspark.ml.linalg import Vectors

    rows = [
        (
            i,
            Vectors.dense([float(i), 1.0, -float(i)]),
            Vectors.sparse(5, [i % 5], [float(i)]),
            [i, 2 * i],
            float(i) / 2,
            float(i % 3),
            1.0 + i % 2,
            i % 5 == 0,
        )
        for i in range(N)
    ]
    return spark_local2.createDataFrame(
        rows, ["id", "dense", "sparse", "arr", "f", "label", "w", "is_val"]
    )


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


def prepare(store, df, **kwargs):
    kwargs.setdefault("label_columns", ["label"])
    kwargs.setdefault("partitions_per_process", 2)
    with prepare_data(2, store, df, **kwargs) as idx:
        return idx


def all_rows(path, store, columns=None):
    loader = ArrowDataLoader(path, 1, store=store, shuffle=False, columns=columns)
    return {
        k: np.concatenate([b[k] for b in loader.iter_epoch(0)])[: loader.total_rows]
        for k in loader.columns
    }


def dictionary_encoded(source):
    """Whether each Parquet leaf column of a file's first row group uses a dictionary."""
    meta = pq.ParquetFile(source).metadata.row_group(0)
    return {
        meta.column(i).path_in_schema: any("DICTIONARY" in e for e in meta.column(i).encodings)
        for i in range(meta.num_columns)
    }


def test_layout_metadata_and_shapes(store, vectors_df):
    idx = prepare(store, vectors_df, validation="is_val", sample_weight_col="w")
    train_path, val_path = store.get_train_data_path(idx), store.get_val_data_path(idx)
    assert os.path.isfile(os.path.join(train_path, METADATA_FILENAME))
    train, val = get_dataset_metadata(store, idx)
    assert (train.rows, val.rows) == (N - N // 5, N // 5)
    assert train.files >= 2 and val.files >= 2  # at least num_processes
    assert train.bytes > 0 and train.split == "train" and train.dataset_idx == idx
    cols = {c.name: (c.kind, c.dtype, c.shape, c.encoding) for c in train.columns}
    assert cols == {
        "id": ("scalar", "int64", (), "plain"),
        "dense": ("dense_vector", "float64", (3,), "list"),
        "sparse": ("sparse_vector", "float64", (5,), "list"),
        "arr": ("array", "int64", (2,), "list"),
        "f": ("scalar", "float64", (), "plain"),
        "label": ("scalar", "float64", (), "plain"),
        "w": ("scalar", "float64", (), "plain"),
    }  # the validation column is not stored
    assert train.feature_columns == ("id", "dense", "sparse", "arr", "f")
    rows = all_rows(val_path, store)
    assert sorted(rows["id"].tolist()) == list(range(0, N, 5))
    order = np.argsort(rows["id"])
    ids = rows["id"][order]
    np.testing.assert_array_equal(rows["dense"][order], np.stack([ids, ids * 0 + 1, -ids], 1))
    expected_sparse = np.zeros((len(ids), 5))
    expected_sparse[np.arange(len(ids)), ids % 5] = ids
    np.testing.assert_array_equal(rows["sparse"][order], expected_sparse)
    np.testing.assert_array_equal(rows["arr"][order], np.stack([ids, 2 * ids], 1))
    # Floating-point values are stored without a dictionary, even `label` and `w`, whose 3
    # and 2 distinct values one would pay for. (Spark's writer gives up a dictionary that
    # does not pay, as for the distinct integers here: those are left to it.)
    first = sorted(n for n in os.listdir(train_path) if n.endswith(".parquet"))[0]
    encoded = dictionary_encoded(os.path.join(train_path, first))
    floats = ("dense.list.element", "sparse.list.element", "f", "label", "w")
    assert {leaf: encoded[leaf] for leaf in floats} == dict.fromkeys(floats, False), encoded

    # Without the sidecar the shapes still come back, from the Parquet schema (horovod#1762).
    sidecar = os.path.join(train_path, METADATA_FILENAME)
    os.rename(sidecar, sidecar + ".moved")
    from_schema = read_metadata(store, train_path)
    assert from_schema.columns == train.columns
    assert from_schema.rows == train.rows


def test_writes_of_the_same_data_at_once_keep_to_their_own_folders(store, vectors_df):
    """Two fits of one DataFrame on one store at once (two nodes of an execution): the second
    to check finds the first one's write still without its sidecar, writes a folder of its own
    and leaves the other's files alone; a later prepare reuses a complete one, also one written
    at the key's index alone, as datasets were written before."""
    import shutil

    first = prepare(store, vectors_df, feature_columns=["f"], validation=0.25)
    key_start, token = first.split("-")
    assert len(key_start) == 16 and len(token) == 8
    # The first write as another process sees it while it runs: files, no sidecars yet.
    for path in (store.get_train_data_path(first), store.get_val_data_path(first)):
        os.rename(os.path.join(path, METADATA_FILENAME), os.path.join(path, "sidecar.later"))
    in_progress = sorted(os.listdir(store.get_train_data_path(first)))
    second = prepare(store, vectors_df, feature_columns=["f"], validation=0.25)
    assert second != first and second.startswith(f"{key_start}-")
    assert sorted(os.listdir(store.get_train_data_path(first))) == in_progress
    train, val = get_dataset_metadata(store, second)
    assert train.rows + val.rows == N
    # A complete dataset at the key's index alone is reused.
    for path in (store.get_train_data_path, store.get_val_data_path):
        shutil.move(path(second), path(key_start))
        with open(os.path.join(path(key_start), METADATA_FILENAME)) as f:
            assert json.load(f)["key"].startswith(key_start)
    assert prepare(store, vectors_df, feature_columns=["f"], validation=0.25) == key_start


_KILLED_WRITER = """
import os, signal, sys
from flyte_hvd.data.lease import StoreLease
from flyte_hvd.data.store import Store
store, idx = Store.create(sys.argv[1]), sys.argv[2]
assert StoreLease(store, store.get_train_data_path(idx) + ".lease.json", idx).try_acquire()
for path in (store.get_train_data_path(idx), store.get_val_data_path(idx)):
    store.write_bytes(path + "/part-00000.parquet", b"half of a file")
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as a preempted pod's driver, mid-write
"""


def _leases(store):
    parent = os.path.dirname(store.get_train_data_path())
    return sorted(n for n in os.listdir(parent) if n.endswith(".lease.json"))


def test_the_next_prepare_removes_a_write_whose_driver_was_killed(store, vectors_df, caplog):
    """A driver killed mid-write leaves its folders without sidecars and its lease; the next
    prepare on the store, of any data, removes them with one warning, and leaves a write whose
    lease lives alone."""
    import logging
    import subprocess
    import sys

    from flyte_hvd.data.lease import StoreLease

    dead, live = "deaddeaddeaddead-0badf00d", "1111222233334444-00c0ffee"
    writer = [sys.executable, "-c", _KILLED_WRITER, store.prefix_path, dead]
    killed = subprocess.run(writer, capture_output=True, text=True)
    assert killed.returncode == -9, killed
    assert _leases(store) == [f"intermediate_train_data.{dead}.lease.json"]
    garbled = "5555666677778888-0000dead"  # a lease no one can read: no one protects it
    store.write_bytes(store.get_train_data_path(garbled) + ".lease.json", b"not json")
    store.write_bytes(store.get_train_data_path(garbled) + "/part-00000.parquet", b"half")
    running = StoreLease(store, store.get_train_data_path(live) + ".lease.json", live)
    assert running.try_acquire()
    store.write_bytes(store.get_train_data_path(live) + "/part-00000.parquet", b"being written")
    try:
        caplog.set_level(logging.WARNING, logger="flyte_hvd")
        idx = prepare(store, vectors_df, feature_columns=["f"])
        for path in (store.get_train_data_path(dead), store.get_val_data_path(dead)):
            assert not os.path.exists(path), path
        assert [r.getMessage() for r in caplog.records if "removed dataset" in r.getMessage()] == [
            f"removed dataset {garbled}, a write that did not finish "
            f"(`{store.get_train_data_path(garbled)}`, `{store.get_val_data_path(garbled)}`): "
            f"its lease `{store.get_train_data_path(garbled)}.lease.json` is unreadable",
            f"removed dataset {dead}, a write that did not finish "
            f"(`{store.get_train_data_path(dead)}`, `{store.get_val_data_path(dead)}`): its "
            f"lease `{store.get_train_data_path(dead)}.lease.json` is no longer running "
            f"(process {int(killed.stdout)} is gone)",
        ]
        assert not os.path.exists(store.get_train_data_path(garbled))
        assert os.listdir(store.get_train_data_path(live)) == ["part-00000.parquet"]
        assert _leases(store) == [f"intermediate_train_data.{live}.lease.json"]
        assert get_dataset_metadata(store, idx)[0].rows == N  # its own lease released
    finally:
        running.release()
    assert _leases(store) == []


def test_a_write_whose_lease_was_taken_over_keeps_nothing(store, vectors_df, monkeypatch):
    """A write whose store did not answer its lease's renewals may have been taken for a dead
    one and removed by another prepare: it fails before its sidecars mark it complete."""
    from flyte_hvd.data import prepare as prepare_module

    real = prepare_module._write_one

    def then_taken_over(job, *args):
        meta = real(job, *args)
        store.write_bytes(store.get_train_data_path(job.idx) + ".lease.json", b'{"token": "x"}')
        return meta

    monkeypatch.setattr(prepare_module, "_write_one", then_taken_over)
    with pytest.raises(RuntimeError, match=r"the write of dataset \w{16}-\w{8} lost its lease"):
        prepare(store, vectors_df, feature_columns=["f"])
    parent = os.path.dirname(store.get_train_data_path())
    assert [n for n in os.listdir(parent) if not n.endswith(".lease.json")] == []


def test_a_train_path_in_a_folder_not_made_yet_is_written_and_then_reused(tmp_path, vectors_df):
    store = Store.create(str(tmp_path / "store"), train_path=str(tmp_path / "new" / "train"))
    assert not (tmp_path / "new").exists()
    idx = prepare(store, vectors_df, feature_columns=["f"])
    assert sorted(os.listdir(tmp_path / "new")) == [f"train.{idx}"]  # its lease released
    assert get_dataset_metadata(store, idx)[0].rows == N
    assert prepare(store, vectors_df, feature_columns=["f"]) == idx


def test_random_split_is_seeded_and_reused(store, vectors_df):
    idx = prepare(store, vectors_df, feature_columns=["f"], validation=0.25)
    train, val = get_dataset_metadata(store, idx)
    assert train.rows + val.rows == N and 0 < val.rows < N
    sidecar = os.path.join(store.get_train_data_path(idx), METADATA_FILENAME)
    files = sorted(os.listdir(store.get_train_data_path(idx)))
    stamp = os.stat(sidecar).st_mtime_ns
    # The same DataFrame and options: the data is reused, not written again.
    assert prepare(store, vectors_df, feature_columns=["f"], validation=0.25) == idx
    assert os.stat(sidecar).st_mtime_ns == stamp
    assert sorted(os.listdir(store.get_train_data_path(idx))) == files
    # A changed DataFrame, or a changed option, is a new dataset.
    fewer = vectors_df.filter("id < 40")
    idx_fewer = prepare(store, fewer, feature_columns=["f"], validation=0.25)
    idx_split = prepare(store, vectors_df, feature_columns=["f"], validation=0.5)
    assert len({idx, idx_fewer, idx_split}) == 3
    assert sum(get_dataset_metadata(store, idx_fewer)[i].rows for i in (0, 1)) == 40


def test_compress_sparse_is_expanded_by_the_loader(store, vectors_df):
    idx = prepare(
        store, vectors_df, feature_columns=["id", "sparse", "dense"], compress_sparse=True
    )
    train, val = get_dataset_metadata(store, idx)
    assert val is None
    info = train.column("sparse")
    assert (info.kind, info.encoding, info.shape) == ("sparse_vector", "sparse", (5,))
    assert train.column("dense").encoding == "list"  # dense rows are not compressed
    path = store.get_train_data_path(idx)
    stored = pq.read_schema(next(p for p in _parquet_files(path)))
    assert stored.field("sparse").type.num_fields == 2  # indices, values
    rows = all_rows(path, store)
    ids = rows["id"]
    expected = np.zeros((N, 5))
    expected[np.arange(N), ids % 5] = ids
    np.testing.assert_array_equal(rows["sparse"], expected)


def _parquet_files(path):
    return [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".parquet")]


# -- bad input -------------------------------------------------------------------------------


def test_missing_columns_list_what_exists(store, vectors_df):
    with pytest.raises(ValueError, match=r"`label_columns` names `nope`.*available columns: `id`"):
        prepare(store, vectors_df, label_columns=["nope"])
    with pytest.raises(ValueError, match=r"`feature_columns` names `x1`, `x2`.*`is_val`"):
        prepare(store, vectors_df, feature_columns=["f", "x1", "x2"])
    with pytest.raises(ValueError, match=r"`sample_weight_col` names `ww`"):
        prepare(store, vectors_df, sample_weight_col="ww")


def test_unsupported_type_is_named(store, vectors_df):
    df = vectors_df.selectExpr("*", "cast(id as string) as name")
    with pytest.raises(ValueError, match=r"column `name` has type string, which cannot be fed"):
        prepare(store, df)


@pytest.mark.parametrize(
    ("validation", "message"),
    [
        (0.0, r"strictly between 0 and 1.*found 0\.0"),
        (1.0, r"strictly between 0 and 1.*found 1\.0"),
        (1.5, r"strictly between 0 and 1"),
        (True, r"a float in \(0, 1\), a column name or None; found True"),
        ("missing", r"`validation` names `missing`"),
        ("arr", r"`validation` column `arr` must be boolean or numeric"),
    ],
)
def test_bad_validation(store, vectors_df, validation, message):
    with pytest.raises(ValueError, match=message):
        prepare(store, vectors_df, validation=validation)


@pytest.mark.parametrize("num_processes", [0, -1, 1.5, None])
def test_bad_num_processes(store, vectors_df, num_processes):
    with (
        pytest.raises(ValueError, match="`num_processes` must be an int >= 1"),
        prepare_data(num_processes, store, vectors_df, ["label"]),
    ):
        pass


def test_empty_dataframe_and_empty_split(store, vectors_df, tmp_path):
    with pytest.raises(ValueError, match="the DataFrame has no rows"):
        prepare(store, vectors_df.filter("id < 0"))
    none_val = vectors_df.selectExpr("*", "false as never")
    with pytest.raises(ValueError, match=r"puts 0 of 60 rows into the validation split"):
        prepare(store, none_val, validation="never")
    assert not os.listdir(store.prefix_path)  # nothing written


def test_nan_label_is_refused(store, vectors_df):
    df = vectors_df.selectExpr("*", "if(id = 7, double('NaN'), label) as bad_label")
    with pytest.raises(ValueError, match=r"column `bad_label` has 1 NaN or infinite values"):
        prepare(store, df, label_columns=["bad_label"], feature_columns=["f"])
    nulls = vectors_df.selectExpr("*", "if(id = 3, null, f) as f_null")
    with pytest.raises(ValueError, match=r"column `f_null` has 1 null values"):
        prepare(store, nulls, feature_columns=["f_null"])


@pytest.mark.parametrize(
    ("column", "match"),
    [
        ("if(id = 4, array(id), arr) as bad", r"`bad` has rows of different lengths \(1 to 2\)"),
        ("cast(array() as array<double>) as bad", r"`bad` holds empty arrays or vectors"),
        ("if(id = 4, array(double('NaN'), 1.0), array(id * 1.0, 2.0)) as bad",
         r"`bad` has 1 NaN or infinite values"),
    ],
)  # fmt: skip
def test_bad_arrays_are_refused_before_anything_is_written(store, vectors_df, column, match):
    df = vectors_df.selectExpr("*", column)
    with pytest.raises(ValueError, match=match):
        prepare(store, df, feature_columns=["bad"])
    assert not os.listdir(store.prefix_path)


def test_non_finite_values_in_sparse_and_dense_vectors_are_counted(store, spark_local2):
    from pyspark.ml.linalg import Vectors

    rows = [
        (Vectors.sparse(4, [1, 3], [float("inf"), 2.0]), 0.0),
        (Vectors.dense([float("nan"), 1.0, float("-inf"), 0.0]), 1.0),
        (Vectors.sparse(4, [], []), 2.0),
    ]
    df = spark_local2.createDataFrame(rows, ["v", "label"])
    with pytest.raises(ValueError, match=r"`v` has 3 NaN or infinite values"):
        prepare(store, df, feature_columns=["v"])
    assert not os.listdir(store.prefix_path)


def test_splits_are_written_in_files_of_at_most_their_share_of_rows(store, vectors_df):
    idx = prepare(store, vectors_df, validation="is_val", partitions_per_process=3)
    # 2 processes x 3 = 6 files a split, written by 2 tasks (the data is small): train's 48
    # rows in files of at most 8, validation's 12 in files of at most 2.
    for path, rows, most in ((store.get_train_data_path(idx), N - N // 5, 8),
                             (store.get_val_data_path(idx), N // 5, 2)):  # fmt: skip
        names = sorted(n for n in os.listdir(path) if n.endswith(".parquet"))
        counts = [pq.ParquetFile(os.path.join(path, n)).metadata.num_rows for n in names]
        assert sum(counts) == rows and max(counts) <= most, counts
        assert 6 <= len(counts) <= 7, counts  # a task's last file may hold the remainder


def test_vector_columns_are_told_sparse_dense_or_mixed(store, spark_local2):
    from pyspark.ml.linalg import Vectors

    rows = [
        (
            Vectors.sparse(2, [0, 1], [1.0, 2.0]) if i % 2 else Vectors.dense([1.0, 2.0]),
            Vectors.sparse(2, [0, 1], [float(i), 1.0]),  # every slot set: still sparse
            Vectors.dense([float("nan") if i == 3 else 0.0, 0.0]),  # NaN, zeros: still dense
            0.0,
        )
        for i in range(6)
    ]
    df = spark_local2.createDataFrame(rows, ["mixed", "full_sparse", "dense", "label"])
    idx = prepare(store, df, feature_columns=["mixed", "full_sparse", "dense"],
                  allow_non_finite_features=True)  # fmt: skip
    train, _ = get_dataset_metadata(store, idx)
    kinds = {c: train.column(c).kind for c in ("mixed", "full_sparse", "dense")}
    assert kinds == {"mixed": "vector", "full_sparse": "sparse_vector", "dense": "dense_vector"}


def test_failed_write_leaves_nothing_behind(tmp_path, vectors_df):
    blocker = tmp_path / "a-file"
    blocker.write_text("the validation split cannot go under a file")
    store = Store.create(str(tmp_path / "store"), val_path=str(blocker / "val"))
    with pytest.raises(Exception, match="a-file"):
        prepare(store, vectors_df, feature_columns=["f"], validation=0.5)
    assert not [n for n in os.listdir(store.prefix_path) if n.startswith("intermediate")]


# -- S3 and Google Cloud Storage: Spark on local[2] has no S3A or GCS connector, so the data is
# staged and uploaded through the store's fsspec (Azure's abfs:// is covered by a fit in
# test_keras_estimator.py) ------------------------------------------------------------------


@pytest.mark.parametrize("server", ["s3_server", "gcs_server"])
def test_staged_upload_to_an_object_store_and_back(server, vectors_df, request):
    server = request.getfixturevalue(server)
    prefix = f"{server.protocol}://{server.bucket}/prep-{uuid.uuid4().hex[:8]}"
    store = Store.create(prefix, storage_options=server.storage_options())
    idx = prepare(store, vectors_df, feature_columns=["id", "dense"], validation="is_val")
    train, val = get_dataset_metadata(store, idx)
    assert (train.rows, val.rows) == (N - N // 5, N // 5)
    key_prefix = store.fs_path(store.get_train_data_path(idx)).split("/", 1)[1]
    names = sorted(k.rsplit("/", 1)[1] for k in server.list_keys(key_prefix))
    assert METADATA_FILENAME in names
    parquet = [n for n in names if n.endswith(".parquet")]
    assert len(parquet) == train.files >= 2
    # Files of at most a quarter of the rows (2 processes x 2 files), each uploaded whole.
    folder = store.fs_path(store.get_train_data_path(idx))
    counts = [pq.ParquetFile(store.fs.open(f"{folder}/{n}")).metadata.num_rows for n in parquet]
    assert sum(counts) == train.rows and max(counts) <= -(-train.rows // 4), counts
    assert dictionary_encoded(store.fs.open(f"{folder}/{parquet[0]}")) == {
        "id": True, "dense.list.element": False, "label": False,
    }  # fmt: skip
    # Both ranks read their shards back from S3: disjoint, and together every row.
    remote = store.to_remote(dataset_idx=idx)
    shards = []
    for rank in range(2):
        loader = ArrowDataLoader(remote.train_data_path, 4, rank=rank, size=2, store=remote)
        seen = {int(i) for b in loader for i in b["id"]}
        assert len(seen) == loader.shard_rows
        shards.append(seen)
    assert shards[0].isdisjoint(shards[1])
    assert shards[0] | shards[1] == {i for i in range(N) if i % 5}
    assert json.loads(store.read_text(f"{store.get_train_data_path(idx)}/{METADATA_FILENAME}"))


def test_failed_staged_upload_leaves_nothing_behind(s3_server, vectors_df):
    prefix = f"s3://{s3_server.bucket}/fail-{uuid.uuid4().hex[:8]}"
    store = Store.create(
        prefix,
        val_path="s3://no-such-bucket/val",
        storage_options=s3_server.storage_options(),
    )
    with pytest.raises(Exception, match=r"NoSuchBucket|does not exist"):
        prepare(store, vectors_df, feature_columns=["f"], validation=0.5)
    key_prefix = prefix.split("/", 3)[3]
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=key_prefix)
    assert listed["KeyCount"] == 0


def test_spark_writes_only_where_its_filesystem_starts(spark_local2):
    """A scheme mapped to a class is not enough: Spark writes to the store itself only when
    the class starts for that URL (here a view of one bucket over a local folder, beside
    buckets that fall back to S3A, which is not installed); else the ranks' uploads are used."""
    from flyte_hvd.data.writing import spark_can_write

    conf = spark_local2._jsc.hadoopConfiguration()
    scheme = f"fhvd{uuid.uuid4().hex[:6]}"
    conf.set(f"fs.{scheme}.impl", "org.apache.hadoop.fs.viewfs.ViewFileSystemOverloadScheme")
    conf.set(f"fs.{scheme}.impl.disable.cache", "true")
    conf.set("fs.viewfs.mounttable.mapped.linkFallback", "file:///tmp")
    conf.set(
        f"fs.viewfs.overload.scheme.target.{scheme}.impl", "org.apache.hadoop.fs.s3a.S3AFileSystem"
    )
    assert spark_can_write(spark_local2, f"{scheme}://mapped/prefix")
    assert not spark_can_write(spark_local2, f"{scheme}://other-bucket/prefix")
    assert not spark_can_write(spark_local2, "nosuchscheme://bucket/prefix")
    assert spark_can_write(spark_local2, "file:///tmp/prefix")
