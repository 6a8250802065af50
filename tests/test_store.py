"""The Store: path layout, atomic writes, and clear errors, on local disk and a real S3
endpoint (moto's server)."""

from __future__ import annotations

import base64
import http.server
import importlib.util
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import fsspec
import pytest

from flyte_hvd.core import log as log_module
from flyte_hvd.data.dataset import METADATA_FILENAME
from flyte_hvd.data.store import (
    AbstractFilesystemStore,
    DBFSLocalStore,
    FilesystemStore,
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
        ("file:/dbfs/ml/x", DBFSLocalStore),
        ("memory://exp", FilesystemStore),
        ("gs://bucket/x", FilesystemStore),
        ("abfs://container/x", FilesystemStore),
    ],
)
def test_store_class_follows_the_scheme(path, cls):
    assert store_class_for(path) is cls


@pytest.mark.parametrize("path", ["nosuch://bucket/x", "", None])
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
    assert store.get_checkpoint_filename() == "model.h5"
    # Without an extension: Horovod's meaning, the folder that holds the run's checkpoint.
    assert store.get_checkpoint_path("r") == f"{tmp_path}/elsewhere/r"
    assert store.to_remote("r").checkpoint_path("") == f"{tmp_path}/elsewhere/r/model.h5"
    assert not store.saving_runs


def test_checkpoint_path_needs_an_extension_without_a_chosen_file_name(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    for bad in ("keras", "./x"):
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


# -- Object stores: S3 (moto), Google Cloud Storage (gcp-storage-emulator), Azure (Azurite) --
# The same tests on each store's real HTTP endpoint (fixtures in conftest.py), through the
# fsspec package a user would have (s3fs, gcsfs, adlfs); what landed is checked through each
# vendor's own client.

_SERVERS = {"s3": "s3_server", "gs": "gcs_server", "abfs": "azurite_server"}


@pytest.fixture(params=list(_SERVERS))
def object_store(request):
    """The test endpoint of one object store (s3, gs, abfs), started once per session."""
    return request.getfixturevalue(_SERVERS[request.param])


@pytest.fixture
def object_prefix(object_store):
    """A fresh prefix in the endpoint's bucket (or container)."""
    return f"{object_store.protocol}://{object_store.bucket}/t-{uuid.uuid4().hex[:8]}"


def _key(prefix: str) -> str:
    """``prefix`` without its scheme and bucket: the object key under which it lands."""
    return prefix.split("/", 3)[3]


def test_parquet_datasets(tmp_path, object_store, object_prefix):
    local = Store.create(str(tmp_path))
    remote = Store.create(object_prefix, storage_options=object_store.storage_options())
    for store in (local, remote):
        path = store.get_train_data_path("1")
        assert not store.is_parquet_dataset(path)  # missing
        store.write_text(f"{path}/notes.txt", "not parquet")
        assert not store.is_parquet_dataset(path)
        _write_parquet(store, path, 7)
        assert store.is_parquet_dataset(path)
        assert store.get_parquet_dataset(path).count_rows() == 7
        store.delete(path)
        assert not store.exists(path)
    assert object_store.list_keys(_key(object_prefix)) == []


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
    # The writer dies with its local copy in its temporary folder: one of the test's own.
    scratch = tempfile.mkdtemp(prefix="flyte-hvd-test-")
    try:
        return subprocess.run(
            [sys.executable, "-c", code, prefix],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TMPDIR": scratch},
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_local_checkpoint_survives_a_death_mid_write(tmp_path):
    store = Store.create(str(tmp_path))
    store.write_bytes(store.get_checkpoint_path("r1", ".keras"), b"v1")
    # The writer dies after writing the new file but before publishing it.
    proc = _die_while_publishing(str(tmp_path), "os.replace = lambda *a: os._exit(3)")
    assert proc.returncode == 3, proc.stderr
    assert store.read(store.get_checkpoint_path("r1", ".keras")) == b"v1"
    assert store.get_checkpoints("r1") == [store.get_checkpoint_path("r1", ".keras")]


def test_remote_view_pickles_without_a_connection(object_store, object_prefix):
    store = Store.create(object_prefix, storage_options=object_store.storage_options())
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


def test_object_store_round_trip(object_store, object_prefix, tmp_path):
    store = Store.create(object_prefix, storage_options=object_store.storage_options())
    assert type(store) is (S3Store if object_store.protocol == "s3" else FilesystemStore)
    checkpoint = store.get_checkpoint_path("r1", ".keras")
    assert checkpoint == f"{object_prefix}/runs/r1/checkpoint.keras"
    # Spark reaches S3 through S3A; gs/abfs keep their URL (prepare_data uploads through
    # fsspec when the cluster has no connector for it).
    spark_scheme = "s3a" if object_store.protocol == "s3" else object_store.protocol
    assert store.spark_url(store.get_run_path("r1")) == (
        f"{spark_scheme}://{object_prefix.split('://', 1)[1]}/runs/r1"
    )
    store.write_text(store.get_state_path("r1"), '{"epoch": 3}')
    assert store.read_text(store.get_state_path("r1")) == '{"epoch": 3}'
    local = tmp_path / "m.keras"
    local.write_bytes(b"w" * 100_000)
    store.upload_file(str(local), checkpoint)
    store.download_file(checkpoint, str(tmp_path / "d.keras"))
    assert (tmp_path / "d.keras").read_bytes() == b"w" * 100_000
    assert store.get_checkpoints("r1") == [checkpoint]
    # The objects are really on the endpoint, under the layout's keys, and nothing else is
    # (no temporary, no write probe, no directory marker).
    key = _key(object_prefix)
    assert object_store.list_keys(key) == [
        f"{key}/runs/r1/checkpoint.keras",
        f"{key}/runs/r1/state.json",
    ]


# How a writer dies at the moment its upload of the new checkpoint goes out, per client.
_DIE_ON_UPLOAD = {
    "s3": """
        import s3fs.core
        real = s3fs.core.S3FileSystem._call_s3
        async def call(self, method, *args, **kwargs):
            if method == "put_object":
                os._exit(3)
            return await real(self, method, *args, **kwargs)
        s3fs.core.S3FileSystem._call_s3 = call
    """,
    "gs": """
        import gcsfs.core
        async def upload(*args, **kwargs):
            os._exit(3)
        gcsfs.core.simple_upload = upload
    """,
    "abfs": """
        from azure.storage.blob.aio import BlobClient
        async def upload(*args, **kwargs):
            os._exit(3)
        BlobClient.upload_blob = upload
    """,
}


def test_checkpoint_survives_a_death_mid_upload(object_store, object_prefix):
    options = object_store.storage_options()
    store = Store.create(object_prefix, storage_options=options)
    checkpoint = store.get_checkpoint_path("r1", ".keras")
    store.write_bytes(checkpoint, b"v1")
    proc = _die_while_publishing(object_prefix, _DIE_ON_UPLOAD[object_store.protocol], options)
    assert proc.returncode == 3, proc.stderr
    assert store.read(checkpoint) == b"v1"
    assert store.get_checkpoints("r1") == [checkpoint]
    assert object_store.list_keys(_key(object_prefix)) == [_key(checkpoint)]  # nothing else


def _credentials_env(server) -> dict[str, str]:
    """The environment variables that point each store's client at the test endpoint."""
    if server.protocol == "s3":
        return {"AWS_ACCESS_KEY_ID": server.key, "AWS_SECRET_ACCESS_KEY": server.secret,
                "AWS_ENDPOINT_URL": server.endpoint_url,
                "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    if server.protocol == "gs":
        return {"STORAGE_EMULATOR_HOST": server.endpoint_url}
    return {"AZURE_STORAGE_CONNECTION_STRING": server.connection_string()}


def test_credentials_from_the_environment(object_store, object_prefix, monkeypatch):
    for name, value in _credentials_env(object_store).items():
        monkeypatch.setenv(name, value)
    store = Store.create(object_prefix)
    store.write_text(store.get_state_path("r"), "ok")
    assert store.read(store.get_state_path("r")) == b"ok"
    assert object_store.list_keys(_key(object_prefix)) == [_key(store.get_state_path("r"))]


@pytest.mark.parametrize(
    ("overrides", "cause"),
    [
        ({"secret": "wrong-secret"}, "access denied.*signature"),
        ({"key": "AKIAUNKNOWN0000000000"}, "access denied.*Access Key Id"),
    ],
)
def test_s3_bad_credentials_fail_at_create(s3_server, overrides, cause):
    prefix = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError, match=f"`{prefix}`: {cause}") as err:
        Store.create(prefix, storage_options=s3_server.storage_options(**overrides))
    assert "AWS_ACCESS_KEY_ID" in str(err.value)


def test_azure_bad_key_fails_at_create(azurite_server):
    prefix = f"abfs://{azurite_server.bucket}/t-{uuid.uuid4().hex[:8]}"
    wrong = base64.b64encode(b"not the account key" * 3).decode()
    options = azurite_server.storage_options(
        connection_string=azurite_server.connection_string(wrong)
    )
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=rf"`{prefix}`: access denied \(.*failed to authenticate"
    ) as err:
        Store.create(prefix, storage_options=options)
    assert time.monotonic() - start < 10  # one refused request, not a wait
    assert "'connection_string'" in str(err.value) and "AZURE_STORAGE_ACCOUNT_KEY" in str(err.value)
    assert "container's permissions" in str(err.value)
    assert azurite_server.list_keys(_key(prefix)) == []


@pytest.mark.parametrize(
    ("token", "env", "cause"),
    [
        ("google_default", {"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent/key.json"},
         r"DefaultCredentialsError: File /nonexistent/key.json was not found"),
        ("{tmp}/key.json", {}, r"JSONDecodeError"),
    ],
)  # fmt: skip
def test_gcs_bad_credentials_fail_at_create(gcs_server, tmp_path, monkeypatch, token, env, cause):
    (tmp_path / "key.json").write_text("not a service-account key")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    prefix = f"gs://{gcs_server.bucket}/t-{uuid.uuid4().hex[:8]}"
    options = gcs_server.storage_options(token=token.format(tmp=tmp_path))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"cannot open the store at `{prefix}`: `gcsfs` could "
                       rf"not sign in with these `storage_options` \({cause}") as err:  # fmt: skip
        Store.create(prefix, storage_options=options)
    assert time.monotonic() - start < 10
    assert "'token'" in str(err.value) and "GOOGLE_APPLICATION_CREDENTIALS" in str(err.value)
    assert gcs_server.list_keys(_key(prefix)) == []


class _GoogleRefuses(http.server.BaseHTTPRequestHandler):
    """Answers as Google does when it refuses: its OAuth token endpoint (`/token`) rejects the
    signed key, Cloud Storage refuses every request (403), each with Google's JSON error."""

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/token"):
            status = 400
            body = {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
        else:
            status = 403
            body = {"error": {"code": 403, "message": "caller does not have storage.objects."
                              "create access to the Google Cloud Storage object."}}  # fmt: skip
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def google_refuses():
    """The URL of a local endpoint that refuses as Google does (the emulator checks nothing)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GoogleRefuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def _service_account_key(path, token_uri: str) -> str:
    """A well-formed service-account key file (a fresh RSA key) whose tokens come from
    ``token_uri``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()  # fmt: skip
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "p", "private_key_id": "1",
        "private_key": pem, "client_email": "trainer@p.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": token_uri,
    }))  # fmt: skip
    return str(path)


def test_gcs_refused_key_fails_at_create_at_once(google_refuses, tmp_path):
    """gcsfs alone retries a refused token 6 times (33 s measured) before failing."""
    key = _service_account_key(tmp_path / "key.json", f"{google_refuses}/token")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"cannot open the store at `gs://bucket/x`: `gcsfs` "
                       r"could not sign in .*RefreshError: \('invalid_grant: Invalid JWT "
                       r"Signature.*Check the credentials") as err:  # fmt: skip
        Store.create("gs://bucket/x", storage_options={"token": key,
                                                       "endpoint_url": google_refuses})  # fmt: skip
    assert time.monotonic() - start < 5
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(err.value)


def test_gcs_refused_write_fails_at_create(google_refuses):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"cannot write to the store at `gs://bucket/x`: "
                       r"access denied \(OSError: Forbidden: .*\). Check the credentials "
                       r".*'token'.*the bucket's permissions") as err:  # fmt: skip
        Store.create("gs://bucket/x", storage_options={"token": "anon",
                                                       "endpoint_url": google_refuses})  # fmt: skip
    assert time.monotonic() - start < 5
    assert "STORAGE_EMULATOR_HOST" in str(err.value)


def test_missing_bucket_fails_at_create(object_store):
    kind = "container" if object_store.protocol == "abfs" else "bucket"
    prefix = f"{object_store.protocol}://no-such-{kind}/x"
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=rf"`{prefix}`: the {kind} `no-such-{kind}` does not exist .*Create it or fix "
        rf"`prefix_path`",
    ):
        Store.create(prefix, storage_options=object_store.storage_options())
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("in_ci", [True, False], ids=["ci", "contributor"])
def test_missing_azurite_fails_the_abfs_tests_in_ci_saying_what_is_missing(
    tmp_path, monkeypatch, in_ci
):
    """Without Azurite, and without npm to install it, the abfs:// tests fail under CI and are
    skipped elsewhere, saying what is missing either way."""
    import needs
    from conftest import find_azurite

    monkeypatch.setattr(needs, "IN_CI", in_ci)
    tools = tmp_path / "bin"  # what the install script needs, without node and npm
    tools.mkdir()
    for tool in ("bash", "dirname", "grep", "mkdir"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(tools), "AZURITE_PREFIX": str(tmp_path / "azurite")}
    outcome = pytest.fail.Exception if in_ci else pytest.skip.Exception
    with pytest.raises(outcome, match=r"(?s)Azurite \(the Azure Storage emulator the abfs:// "
                       r"tests run against\), which is missing, .*npm is not installed.*"
                       r"run `make setup`"):  # fmt: skip
        find_azurite(env)
    assert not (tmp_path / "azurite").exists()


_WITHOUT_PACKAGE = """
import sys
import tempfile
sys.modules[sys.argv[1]] = None  # as if it were not installed
from flyte_hvd.data.store import Store
try:
    Store.create(sys.argv[2])
except ImportError as error:
    print(error.name)
    print(error)
"""


def test_a_filesystem_another_library_registered_does_not_replace_the_stores(monkeypatch):
    """The Flyte 2 SDK, once imported, registers obstore's filesystems over gs, s3, abfs...
    in fsspec's registry: a Store keeps the fsspec package of its scheme (gcsfs here), whose
    options (``token``), checks and atomic writes it knows."""
    import importlib

    import gcsfs
    import s3fs

    from flyte_hvd.data.store import url_to_fs

    registry = importlib.import_module("fsspec.registry")  # `fsspec.registry` is a mapping

    class Other(fsspec.AbstractFileSystem):
        protocol = "gs"

    monkeypatch.setitem(registry._registry, "gs", Other)
    monkeypatch.setitem(registry._registry, "s3", Other)
    assert fsspec.get_filesystem_class("gs") is Other
    store = FilesystemStore("gs://bucket/prefix", storage_options={"token": "anon"})
    assert isinstance(store.get_filesystem(), gcsfs.GCSFileSystem)
    # Saved models and datasets read by URL (``url_to_fs``) too.
    fs, path = url_to_fs("s3://bucket/models/keras-1", anon=True)
    assert isinstance(fs, s3fs.S3FileSystem) and path == "bucket/models/keras-1"


@pytest.mark.parametrize(
    ("url", "package", "extra"),
    [("gs://bucket/x", "gcsfs", "gcs"), ("abfs://container/x", "adlfs", "azure")],
)
def test_store_without_its_package_names_the_package_and_the_extra(url, package, extra):
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_PACKAGE, package, url],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    name, message = proc.stdout.split("\n", 1)
    assert name == package
    assert f"the package `{package}` is not installed" in message
    assert f"`pip install 'flyte-hvd[{extra}]'` or `pip install {package}`" in message


# -- Horovod's Store API -----------------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which one-time warnings were given, so a test sees its own."""
    monkeypatch.setattr(log_module, "_warned", set())  # the once-per-process registry


@pytest.fixture
def memory_prefix():
    """A memory:// prefix of its own, emptied afterwards (fsspec's memory is process-wide)."""
    prefix = f"memory://flyte-hvd-tests/{uuid.uuid4().hex[:8]}"
    yield prefix
    memory = fsspec.filesystem("memory")
    if memory.exists(prefix):
        memory.rm(prefix, recursive=True)


@pytest.fixture(params=["local", "memory", *_SERVERS])
def any_store(request, tmp_path, memory_prefix):
    """The same checks on a LocalStore, a FilesystemStore over fsspec's memory://, and a
    Store on each object store's test endpoint (s3, gs, abfs)."""
    if request.param == "local":
        return LocalStore(str(tmp_path / "store"))
    if request.param == "memory":
        return FilesystemStore(memory_prefix)
    server = request.getfixturevalue(_SERVERS[request.param])
    prefix = f"{server.protocol}://{server.bucket}/any-{uuid.uuid4().hex[:8]}"
    return Store.create(prefix, storage_options=server.storage_options())


def test_create_gives_a_filesystem_store_for_other_fsspec_protocols(memory_prefix, tmp_path):
    # (Store.create refuses memory://, which the ranks cannot see: the class is used here.)
    store = FilesystemStore(memory_prefix, temp_dir=str(tmp_path / "scratch"))
    assert store_class_for(memory_prefix) is FilesystemStore
    assert store.protocol == "memory"
    assert store.temp_dir == str(tmp_path / "scratch")
    assert store.get_train_data_path(2) == f"{memory_prefix}/intermediate_train_data.2"
    assert store.get_localized_path(store.get_run_path("r")) == (
        f"/{memory_prefix[len('memory://') :]}/runs/r"
    )


def test_every_store_is_an_abstract_filesystem_store(tmp_path, memory_prefix):
    stores = [
        LocalStore(str(tmp_path)),
        DBFSLocalStore("dbfs:/ml/x"),
        HDFSStore("hdfs://nn:8020/x"),
        S3Store("s3://bucket/x"),
        FilesystemStore(memory_prefix),
    ]
    for store in stores:
        assert isinstance(store, AbstractFilesystemStore)
        assert isinstance(store, Store)


def test_horovod_path_names(any_store):
    store = any_store
    run = store.get_run_path("r1")
    assert store.get_checkpoint_filename() == "checkpoint"
    assert store.get_checkpoint_filename(".keras") == "checkpoint.keras"
    # Horovod's idiom names the same file as ours.
    assert store.join(store.get_checkpoint_path("r1"), store.get_checkpoint_filename(".pt")) == (
        store.get_checkpoint_path("r1", ".pt")
    )
    assert store.get_checkpoint_path("r1") == run
    assert store.get_logs_subdir() == "logs"
    assert store.get_logs_path("r1") == store.join(run, store.get_logs_subdir())
    assert store.saving_runs() is True and store.saving_runs
    options = store.storage_options
    assert not store_class_for(store.prefix_path)(  # Store.create refuses memory://
        store.prefix_path, save_runs=False, storage_options=options
    ).saving_runs()
    train = store.get_train_data_path("7")
    assert store.get_data_metadata_path(train) == store.join(train, METADATA_FILENAME)
    assert store.get_filesystem() is store.fs
    assert isinstance(store.get_filesystem(), fsspec.AbstractFileSystem)
    with pytest.raises(ValueError, match=r"`extension` must be .* found 'keras'"):
        store.get_checkpoint_filename("keras")


def test_full_and_localized_paths_on_a_local_store(tmp_path):
    store = LocalStore(str(tmp_path / "s"))
    run = store.get_run_path("r")
    assert store.get_full_path(run) == f"file://{tmp_path}/s/runs/r"
    assert store.get_full_path(f"file://{run}/") == f"file://{run}"
    assert store.get_full_path("s3://bucket/key") == "s3://bucket/key"  # another store's URL
    assert store.get_localized_path(store.get_full_path(run)) == run
    full = pickle.loads(pickle.dumps(store.get_full_path_fn()))  # travels to the ranks
    assert full(run) == store.get_full_path(run)


def test_full_and_localized_paths_on_a_memory_store(memory_prefix):
    store = FilesystemStore(memory_prefix + "/")
    local = memory_prefix[len("memory://") :]
    assert store.prefix_path == memory_prefix
    assert store.get_full_path(f"/{local}/x") == f"memory:///{local}/x"
    assert store.get_localized_path(f"{memory_prefix}/x") == f"/{local}/x"
    assert store.get_localized_path(store.get_full_path(f"/{local}/x")) == f"/{local}/x"
    assert store.get_full_path("gs://bucket/k") == "gs://bucket/k"
    with pytest.raises(ValueError, match=r"scheme `s3`.*`memory://`"):
        FilesystemStore(memory_prefix, train_path="s3://bucket/train")
    store.write_text(store.get_state_path("r"), "{}")
    assert store.fs.cat_file(store.get_localized_path(store.get_state_path("r"))) == b"{}"


def test_local_output_dir_then_sync_into_the_run(any_store, tmp_path):
    store = any_store
    store.temp_dir = str(tmp_path / "scratch")  # made on first use
    local_dir = pickle.loads(pickle.dumps(store.get_local_output_dir_fn("r1")))
    sync = store.sync_fn("r1")
    with local_dir() as folder:
        assert os.path.isdir(folder)
        assert os.path.dirname(folder) == str(tmp_path / "scratch")
        os.makedirs(os.path.join(folder, "logs"))
        with open(os.path.join(folder, "checkpoint.keras"), "wb") as f:
            f.write(b"epoch-1")
        with open(os.path.join(folder, "logs", "events"), "wb") as f:
            f.write(b"e")
        run = store.get_run_path("r1")
        assert sorted(sync(folder)) == sorted(
            [store.join(run, "checkpoint.keras"), store.join(run, "logs/events")]
        )
        assert store.read(store.join(run, "logs/events")) == b"e"
        assert sync(folder) == []  # nothing changed since
        with open(os.path.join(folder, "checkpoint.keras"), "wb") as f:
            f.write(b"epoch-2!")
        shipped = pickle.loads(pickle.dumps(sync))  # a rank's copy keeps what it uploaded
        assert shipped(folder) == [store.join(run, "checkpoint.keras")]
        assert store.read(store.get_checkpoint_path("r1", ".keras")) == b"epoch-2!"
        assert store.get_checkpoints("r1") == [store.get_checkpoint_path("r1", ".keras")]
    assert not os.path.exists(folder)  # removed on exit
    with pytest.raises(FileNotFoundError, match=r"`local_run_path`.*is not a folder"):
        sync(str(tmp_path / "missing"))


def test_copy_puts_a_folders_contents_into_the_target(any_store, tmp_path):
    store = any_store
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a")
    (src / "sub" / "b.txt").write_bytes(b"b")
    target = store.join(store.prefix_path, "copied")
    store.write_text(store.join(target, "old.txt"), "already there")

    with pytest.raises(ValueError, match=r"is a folder; pass `recursive=True`"):
        store.copy(str(src), target)
    counter = fsspec.callbacks.Callback()
    written = store.copy(str(src), target, recursive=True, callback=counter, overwrite=True)
    # Into `target` itself, not `target/src`, although `target` existed.
    assert written == [store.join(target, "a.txt"), store.join(target, "sub/b.txt")]
    assert (counter.size, counter.value) == (2, 2)
    assert store.read(store.join(target, "sub/b.txt")) == b"b"
    assert store.read_text(store.join(target, "old.txt")) == "already there"

    assert store.copy(str(src / "a.txt"), store.join(target, "single")) == [
        store.join(target, "single")
    ]
    assert store.read(store.join(target, "single")) == b"a"
    with pytest.raises(FileNotFoundError, match=r"`lpath`=.* does not exist"):
        store.copy(str(tmp_path / "nothing"), target)


def test_read_serialized_keras_model_is_horovods_encoding(any_store):
    store = any_store
    path = store.get_checkpoint_path("r1", ".keras")
    store.write_bytes(path, b"PK\x03\x04 a keras zip")
    encoded = store.read_serialized_keras_model(path, None, {})
    assert isinstance(encoded, str) and encoded.isascii()
    # Horovod's codec.loads_base64 is cloudpickle.loads(base64.b64decode(...)).
    assert pickle.loads(base64.b64decode(encoded)) == b"PK\x03\x04 a keras zip"
    with pytest.raises(FileNotFoundError, match="no checkpoint at `ckpt_path`"):
        store.read_serialized_keras_model(store.get_checkpoint_path("r2", ".keras"), None, {})
    with pytest.raises(ValueError, match=r"is a folder .*one Keras model file"):
        store.read_serialized_keras_model(store.get_run_path("r1"), None, {})


def test_parquet_on_a_memory_store(memory_prefix):
    store = FilesystemStore(memory_prefix)
    path = store.get_train_data_path("1")
    assert not store.is_parquet_dataset(path)
    _write_parquet(store, path, 5)
    assert store.is_parquet_dataset(path)
    assert store.get_parquet_dataset(path).count_rows() == 5
    store.delete(path)
    assert not store.exists(path)


def test_matches_per_class():
    assert LocalStore.matches("/tmp/x") and LocalStore.matches("file:///tmp/x")
    assert not LocalStore.matches("s3://bucket/x")
    assert S3Store.matches("s3://b/x") and S3Store.matches("s3a://b/x")
    assert HDFSStore.matches("hdfs://nn:8020/x") and not HDFSStore.matches("/x")
    assert DBFSLocalStore.matches("dbfs:/x") and DBFSLocalStore.matches("file:/dbfs/x")
    assert DBFSLocalStore.matches_dbfs("/dbfs/x") and not DBFSLocalStore.matches("/tmp/x")
    assert FilesystemStore.matches("memory://x") and FilesystemStore.matches("gs://b/x")
    assert FilesystemStore.matches("/tmp/x")  # local, through fsspec's file://
    assert not FilesystemStore.matches("nosuch://x")


def test_unknown_scheme_says_what_to_use():
    for make in (Store.create, FilesystemStore):
        with pytest.raises(ValueError, match=r"scheme `nosuch`, which neither .* fsspec"):
            make("nosuch://bucket/x")


def test_known_scheme_without_its_package_names_the_package(monkeypatch):
    from fsspec.registry import known_implementations

    monkeypatch.setitem(
        known_implementations,
        "flytehvdfake",
        {"class": "flyte_hvd_no_such_pkg.FakeFS", "err": "Install flyte_hvd_no_such_pkg"},
    )
    with pytest.raises(
        ImportError, match=r"package `flyte_hvd_no_such_pkg` is not installed.*pip install"
    ) as err:
        Store.create("flytehvdfake://bucket/x")
    assert err.value.name == "flyte_hvd_no_such_pkg"


@pytest.mark.skipif(importlib.util.find_spec("paramiko") is not None, reason="paramiko is here")
def test_sftp_without_paramiko_names_paramiko():
    with pytest.raises(ImportError, match=r"`sftp`.*`paramiko` is not installed"):
        Store.create("sftp://host/x")


def test_hdfs_takes_horovods_arguments(monkeypatch, caplog, tmp_path, fresh_warnings):
    made = {}

    class FakeHadoop:  # records what pyarrow's HadoopFileSystem would get; no cluster needed
        def __init__(self, **kwargs):
            made.update(kwargs)

    monkeypatch.setattr("fsspec.implementations.arrow.HadoopFileSystem", FakeHadoop)
    with caplog.at_level(logging.WARNING, logger="flyte_hvd"):
        store = HDFSStore(
            "hdfs://nn:8020/user/me/exp",
            host="other-nn",
            port=9000,
            user="me",
            kerb_ticket="/tmp/krb5cc_1",
            driver="libhdfs3",
            extra_conf={"dfs.replication": "2"},
            temp_dir=str(tmp_path / "t"),
            runs_path="/user/me/runs",
            storage_options={"replication": 1},
        )
        HDFSStore("hdfs:///x", None, None, None, None, "libhdfs3")  # Horovod's positions
    assert [r.getMessage() for r in caplog.records if "driver" in r.getMessage()] == [
        "`HDFSStore` got `driver`='libhdfs3', which is accepted for Horovod compatibility "
        "and does nothing here: pyarrow's HadoopFileSystem always uses libhdfs."
    ]
    assert (store.host, store.port, store.temp_dir) == ("other-nn", 9000, str(tmp_path / "t"))
    # Paths keep the URL's namenode; a bare absolute path gets it too.
    assert store.get_runs_path() == "hdfs://nn:8020/user/me/runs"
    assert store.get_full_path("/data/x") == "hdfs://nn:8020/data/x"
    assert store.get_localized_path(store.get_run_path("r")) == "/user/me/runs/r"
    assert isinstance(store.fs, FakeHadoop)
    assert made == {
        "host": "other-nn",
        "port": 9000,
        "user": "me",
        "kerb_ticket": "/tmp/krb5cc_1",
        "extra_conf": {"dfs.replication": "2"},
        "replication": 1,
    }
    bare = HDFSStore("/user/me/exp")
    assert bare.prefix_path == "hdfs:///user/me/exp" and (bare.host, bare.port) == ("default", 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefix_path": "s3://bucket/x"}, r"scheme `s3`; `HDFSStore` expects"),
        ({"prefix_path": "relative/x"}, r"not an HDFS path"),
        ({"prefix_path": "hdfs://nn/x", "port": "8020"}, r"`port` must be an integer"),
        ({"prefix_path": "hdfs://nn/x", "extra_conf": "a=b"}, r"`extra_conf` must be a dict"),
    ],
)
def test_hdfs_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HDFSStore(**kwargs)


def test_dbfs_and_local_take_horovods_arguments(tmp_path, caplog, fresh_warnings):
    dbfs = DBFSLocalStore(
        "file:/dbfs/ml/exp", None, None, None, None, False, None, "model.keras"
    )  # Horovod's positional order: train, val, test, runs, save_runs, options, checkpoint
    assert dbfs.prefix_path == "/dbfs/ml/exp" and not dbfs.saving_runs()
    assert dbfs.get_checkpoint_filename() == "model.keras"
    assert dbfs.get_full_path(dbfs.get_run_path("r")) == "file:///dbfs/ml/exp/runs/r"
    assert DBFSLocalStore.normalize_path("dbfs:/ml/x") == "/dbfs/ml/x"
    with pytest.raises(ValueError, match=r"is not a DBFS path; `DBFSLocalStore` expects"):
        DBFSLocalStore(str(tmp_path))
    with pytest.raises(ValueError, match=r"not a DBFS path"):
        DBFSLocalStore.normalize_path("/tmp/x")

    with caplog.at_level(logging.WARNING, logger="flyte_hvd"):
        local = LocalStore(str(tmp_path), storage_options={}, not_an_option=1)
        LocalStore(str(tmp_path), not_an_option=2)
    assert local.prefix_path == str(tmp_path)
    warned = [r.getMessage() for r in caplog.records if "not_an_option" in r.getMessage()]
    assert len(warned) == 1 and "`LocalStore` got `not_an_option`" in warned[0]


def test_remote_view_has_horovods_attributes(any_store):
    store = any_store
    remote = pickle.loads(pickle.dumps(store.to_remote("r1", "i3")))
    assert remote.test_data_path == store.get_test_data_path("i3")
    assert remote.runs_path == store.get_runs_path()
    assert remote.checkpoint_filename == "checkpoint"
    assert remote.logs_subdir == "logs"
    assert remote.saving_runs is True
    with remote.get_local_output_dir() as folder:
        with open(os.path.join(folder, "checkpoint"), "wb") as f:
            f.write(b"m")
        assert remote.sync(folder) == [store.join(store.get_run_path("r1"), "checkpoint")]
        assert remote.sync(folder) == []  # the same function each time: only changes go
    assert store.get_checkpoints("r1") == [store.join(store.get_run_path("r1"), "checkpoint")]


# -- a run's lease, id and resume checks (flyte_hvd.estimators.runs) -------------------------


@pytest.fixture(params=["local", "s3"])
def lease_store(request, tmp_path, s3_server):
    """A LocalStore, and an S3Store on moto (exclusive create by a conditional PUT)."""
    if request.param == "local":
        return Store.create(str(tmp_path / "store"))
    prefix = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:8]}"
    return Store.create(prefix, storage_options=s3_server.storage_options())


def test_create_exclusive_has_one_winner_among_racing_writers(lease_store):
    import concurrent.futures

    path = lease_store.join(lease_store.get_run_path("race"), "lease.json")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: lease_store.create_exclusive(path, str(i).encode()),
                            range(8)))  # fmt: skip
    assert won.count(True) == 1
    assert lease_store.read(path) == str(won.index(True)).encode()
    assert lease_store.create_exclusive(path, b"again") is False


def test_a_live_lease_refuses_a_second_fit_and_release_removes_it(lease_store):
    from flyte_hvd.estimators.runs import RunLease, leased_run

    with leased_run(lease_store, "shared", "keras") as run_id:
        assert run_id == "shared"
        lease = RunLease(lease_store, "shared")
        assert lease_store.exists(lease.path)
        with pytest.raises(ValueError) as refused:
            lease.acquire()
        message = str(refused.value)
        assert f"run `shared` is in use by another fit: its lease `{lease.path}` is held by " \
               f"{lease.owner} (renewed " in message  # fmt: skip
        assert "Wait for that fit to end, or give another `run_id`" in message
    assert not lease_store.exists(lease.path)
    with leased_run(lease_store, "shared", "keras"):  # free again
        pass


def _write_lease(store: Store, run_id: str, **fields) -> str:
    import json
    import time

    from flyte_hvd.estimators.runs import LEASE_FILENAME

    now = time.time()
    record = {"owner": "other-host:4242", "host": "other-host", "pid": 4242, "pid_space": None,
              "token": "theirs", "started": now - 100, "renewed": now, "expires": now + 60,
              **fields}  # fmt: skip
    path = store.join(store.get_run_path(run_id), LEASE_FILENAME)
    store.write_text(path, json.dumps(record))
    return path


def test_a_stale_lease_is_taken_over_with_a_log_line(lease_store, caplog):
    import json
    import time

    from flyte_hvd.data.lease import pid_space
    from flyte_hvd.estimators.runs import RunLease

    caplog.set_level(logging.WARNING, logger="flyte_hvd")
    path = _write_lease(lease_store, "expired", expires=time.time() - 30)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    _write_lease(lease_store, "dead", owner=f"here:{dead.stdout.strip()}",
                 pid=int(dead.stdout), pid_space=pid_space())  # fmt: skip
    _write_lease(lease_store, "live-elsewhere")
    for run_id in ("expired", "dead"):
        lease = RunLease(lease_store, run_id)
        lease.acquire()
        assert json.loads(lease_store.read(lease.path))["token"] == lease.token
        lease.release()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("run `expired`: taking over the lease of other-host:4242, "
                               "which expired 3") for line in lines), lines  # fmt: skip
    assert f"run `dead`: taking over the lease of here:{int(dead.stdout)}, which is no longer " \
           f"running (process {int(dead.stdout)} is gone)" in lines  # fmt: skip
    # A lease of a process on another host is trusted until it expires.
    with pytest.raises(ValueError, match=r"run `live-elsewhere` is in use by another fit.*"
                                         r"held by other-host:4242"):  # fmt: skip
        RunLease(lease_store, "live-elsewhere").acquire()
    assert lease_store.exists(path) is False  # the expired one was replaced, then released


def test_default_run_ids_are_unique_sortable_and_never_an_existing_run(tmp_path, monkeypatch):
    import re

    from flyte_hvd.estimators import runs

    store = Store.create(str(tmp_path / "store"))
    ids = []
    for _ in range(20):
        with runs.leased_run(store, None, "keras") as run_id:
            ids.append(run_id)
    assert len(set(ids)) == 20
    assert all(re.fullmatch(r"keras_\d{8}_\d{6}_[0-9a-f]{8}", i) for i in ids), ids
    # An id whose folder exists already (another fit's run) is skipped, never resumed.
    taken = iter(["keras_taken", "keras_taken", "keras_new"])
    store.write_text(store.get_state_path("keras_taken"), '{"epoch": 1}')
    monkeypatch.setattr(runs, "new_run_id", lambda framework: next(taken))
    with runs.leased_run(store, None, "keras") as run_id:
        assert run_id == "keras_new"


def _zip_bytes() -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("config.json", "{}" * 100)
    return buffer.getvalue()


def _run_record(store: Store, run_id: str, state: str, last: bytes, checkpoint: bytes,
                extension: str = ".keras"):  # fmt: skip
    store.write_text(store.get_state_path(run_id), state)
    store.write_bytes(store.join(store.get_run_path(run_id), f"last{extension}"), last)
    store.write_bytes(store.get_checkpoint_path(run_id, extension), checkpoint)
    return store.to_remote(run_id)


def test_resume_falls_back_to_an_intact_checkpoint(lease_store, caplog):
    from flyte_hvd.estimators.runs import check_resumable

    caplog.set_level(logging.WARNING, logger="flyte_hvd")
    good = _zip_bytes()
    remote = _run_record(lease_store, "r", '{"epoch": 1}', good[: len(good) // 2], good)
    check_resumable(remote, 3, ".keras")
    last = lease_store.join(lease_store.get_run_path("r"), "last.keras")
    assert lease_store.read(last) == good  # the checkpoint now stands in for the last model
    assert [r.getMessage() for r in caplog.records] == [
        f"run `r`: its last model `{last}` is damaged: it is not a complete model archive "
        f"(BadZipFile: File is not a zip file); resuming from its checkpoint "
        f"`{lease_store.get_checkpoint_path('r', '.keras')}`"
    ]
    check_resumable(remote, 3, ".keras")  # now intact: nothing to say
    assert len(caplog.records) == 1


@pytest.mark.parametrize(
    ("state", "last", "checkpoint", "match"),
    [
        ('{"epoch": 1', "good", "good", r"its record `.*/runs/r/state.json` is damaged: it is "
                                        r"not JSON \(Expecting"),
        ('{"epoch": "1"}', "good", "good", r"`epoch` must be an int >= 0 \(epochs completed\); "
                                          r"found '1'"),
        ('{"epoch": 1, "history": {"loss": ["x"]}}', "good", "good",
         r"`history` must be an object of metric name -> list of numbers"),
        ('{"epochs": 3}', "good", "good", r"`epoch` is missing"),
        ('{"epoch": 1}', "", "", r"its last model `.*/runs/r/last.keras` is damaged: it is not a "
                                 r"complete model archive .* and its checkpoint "
                                 r"`.*/runs/r/checkpoint.keras` is damaged.* Restore either file, "
                                 r"or delete the run's folder `.*/runs/r` to train it from the "
                                 r"start, or give a new `run_id`"),
        ('{"epoch": 1, "best": 0.5}', "good", "half",
         r"its checkpoint `.*/runs/r/checkpoint.keras`, the best model of its earlier epochs, "
         r"is damaged"),
        ('{"epoch": 3}', "good", "half", r"run `r` trained 3 epoch\(s\) \(`epochs`=3\), but its "
                                        r"model `.*/runs/r/checkpoint.keras` is damaged"),
    ],
)  # fmt: skip
def test_a_damaged_run_record_is_refused_naming_the_file(lease_store, state, last, checkpoint,
                                                         match):  # fmt: skip
    from flyte_hvd.estimators.runs import check_resumable

    good = _zip_bytes()
    content = {"good": good, "half": good[:-10], "": b""}
    remote = _run_record(lease_store, "r", state, content[last], content[checkpoint])
    with pytest.raises(ValueError, match=match):
        check_resumable(remote, 3, ".keras")


def test_a_best_checkpoint_does_not_stand_in_where_the_model_holds_the_epoch(tmp_path):
    """Lightning resumes at the epoch its file records: the best of an earlier epoch would
    retrain epochs that state.json already counts."""
    from flyte_hvd.estimators.runs import check_resumable

    store = Store.create(str(tmp_path / "store"))
    good = _zip_bytes()
    remote = _run_record(store, "r", '{"epoch": 2, "best": 0.1}', b"", good, ".ckpt")
    with pytest.raises(ValueError, match=r"its checkpoint `.*/runs/r/checkpoint.ckpt` holds the "
                                         r"best model of an earlier epoch"):  # fmt: skip
        check_resumable(remote, 3, ".ckpt", epoch_in_model=True)
    check_resumable(remote, 3, ".ckpt")  # a framework that resumes at state.json's epoch


def test_a_finished_run_is_returned_not_refused(lease_store, caplog):
    """A refit of a run that trained its epochs (a retried task whose fit had finished)
    returns its model: ``check_resumable`` says so, with one warning on how to go on."""
    from flyte_hvd.estimators.runs import check_resumable

    caplog.set_level(logging.WARNING, logger="flyte_hvd")
    good = _zip_bytes()
    remote = _run_record(lease_store, "r", '{"epoch": 3}', good, good)
    assert check_resumable(remote, 3, ".keras") is True
    assert check_resumable(remote, 2, ".keras") is True
    assert check_resumable(remote, 4, ".keras") is False
    warned = [r.getMessage() for r in caplog.records if "already trained" in r.getMessage()]
    assert len(warned) == 2
    assert "run `r` already trained 3 epoch(s) and `epochs`=3: its model is returned" in warned[0]
    assert "fit again with `epochs` > 3 and the same `run_id`" in warned[0]


def _interrupted(call) -> float:
    """Runs ``call`` with one Ctrl-C (SIGINT) 0.1 s into it; asserts that the KeyboardInterrupt
    reaches the caller and returns the seconds until it did."""
    import signal

    armed = {"on": True}

    def handle(signum, frame):
        if armed.pop("on", False):
            raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, handle)
    presser = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
    try:
        presser.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            call()
        return time.monotonic() - started
    finally:
        presser.join()
        signal.signal(signal.SIGINT, before)


def test_an_interrupted_store_operation_ends_before_the_interruption_goes_on(tmp_path):
    """Ctrl-C while ``bounded`` waits: the write in its thread finishes first, so that the
    caller's clean-up (``prepare_data`` deletes what it wrote) is not undone by it afterwards."""
    from flyte_hvd.data.store.bounded import bounded

    store = Store.create(str(tmp_path / "store"))
    target = tmp_path / "late.txt"

    def slow_write() -> None:
        time.sleep(0.5)
        target.write_text("written")

    waited = _interrupted(lambda: bounded(store, ("writing", "to"), str(target), 0, slow_write))
    assert target.read_text() == "written"  # before the interruption reached the caller
    assert 0.4 < waited < 2.5, waited


def test_an_interrupted_store_operation_that_hangs_is_waited_for_a_bounded_time(tmp_path):
    from flyte_hvd.data.store.bounded import INTERRUPTED_GRACE_S, bounded

    store = Store.create(str(tmp_path / "store"))
    release = threading.Event()
    try:
        waited = _interrupted(lambda: bounded(store, ("reading", "from"), "x", 0, release.wait, 60))
    finally:
        release.set()
    assert INTERRUPTED_GRACE_S - 0.5 < waited < INTERRUPTED_GRACE_S + 2.0, waited
