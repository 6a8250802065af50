"""The Store: path layout, atomic writes, and clear errors, on local disk and a real S3
endpoint (moto's server)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import uuid

import pytest

from flyte_hvd.data.store import (
    DBFSLocalStore,
    HDFSStore,
    LocalStore,
    RemoteStore,
    S3Store,
    Store,
    store_class_for,
)


@pytest.mark.parametrize(
    ("path", "cls"),
    [
        ("/tmp/x", LocalStore),
        ("relative/dir", LocalStore),
        ("file:///tmp/x", LocalStore),
        ("s3://bucket/prefix", S3Store),
        ("s3a://bucket/prefix", S3Store),
        ("hdfs://namenode:8020/user/me", HDFSStore),
        ("hdfs:///user/me", HDFSStore),
        ("/dbfs/ml/x", DBFSLocalStore),
        ("dbfs:/ml/x", DBFSLocalStore),
        ("file:///dbfs/ml/x", DBFSLocalStore),
    ],
)
def test_store_class_follows_the_scheme(path, cls):
    assert store_class_for(path) is cls


@pytest.mark.parametrize("path", ["gs://bucket/x", "", None])
def test_unsupported_or_empty_prefix_is_refused(path):
    with pytest.raises(ValueError, match="prefix_path"):
        Store.create(path)


def test_local_layout_matches_the_design(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    p = str(tmp_path / "store")
    assert isinstance(store, LocalStore)
    assert store.get_train_data_path() == f"{p}/intermediate_train_data"
    assert store.get_train_data_path("ab12") == f"{p}/intermediate_train_data.ab12"
    assert store.get_val_data_path(3) == f"{p}/intermediate_val_data.3"
    assert store.get_test_data_path(3) == f"{p}/intermediate_test_data.3"
    assert store.get_runs_path() == f"{p}/runs"
    assert store.get_run_path("r1") == f"{p}/runs/r1"
    assert store.get_checkpoint_path("r1", ".keras") == f"{p}/runs/r1/checkpoint.keras"
    assert store.get_checkpoint_path("r1", ".pt") == f"{p}/runs/r1/checkpoint.pt"
    assert store.get_state_path("r1") == f"{p}/runs/r1/state.json"
    assert store.get_logs_path("r1") == f"{p}/runs/r1/logs"
    assert store.saving_runs
    assert store.spark_url(store.get_run_path("r1")) == f"file://{p}/runs/r1"
    assert os.path.isdir(p)  # created by Store.create


def test_overrides_and_file_urls(tmp_path):
    store = Store.create(
        f"file://{tmp_path}/s/",
        train_path=str(tmp_path / "train"),
        runs_path=str(tmp_path / "elsewhere"),
        checkpoint_filename="model.h5",
        save_runs=False,
    )
    assert store.prefix_path == f"{tmp_path}/s"
    assert store.get_train_data_path(1) == f"{tmp_path}/train.1"
    assert store.get_val_data_path(1) == f"{tmp_path}/s/intermediate_val_data.1"
    assert store.get_checkpoint_path("r", ".keras") == f"{tmp_path}/elsewhere/r/model.h5"
    assert store.get_checkpoint_path("r") == f"{tmp_path}/elsewhere/r/model.h5"
    assert not store.saving_runs


def test_checkpoint_path_needs_an_extension_without_a_chosen_file_name(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    for bad in ("", "keras", "./x"):
        with pytest.raises(ValueError, match=r"`extension` must be .* found"):
            store.get_checkpoint_path("r", bad)


@pytest.mark.parametrize("name", ["a/b.keras", ".hidden", ""])
def test_bad_checkpoint_filename(tmp_path, name):
    with pytest.raises(ValueError, match="checkpoint_filename"):
        Store.create(str(tmp_path), checkpoint_filename=name)


@pytest.mark.parametrize("run_id", ["", "a/b", ".."])
def test_bad_run_id(tmp_path, run_id):
    with pytest.raises(ValueError, match="run_id"):
        Store.create(str(tmp_path)).get_run_path(run_id)


def test_dbfs_paths():
    for path in ("dbfs:/ml/exp", "/dbfs/ml/exp/", "file:///dbfs/ml/exp"):
        store = DBFSLocalStore(path)
        assert store.prefix_path == "/dbfs/ml/exp"
        assert store.get_checkpoint_path("r", ".keras") == "/dbfs/ml/exp/runs/r/checkpoint.keras"
        assert store.spark_url(store.get_train_data_path(7)) == (
            "dbfs:/ml/exp/intermediate_train_data.7"
        )


def test_hdfs_paths():
    store = HDFSStore("hdfs://namenode:8020/user/me/exp/")
    assert (store.host, store.port) == ("namenode", 8020)
    assert store.get_checkpoint_path("r", ".keras") == (
        "hdfs://namenode:8020/user/me/exp/runs/r/checkpoint.keras"
    )
    assert store.fs_path(store.get_logs_path("r")) == "/user/me/exp/runs/r/logs"
    assert store.spark_url(store.get_train_data_path(1)) == (
        "hdfs://namenode:8020/user/me/exp/intermediate_train_data.1"
    )
    default = HDFSStore("hdfs:///data")
    assert (default.host, default.port) == ("default", 0)
    assert default.fs_path(default.get_run_path("x")) == "/data/runs/x"


def test_unreachable_hdfs_fails_at_create_naming_the_path():
    # No HDFS (nor libhdfs) here: the failure must come now, with the path and the cause.
    with pytest.raises(RuntimeError, match=r"`hdfs://127\.0\.0\.1:9/user/x`.*HDFSStore needs"):
        Store.create("hdfs://127.0.0.1:9/user/x")


def test_unwritable_local_prefix_fails_at_create(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match=f"`{blocker}/store`"):
        Store.create(str(blocker / "store"))


def test_local_round_trip(tmp_path):
    store = Store.create(str(tmp_path))
    state = store.get_state_path("r1")
    assert not store.exists(state)
    store.write_text(state, '{"epoch": 1}')
    assert store.read(state) == b'{"epoch": 1}'
    store.write_text(state, '{"epoch": 2}')
    assert store.read_text(state) == '{"epoch": 2}'

    local = tmp_path / "model.keras"
    local.write_bytes(b"weights-v1")
    store.upload_file(str(local), store.get_checkpoint_path("r1", ".keras"))
    back = tmp_path / "back" / "model.keras"
    store.download_file(store.get_checkpoint_path("r1", ".keras"), str(back))
    assert back.read_bytes() == b"weights-v1"
    assert store.get_checkpoints("r1") == [store.get_checkpoint_path("r1", ".keras")]
    assert store.get_checkpoints("never-ran") == []

    logs = tmp_path / "tb"
    (logs / "train").mkdir(parents=True)
    (logs / "train" / "events.out").write_bytes(b"e")
    written = store.upload_dir(str(logs), store.get_logs_path("r1"))
    assert written == [f"{store.get_logs_path('r1')}/train/events.out"]
    assert store.read(written[0]) == b"e"
    assert not [n for n in os.listdir(store.get_run_path("r1")) if n.endswith(".tmp")]


def _write_parquet(store: Store, path: str, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with store.fs.open(store.fs_path(f"{path}/part-0.parquet"), "wb") as f:
        pq.write_table(pa.table({"x": list(range(rows))}), f)


def test_parquet_datasets(tmp_path, s3_server):
    local = Store.create(str(tmp_path))
    s3 = Store.create(
        f"s3://{s3_server.bucket}/pq-{uuid.uuid4().hex[:8]}",
        storage_options=s3_server.storage_options(),
    )
    for store in (local, s3):
        path = store.get_train_data_path("1")
        assert not store.is_parquet_dataset(path)  # missing
        store.write_text(f"{path}/notes.txt", "not parquet")
        assert not store.is_parquet_dataset(path)
        _write_parquet(store, path, 7)
        assert store.is_parquet_dataset(path)
        assert store.get_parquet_dataset(path).count_rows() == 7
        store.delete(path)
        assert not store.exists(path)


_DIE_WHILE_PUBLISHING = """
import os, sys
from flyte_hvd.data.store import Store
store = Store.create(sys.argv[1], storage_options={options})
{patch}
store.write_bytes(store.get_checkpoint_path("r1", ".keras"), b"v2-" + b"x" * 1_000_000)
print("survived")
"""


def _die_while_publishing(prefix: str, patch: str, options: dict | None = None):
    code = _DIE_WHILE_PUBLISHING.format(patch=textwrap.dedent(patch), options=options)
    return subprocess.run(
        [sys.executable, "-c", code, prefix], capture_output=True, text=True, timeout=60
    )


def test_local_checkpoint_survives_a_death_mid_write(tmp_path):
    store = Store.create(str(tmp_path))
    store.write_bytes(store.get_checkpoint_path("r1", ".keras"), b"v1")
    # The writer dies after writing the new file but before publishing it.
    proc = _die_while_publishing(str(tmp_path), "os.replace = lambda *a: os._exit(3)")
    assert proc.returncode == 3, proc.stderr
    assert store.read(store.get_checkpoint_path("r1", ".keras")) == b"v1"
    assert store.get_checkpoints("r1") == [store.get_checkpoint_path("r1", ".keras")]


def test_remote_view_pickles_without_a_connection(s3_server):
    store = Store.create(
        f"s3://{s3_server.bucket}/remote-{uuid.uuid4().hex[:8]}",
        storage_options=s3_server.storage_options(),
    )
    store.write_text(store.get_state_path("r1"), "{}")  # opens the connection
    assert store._fs is not None
    remote = pickle.loads(pickle.dumps(store.to_remote("r1", "idx1")))
    assert isinstance(remote, RemoteStore)
    assert remote.store._fs is None
    assert remote.checkpoint_path(".keras") == store.get_checkpoint_path("r1", ".keras")
    assert remote.train_data_path == store.get_train_data_path("idx1")
    assert remote.read(remote.state_path) == b"{}"  # reconnects on first use
    with pytest.raises(ValueError, match="run_id"):
        _ = store.to_remote().checkpoint_path(".keras")


# -- S3 ------------------------------------------------------------------------------------


@pytest.fixture
def s3_prefix(s3_server):
    return f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:8]}"


def test_s3_round_trip(s3_server, s3_prefix, tmp_path):
    store = Store.create(s3_prefix, storage_options=s3_server.storage_options())
    assert isinstance(store, S3Store)
    assert store.get_checkpoint_path("r1", ".keras") == f"{s3_prefix}/runs/r1/checkpoint.keras"
    assert store.spark_url(store.get_run_path("r1")) == "s3a://" + s3_prefix[5:] + "/runs/r1"
    store.write_text(store.get_state_path("r1"), '{"epoch": 3}')
    assert store.read_text(store.get_state_path("r1")) == '{"epoch": 3}'
    local = tmp_path / "m.keras"
    local.write_bytes(b"w" * 100_000)
    store.upload_file(str(local), store.get_checkpoint_path("r1", ".keras"))
    store.download_file(store.get_checkpoint_path("r1", ".keras"), str(tmp_path / "d.keras"))
    assert (tmp_path / "d.keras").read_bytes() == b"w" * 100_000
    assert store.get_checkpoints("r1") == [store.get_checkpoint_path("r1", ".keras")]
    # The objects are really on the endpoint, under the layout's keys.
    key_prefix = s3_prefix.split("/", 3)[3]
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=key_prefix)
    keys = sorted(o["Key"][len(key_prefix) + 1 :] for o in listed["Contents"])
    assert keys == ["runs/r1/checkpoint.keras", "runs/r1/state.json"]


def test_s3_checkpoint_survives_a_death_mid_upload(s3_server, s3_prefix):
    options = s3_server.storage_options()
    store = Store.create(s3_prefix, storage_options=options)
    store.write_bytes(store.get_checkpoint_path("r1", ".keras"), b"v1")
    # The writer dies while its PUT of the new checkpoint is in flight.
    patch = """
        import s3fs.core
        real = s3fs.core.S3FileSystem._call_s3
        async def call(self, method, *args, **kwargs):
            if method == "put_object":
                os._exit(3)
            return await real(self, method, *args, **kwargs)
        s3fs.core.S3FileSystem._call_s3 = call
    """
    proc = _die_while_publishing(s3_prefix, patch, options)
    assert proc.returncode == 3, proc.stderr
    assert store.read(store.get_checkpoint_path("r1", ".keras")) == b"v1"
    assert store.get_checkpoints("r1") == [store.get_checkpoint_path("r1", ".keras")]


def test_s3_credentials_from_the_environment(s3_server, s3_prefix, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = Store.create(s3_prefix)
    store.write_text(store.get_state_path("r"), "ok")
    assert store.read(store.get_state_path("r")) == b"ok"


@pytest.mark.parametrize(
    ("overrides", "cause"),
    [
        ({"secret": "wrong-secret"}, "access denied.*signature"),
        ({"key": "AKIAUNKNOWN0000000000"}, "access denied.*Access Key Id"),
    ],
)
def test_s3_bad_credentials_fail_at_create(s3_server, s3_prefix, overrides, cause):
    with pytest.raises(RuntimeError, match=f"`{s3_prefix}`: {cause}") as err:
        Store.create(s3_prefix, storage_options=s3_server.storage_options(**overrides))
    assert "AWS_ACCESS_KEY_ID" in str(err.value)


def test_s3_missing_bucket_fails_at_create(s3_server):
    with pytest.raises(RuntimeError, match="the bucket `no-such-bucket` does not exist"):
        Store.create("s3://no-such-bucket/x", storage_options=s3_server.storage_options())
