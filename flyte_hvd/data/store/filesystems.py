"""Which fsspec filesystem serves a URL: fsspec's own package for each protocol (s3fs, gcsfs,
adlfs...), an error naming the package and the flyte-hvd extra to install when it is missing,
and one naming the schemes there are when none serves it."""

from __future__ import annotations

import importlib
from typing import Any

import fsspec

from flyte_hvd.data.store.errors import brief
from flyte_hvd.data.store.paths import scheme_of

__all__ = ["filesystem_class", "fsspec_knows", "unknown_scheme", "url_to_fs"]

# The flyte-hvd extra that installs the fsspec package of a protocol (named in the error a
# missing package gives).
_PACKAGE_EXTRAS = {"gcsfs": "gcs", "adlfs": "azure"}


def url_to_fs(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec's ``url_to_fs``, with fsspec's own package for the URL's scheme (s3fs, gcsfs,
    adlfs...) even where another library registered its filesystem over it (as the Flyte 2
    SDK does with obstore's)."""
    if "::" in url:  # a chained URL (``simplecache::s3://...``): fsspec's own resolution
        return fsspec.core.url_to_fs(url, **storage_options)
    cls = filesystem_class(scheme_of(url) or "file", url)
    options = {**cls._get_kwargs_from_urls(url), **storage_options}
    return cls(**options), cls._strip_protocol(url)


def fsspec_knows(protocol: str) -> bool:
    """Whether fsspec has a filesystem for ``protocol`` (installed or not)."""
    from fsspec.registry import known_implementations, registry

    return protocol in registry or protocol in known_implementations


def filesystem_class(protocol: str, path: str) -> type[fsspec.AbstractFileSystem]:
    """fsspec's class for ``protocol``, or an error saying what to install or use (``path``
    is the ``prefix_path`` the messages name)."""
    from fsspec.registry import known_implementations

    if not fsspec_knows(protocol):
        raise ValueError(unknown_scheme(path, protocol))
    spec = known_implementations.get(protocol, {})
    try:
        if "class" in spec:
            # fsspec's own package for the scheme (gcsfs, adlfs...), even where another
            # library registered its filesystem over it (the Flyte 2 SDK puts obstore's over
            # s3, gs, abfs...): the Store's options, checks and atomic writes are that
            # package's.
            module, _, name = spec["class"].rpartition(".")
            return getattr(importlib.import_module(module), name)
        return fsspec.get_filesystem_class(protocol)
    except ImportError as error:
        raise _missing_package(protocol, path, spec, error) from error


def _missing_package(
    protocol: str, path: str, spec: dict[str, str], error: ImportError
) -> ImportError:
    # fsspec chains the import's own error, which names the missing module.
    missing = (
        getattr(error.__cause__, "name", None) or error.name or spec.get("class", "?").split(".")[0]
    )
    extra = _PACKAGE_EXTRAS.get(missing)
    install = (
        f"`pip install 'flyte-hvd[{extra}]'` or `pip install {missing}`"
        if extra
        else f"`pip install {missing}`"
    )
    return ImportError(
        f"`prefix_path`={path!r} uses the scheme `{protocol}`, which fsspec serves with "
        f"`{spec.get('class', '?')}`, but the package `{missing}` is not installed "
        f"(fsspec: {brief(error)}). Install it where the driver and the ranks run "
        f"({install}), or use another `prefix_path`.",
        name=missing,
    )


def unknown_scheme(path: str, scheme: str) -> str:
    """The message for a ``prefix_path`` whose scheme neither a Store class nor fsspec knows."""
    return (
        f"`prefix_path`={path!r} has the scheme `{scheme}`, which neither a flyte_hvd Store nor "
        f"fsspec handles; use a local path, file://, s3://, s3a://, hdfs://, dbfs:/ or "
        f"another protocol fsspec knows (`fsspec.available_protocols()`), or register one "
        f"with `fsspec.register_implementation`."
    )
