"""What a Store raises and how it words a failure: the two errors of a store that does not
answer, the brief form of a library's exception, and the one-time warnings of arguments that
do nothing here."""

from __future__ import annotations

from flyte_hvd.core.errors import ExplainedError
from flyte_hvd.core.log import get_logger, warn_once

__all__ = [
    "StoreTimeoutError",
    "StoreUnreachableError",
    "brief",
    "explain_write_error",
    "is_unreachable",
    "warn_once_about",
]

# Every module of the package logs as the Store always has, under one name.
logger = get_logger("flyte_hvd.data.store")

# What exceptions of botocore, aiohttp and fsspec are called when the store cannot be reached.
_UNREACHABLE_ERRORS = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "FSTimeoutError",
    }
)


class StoreTimeoutError(ExplainedError):
    """A store operation of a rank did not finish in time (``FLYTE_HVD_STORE_TIMEOUT_S`` or the
    Store's ``timeout``)."""


class StoreUnreachableError(ExplainedError):
    """A store operation of a rank could not reach the store (connection refused, reset...)."""


def warn_once_about(key: str, message: str) -> None:
    """``message`` at WARNING, once per process and ``key`` (e.g. ``"HDFSStore.driver"``)."""
    warn_once(logger, f"store:{key}", message)


def brief(error: BaseException, limit: int = 300) -> str:
    """The exception's type and first line (pyarrow's can list a hundred search paths)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def explain_write_error(error: BaseException) -> str:
    """Why a Store could not be written, in general terms: permission, or the path itself
    (a backend that knows more says more)."""
    if isinstance(error, PermissionError):
        return (
            f"permission denied ({brief(error)}). Make the directory writable for this "
            f"user or pick another `prefix_path`."
        )
    return f"{brief(error)}. Check that the path is correct and reachable."


def is_unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) says the store could not be reached."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = {c.__name__ for c in type(current).__mro__}
        if isinstance(current, ConnectionError | TimeoutError) or names & _UNREACHABLE_ERRORS:
            return True
        current = current.__cause__ or current.__context__
    return False
