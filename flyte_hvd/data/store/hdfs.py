"""``HDFSStore``: HDFS through pyarrow's ``HadoopFileSystem`` (libhdfs), with Horovod's
constructor arguments."""

from __future__ import annotations

import os
from typing import Any, ClassVar
from urllib.parse import urlparse

import fsspec

from flyte_hvd.data.parquet import FileSystem
from flyte_hvd.data.store.base import Store
from flyte_hvd.data.store.errors import brief, warn_once_about
from flyte_hvd.data.store.paths import check_path, scheme_of

__all__ = ["HDFSStore"]


class HDFSStore(Store):
    """HDFS through pyarrow's ``HadoopFileSystem`` (needs libhdfs, ``JAVA_HOME`` and the
    Hadoop ``CLASSPATH`` on every host). ``prefix_path`` is ``hdfs://host:port/path``,
    ``hdfs:///path`` (the default namenode) or ``/path`` (taken as ``hdfs:///path``).

    HDFS cannot rename over an existing file, so a replace deletes the old file just before
    the rename: a crash in that instant leaves the finished temporary beside the target.

    Args:
        prefix_path: where the store lives on HDFS.
        host: the namenode to connect to; default: the URL's, else ``default`` (the
            cluster's configured default). Paths keep the URL's host and port.
        port: the namenode's port; default: the URL's, else 0.
        user: the HDFS user to act as.
        kerb_ticket: path of the Kerberos ticket cache.
        driver: accepted for Horovod's signature; pyarrow always uses libhdfs (JNI), so any
            other value is ignored with a warning.
        extra_conf: extra Hadoop configuration (``{"dfs.replication": "2"}``...).
        temp_dir: local folder for temporary files (see ``Store``).
        *args: ``Store``'s arguments, after these.
        **kwargs: ``Store``'s arguments (``train_path``..., ``storage_options``, also passed
            to pyarrow's ``HadoopFileSystem``).

    Raises:
        ValueError: ``prefix_path`` is not an HDFS path, or ``port`` is not an integer.
    """

    schemes: ClassVar[tuple[str, ...]] = ("hdfs",)

    def __init__(
        self,
        prefix_path: str,
        host: str | None = None,
        port: int | None = None,
        user: str | None = None,
        kerb_ticket: str | None = None,
        driver: str = "libhdfs",
        extra_conf: dict[str, str] | None = None,
        temp_dir: str | os.PathLike[str] | None = None,
        *args: Any,  # ``Store``'s arguments, passed on
        **kwargs: Any,  # ``Store``'s arguments, passed on
    ):
        path = check_path("prefix_path", prefix_path)
        scheme = scheme_of(path)
        if scheme not in ("", "hdfs"):
            raise ValueError(
                f"`prefix_path`={path!r} has the scheme `{scheme}`; `HDFSStore` expects "
                f"`hdfs://host:port/path`, `hdfs:///path` or `/path`. Use `Store.create` to get "
                f"the store for another scheme."
            )
        # What bare absolute paths are prefixed with: the URL's scheme, host and port.
        self._url_prefix = "hdfs://" + (urlparse(path).netloc if scheme else "")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
            raise ValueError(f"`port` must be an integer such as 8020; found {port!r}.")
        if extra_conf is not None and not isinstance(extra_conf, dict):
            raise ValueError(
                f"`extra_conf` must be a dict of Hadoop settings; found "
                f"{type(extra_conf).__name__}."
            )
        if driver != "libhdfs":
            warn_once_about(
                "HDFSStore.driver",
                f"`HDFSStore` got `driver`={driver!r}, which is accepted for Horovod "
                f"compatibility and does nothing here: pyarrow's HadoopFileSystem always uses "
                f"libhdfs.",
            )
        self._host_arg = host
        self._port_arg = port
        self._hdfs_options = {
            k: v
            for k, v in (("user", user), ("kerb_ticket", kerb_ticket), ("extra_conf", extra_conf))
            if v is not None
        }
        if len(args) > 7:
            raise TypeError(
                f"`HDFSStore` takes at most 7 positional arguments after `temp_dir` (`train_path` "
                f"... `checkpoint_filename`); found {len(args)}. Pass the others by keyword."
            )
        super().__init__(path, *args, **{**kwargs, "temp_dir": temp_dir})

    def normalize(self, path: str) -> str:
        path = str(path)
        scheme = scheme_of(path)
        if not scheme:
            if not path.startswith("/"):
                raise ValueError(
                    f"`{path}` is not an HDFS path: expected `hdfs://host:port/path`, "
                    f"`hdfs:///path` or an absolute path such as `/user/me/exp`."
                )
            path = self._url_prefix + path
        elif scheme != "hdfs":
            raise ValueError(
                f"`{path}` has the scheme `{scheme}`; this `HDFSStore` takes `hdfs://` URLs "
                f"or absolute paths."
            )
        return path.rstrip("/")

    def fs_path(self, path: str) -> str:
        return urlparse(self.normalize(path)).path or "/"

    @property
    def host(self) -> str:
        return self._host_arg or urlparse(self.prefix_path).hostname or "default"

    @property
    def port(self) -> int:
        return self._port_arg or urlparse(self.prefix_path).port or 0

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        from fsspec.implementations.arrow import HadoopFileSystem

        # The constructor's user/kerb_ticket/extra_conf win over the same storage_options.
        options = {**self.storage_options, **self._hdfs_options}
        return HadoopFileSystem(host=self.host, port=self.port, **options)

    @property
    def arrow_filesystem(self) -> FileSystem:
        return self.fs.fs  # the pyarrow filesystem under fsspec's wrapper

    def _replace(self, tmp: str, target: str) -> None:
        if self.fs.exists(target):
            self.fs.rm(target)
        self.fs.mv(tmp, target)

    def _explain(self, error: Exception) -> str:
        return (
            f"{brief(error)}. HDFSStore needs libhdfs (ARROW_LIBHDFS_DIR or "
            f"HADOOP_HOME), JAVA_HOME and the Hadoop CLASSPATH, and a reachable namenode at "
            f"`{self.host}:{self.port or 'default port'}`."
        )
