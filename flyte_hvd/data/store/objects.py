"""Object stores and other fsspec filesystems: ``S3Store`` (s3fs; S3 and S3-compatible
endpoints) and ``FilesystemStore`` (any protocol fsspec knows: ``gs://``, ``abfs://``,
``sftp://``...), with what their errors tell a user of each cloud. An object store publishes
a file with its single upload; the others write a temporary beside it and rename it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import fsspec

from flyte_hvd.data.store.base import Store
from flyte_hvd.data.store.errors import brief, explain_write_error
from flyte_hvd.data.store.filesystems import filesystem_class, fsspec_knows
from flyte_hvd.data.store.paths import check_path, scheme_of

__all__ = ["FilesystemStore", "S3Store"]

# Protocols whose single PUT publishes an object atomically and that have no real directories.
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "oss"})


@dataclass(frozen=True)
class _CloudHelp:
    """What a FilesystemStore's errors tell a user of one object store."""

    bucket: str  # what the first path segment is called there
    credentials: str
    endpoint: str


_GCS_HELP = _CloudHelp(
    bucket="bucket",
    credentials="`storage_options` 'token' (a service-account JSON file, 'google_default', "
    "'cloud' or 'anon') or GOOGLE_APPLICATION_CREDENTIALS",
    endpoint="`storage_options` 'endpoint_url' or STORAGE_EMULATOR_HOST",
)
_AZURE_HELP = _CloudHelp(
    bucket="container",
    credentials="`storage_options` 'connection_string', or 'account_name' with 'account_key', "
    "'sas_token' or a service principal, or AZURE_STORAGE_CONNECTION_STRING / "
    "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY",
    endpoint="`storage_options` 'account_host', or the connection string's BlobEndpoint",
)
_CLOUD_HELP = {
    "gs": _GCS_HELP,
    "gcs": _GCS_HELP,
    "abfs": _AZURE_HELP,
    "abfss": _AZURE_HELP,
    "az": _AZURE_HELP,
}


class S3Store(Store):
    """Amazon S3 or any S3-compatible endpoint, through s3fs.

    Credentials and endpoint come from ``storage_options`` (``key``, ``secret``, ``token``,
    ``endpoint_url``, ``client_kwargs``) or the usual AWS environment variables
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, profiles,
    instance roles). Spark writes prepared data itself only when the cluster has the S3A
    connector (``s3a://``); otherwise ``prepare_data`` uploads it through s3fs.
    """

    schemes: ClassVar[tuple[str, ...]] = ("s3", "s3a")
    publish_by_rename = False  # an S3 object appears only when its upload completes

    def normalize(self, path: str) -> str:
        return str(path).rstrip("/")

    def fs_path(self, path: str) -> str:
        return self.normalize(path).split("://", 1)[-1]

    def spark_url(self, path: str) -> str:
        return "s3a://" + self.fs_path(path)

    def _full_url(self, path: str) -> str:
        path = self.normalize(path)
        if "://" in path:
            return path
        scheme = scheme_of(self.prefix_path) or "s3"  # the prefix's own: s3 or s3a
        return f"{scheme}://{path.lstrip('/')}"

    @property
    def bucket(self) -> str:
        return self.fs_path(self.prefix_path).split("/", 1)[0]

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        import s3fs

        options = dict(self.storage_options)
        # s3fs's limits per request (5 s to connect, 15 s without an answer; then it retries),
        # never longer than a whole operation may take; `config_kwargs` given win.
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", min(5.0, self.timeout))
        config.setdefault("read_timeout", min(15.0, self.timeout))
        options["config_kwargs"] = config
        # A fresh instance: fsspec's instance cache would keep credentials from an older
        # environment.
        return s3fs.S3FileSystem(skip_instance_cache=True, **options)

    def address(self) -> str:
        endpoint = self.storage_options.get("endpoint_url") or (
            self.storage_options.get("client_kwargs") or {}
        ).get("endpoint_url")
        endpoint = (
            endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        where = f"endpoint {endpoint}" if endpoint else "AWS's endpoint for the bucket's region"
        return (
            f"{where}; it is `endpoint_url` in `storage_options`, or AWS_ENDPOINT_URL where the "
            f"ranks run"
        )

    def _makedirs(self, path: str) -> None:
        pass  # S3 has no directories; a missing bucket shows up on the first write

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:  # one PUT with If-None-Match: * (S3 answers 412 when the key exists)
            self.fs.pipe_file(self.fs_path(path), data, mode="create")
        except FileExistsError:
            return False
        return True

    def _explain(self, error: Exception) -> str:
        if type(error).__name__ == "NoCredentialsError":  # botocore's: nothing to sign with
            return (
                f"no AWS credentials were found ({brief(error)}). Give them in "
                f"`storage_options` ('key' and 'secret', or 'profile'), or set "
                f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance "
                f"role) where the driver and the executors run; for a public bucket, "
                f"storage_options={{'anon': True}}."
            )
        if isinstance(error, FileNotFoundError):
            return (
                f"the bucket `{self.bucket}` does not exist or is not visible with these "
                f"credentials ({brief(error)}). Create it or fix `prefix_path`."
            )
        if isinstance(error, PermissionError):
            return (
                f"access denied ({brief(error)}). Check the credentials (`storage_options` "
                f"'key'/'secret', or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), the endpoint "
                f"(`endpoint_url` or AWS_ENDPOINT_URL) and the bucket's policy."
            )
        return explain_write_error(error)


class FilesystemStore(Store):
    """A Store on any filesystem fsspec knows: ``gs://`` (gcsfs), ``abfs://`` (adlfs),
    ``sftp://``... and local paths (``file://``). ``Store.create`` picks it for protocols
    without a class of their own; it refuses ``memory://``, whose files only this process sees
    (the class itself accepts it, for tests in one process).

    The filesystem is built as fsspec builds it for the URL (options the URL carries, such
    as a user or host), updated with ``storage_options`` (credentials, endpoint...). Paths
    are kept as URLs (``memory://exp/runs``); ``get_localized_path`` gives the filesystem's
    form. Object stores (gs, abfs...) publish a file with one upload, others write a
    temporary beside the target and rename it.

    Google Cloud Storage takes ``token`` (a service-account JSON file, 'google_default',
    'anon'...), ``project`` and ``endpoint_url``, or GOOGLE_APPLICATION_CREDENTIALS and
    STORAGE_EMULATOR_HOST; Azure takes ``connection_string``, or ``account_name`` with
    ``account_key`` or ``sas_token``, or the AZURE_STORAGE_* variables. ``Store.create``
    names a missing bucket or container and the credentials to check.

    Args:
        prefix_path: the store's root URL.
        train_path: as for ``Store``.
        val_path: as for ``Store``.
        test_path: as for ``Store``.
        runs_path: as for ``Store``.
        save_runs: as for ``Store``.
        storage_options: as for ``Store``.
        checkpoint_filename: as for ``Store``.
        temp_dir: as for ``Store``.
        timeout: as for ``Store``.
        **kwargs: as for ``Store``.

    Raises:
        ValueError: fsspec does not know the scheme.
        ImportError: fsspec knows it but the package serving it is not installed (the
            message names the package, and its flyte-hvd extra where there is one).
    """

    def __init__(
        self,
        prefix_path: str,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        runs_path: str | None = None,
        save_runs: bool = True,
        storage_options: dict[str, Any] | None = None,  # fsspec's options for the filesystem
        checkpoint_filename: str | None = None,
        temp_dir: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        **kwargs: Any,  # ``Store``'s other arguments, passed on
    ):
        path = check_path("prefix_path", prefix_path)
        self.protocol = scheme_of(path) or "file"
        self._given_prefix = path  # for messages; normalizing needs the class below
        filesystem_class(self.protocol, path)  # fail now, naming the package to install
        super().__init__(
            path,
            train_path=train_path,
            val_path=val_path,
            test_path=test_path,
            runs_path=runs_path,
            save_runs=save_runs,
            storage_options=storage_options,
            checkpoint_filename=checkpoint_filename,
            temp_dir=temp_dir,
            timeout=timeout,
            **kwargs,
        )

    @classmethod
    def matches(cls, path: str) -> bool:
        """Whether fsspec knows ``path``'s protocol (a path without one is local); Horovod's
        matches everything, but a scheme nothing serves is better refused at creation."""
        return fsspec_knows(scheme_of(check_path("path", path)) or "file")

    def _fs_class(self) -> type[fsspec.AbstractFileSystem]:
        return filesystem_class(self.protocol, self._given_prefix)

    def _own_schemes(self) -> tuple[str, ...]:
        protocols = self._fs_class().protocol
        return (self.protocol, *((protocols,) if isinstance(protocols, str) else protocols))

    def normalize(self, path: str) -> str:
        path = str(path)
        scheme = scheme_of(path)
        if not scheme:
            path = f"{self.protocol}://{self._fs_class()._strip_protocol(path)}"
        elif scheme not in self._own_schemes():
            raise ValueError(
                f"`{path}` has the scheme `{scheme}`, but this FilesystemStore reads and writes "
                f"through `{self.protocol}://`; give paths on that filesystem (or without a "
                f"scheme)."
            )
        head, _, tail = path.partition("://")
        return f"{head}://{tail.rstrip('/') or '/'}"

    def fs_path(self, path: str) -> str:
        return self._fs_class()._strip_protocol(self.normalize(path))

    def spark_url(self, path: str) -> str:
        return self.normalize(path)

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        cls = self._fs_class()
        options = cls._get_kwargs_from_urls(self.prefix_path)
        options.update(self.storage_options)
        # A fresh instance: fsspec's cache would share one (and its credentials) across stores.
        return cls(skip_instance_cache=True, **options)

    def upload_file(self, local_path: str, remote_path: str) -> None:
        if self.protocol in _OBJECT_STORE_PROTOCOLS:
            # The object appears only once its upload completes: no temporary needed.
            self.fs.put_file(local_path, self.fs_path(remote_path))
            return
        super().upload_file(local_path, remote_path)

    def _makedirs(self, path: str) -> None:
        # Object stores have no directories (nor buckets) to make.
        if path and self.protocol not in _OBJECT_STORE_PROTOCOLS:
            self.fs.makedirs(path, exist_ok=True)

    def _replace(self, tmp: str, target: str) -> None:
        try:
            self.fs.mv(tmp, target)
        except OSError:
            # Some filesystems (sftp, hdfs-like) refuse to rename over an existing file.
            if not self.fs.exists(target):
                raise
            self.fs.rm(target)
            self.fs.mv(tmp, target)

    @property
    def bucket(self) -> str:
        """The bucket (Google Cloud Storage) or container (Azure) of ``prefix_path``."""
        return self.fs_path(self.prefix_path).lstrip("/").split("/", 1)[0]

    def _explain(self, error: Exception) -> str:
        cloud = _CLOUD_HELP.get(self.protocol)
        if cloud is not None:
            if _is_missing_bucket(error):
                return (
                    f"the {cloud.bucket} `{self.bucket}` does not exist or is not visible with "
                    f"these credentials ({brief(error)}). Create it or fix `prefix_path`."
                )
            if _is_access_denied(error):
                return (
                    f"access denied ({brief(error)}). Check the credentials "
                    f"({cloud.credentials}), the endpoint ({cloud.endpoint}) and the "
                    f"{cloud.bucket}'s permissions."
                )
        if isinstance(error, PermissionError):
            return explain_write_error(error)
        return (
            f"{brief(error)}. Check the path, the `storage_options` (credentials, endpoint) "
            f"and that the `{self.protocol}://` filesystem is reachable."
        )

    def _endpoint(self) -> str | None:
        if self.protocol not in ("gs", "gcs") or "session_kwargs" in self.storage_options:
            return None  # (a session of the user's own may go through a proxy)
        given = self.storage_options.get("endpoint_url")
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if not given and emulator not in ("", "default"):  # as gcsfs reads it
            given = emulator if "://" in emulator else f"http://{emulator}"
        return str(given or "https://storage.googleapis.com")

    def address(self) -> str:
        endpoint = self._endpoint()
        if endpoint is None:
            return super().address()
        return (
            f"endpoint {endpoint}; it is `endpoint_url` in `storage_options`, or "
            f"STORAGE_EMULATOR_HOST where the ranks run"
        )

    def _check_shared(self) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        if issubclass(self._fs_class(), MemoryFileSystem):
            raise ValueError(
                f"`{self.prefix_path}` is on fsspec's in-memory filesystem ({self.protocol}://), "
                f"whose files live inside this Python process only: the ranks and Spark's "
                f"executors are other processes and would not see them. Use a folder every "
                f"process can reach (a local path on one machine, e.g. '/tmp/flyte-hvd'; a "
                f"shared mount) or an object store (s3://, gs://, abfs://, hdfs://)."
            )

    def _connect(self) -> None:
        fs = self.fs
        # gcsfs retries a request whose access token cannot be had 6 times (about 30 s) before
        # it gives up; asking for the token first fails at once with the token server's answer
        # (a revoked key, a bad signature...). Anonymous access has none to ask for.
        refresh = getattr(getattr(fs, "credentials", None), "maybe_refresh", None)
        if self.protocol in ("gs", "gcs") and callable(refresh):
            refresh()

    def _explain_open(self, error: Exception) -> str:
        cloud = _CLOUD_HELP.get(self.protocol)
        cause = error.__cause__
        said = brief(error) + (f"; {brief(cause)}" if cause is not None else "")
        hint = (
            f"the credentials ({cloud.credentials}) and the endpoint ({cloud.endpoint})"
            if cloud is not None
            else "the `storage_options` (credentials, endpoint)"
        )
        return (
            f"`{self._fs_class().__module__.split('.')[0]}` could not sign in with these "
            f"`storage_options` ({said}). Check {hint}."
        )


def _is_missing_bucket(error: BaseException) -> bool:
    """A write failed because the bucket or container is not there: gcsfs says
    FileNotFoundError, adlfs passes on Azure's ``ContainerNotFound``."""
    return isinstance(error, FileNotFoundError) or (
        getattr(error, "error_code", None) == "ContainerNotFound"
    )


def _is_access_denied(error: BaseException) -> bool:
    """A request was refused for its credentials: an HTTP 401/403 (Azure's errors carry
    ``status_code``, gcsfs's ``HttpError`` ``code``; gcsfs raises a plain OSError
    'Forbidden' for a 403)."""
    status = getattr(error, "status_code", None) or getattr(error, "code", None)
    return (
        isinstance(error, PermissionError)
        or status in (401, 403)
        or str(error).startswith("Forbidden")
    )
