"""Bounded store operations: each operation on a store (a checkpoint upload, reading
``state.json``, ``Store.create``'s write check...) gets a time limit, so that a hung store fails
a run naming itself instead of hanging it, and an unreachable one says so."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

from flyte_hvd.data.store.errors import StoreTimeoutError, StoreUnreachableError, brief
from flyte_hvd.launch import stall

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SECONDS_PER_MIB",
    "TIMEOUT_ENV",
    "StoreLike",
    "bounded",
    "check_reachable",
    "describe",
    "store_timeout",
    "unreachable_error",
]

T = TypeVar("T")  # what a bounded store operation returns

# How long one store operation of the ranks (a checkpoint upload, reading state.json...) or of
# the driver (Store.create's check, the metadata) may take: a hung store must not hang a fit.
TIMEOUT_ENV = "FLYTE_HVD_STORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 50.0  # below the stall check time (60 s): the error comes first
# A transfer gets this much more per MiB moved: a large file on a slow link is not a hung store.
SECONDS_PER_MIB = 1.0
# How long an interrupted caller (Ctrl-C, SIGTERM) still waits for its store operation to end:
# the caller's clean-up comes next, and a write still in flight would undo it.
INTERRUPTED_GRACE_S = 3.0


class StoreLike(Protocol):
    """What the messages of a bounded operation need of a Store."""

    prefix_path: str

    def address(self) -> str:
        """Where the store's server is."""
        ...


def store_timeout(timeout: object = None) -> float:
    """A Store's ``timeout``: the argument, else ``FLYTE_HVD_STORE_TIMEOUT_S``, else 50 s."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r}: expected the seconds one store operation of the ranks "
                f"may take (> 0), e.g. 120."
            )
        return value
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (0 < timeout < float("inf"))
    ):
        raise ValueError(
            f"`timeout` must be the seconds one store operation of the ranks may take (> 0), "
            f"e.g. 120; found {timeout!r}."
        )
    return float(timeout)


def describe(store: StoreLike, verb: tuple[str, str], path: str) -> str:
    """What a store operation does, for messages: "uploading runs/r/x to s3://bucket/exp"."""
    prefix = store.prefix_path
    rel = path[len(prefix) :].lstrip("/") if path.startswith(prefix) else path
    return f"{verb[0]} {rel} {verb[1]} {prefix}"


def unreachable_error(
    store: StoreLike, verb: tuple[str, str], path: str, error: BaseException
) -> StoreUnreachableError:
    """The error of an operation that could not reach the store, naming the operation."""
    return StoreUnreachableError(
        f"cannot reach the store at `{store.prefix_path}` while {describe(store, verb, path)}: "
        f"{brief(error)}. Check that the store is up and reachable from every executor "
        f"({store.address()})."
    )


def check_reachable(store: StoreLike, endpoint: str, path: str, timeout: float) -> None:
    """One connection to ``endpoint`` (a URL), or a ``StoreUnreachableError`` naming it."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=min(5.0, timeout)).close()
    except OSError as error:
        raise unreachable_error(store, ("writing", "to"), path, error) from None


def bounded(
    store: StoreLike,
    verb: tuple[str, str],
    path: str,
    size: int,
    fn: Callable[..., T],
    *args: object,
) -> T:
    """``fn(*args)`` (one operation on ``store``, on ``path``) in a thread of its own, waited
    for up to the Store's timeout (plus ``SECONDS_PER_MIB`` per MiB of ``size``): on the
    driver (``Store.create``'s check, ``prepare_data``'s metadata) as on the ranks
    (``RemoteStore``). A hung store leaves that thread blocked, and the caller gets a
    ``StoreTimeoutError`` naming the operation, the store and the setting. Interrupted while
    it waits, it waits up to ``INTERRUPTED_GRACE_S`` more for the operation to end before the
    interruption goes on, so that the caller's clean-up of what it wrote comes after it."""
    doing = describe(store, verb, path)
    base = getattr(store, "timeout", DEFAULT_TIMEOUT_S)
    limit = base + SECONDS_PER_MIB * size / (1 << 20)
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:
            outcome["error"] = error
        finally:
            done.set()

    with stall.activity(doing):
        try:
            threading.Thread(target=call, name="flyte-hvd-store", daemon=True).start()
            finished = done.wait(limit)
        except BaseException:  # interrupted: the operation ends (briefly waited) before we do
            done.wait(min(limit, INTERRUPTED_GRACE_S))
            raise
    if not finished:
        raise StoreTimeoutError(
            f"{doing} did not finish within {round(limit, 1):g}s: the store does not answer "
            f"({store.address()}). Check that it is up and reachable from every executor; "
            f"if the link is that slow, raise the Store's `timeout` or {TIMEOUT_ENV} "
            f"(now {base:g}s, plus {SECONDS_PER_MIB:g}s per MiB moved)."
        )
    error = outcome.get("error")
    if error is not None:
        raise error
    return outcome["value"]  # type: ignore[no-any-return]  # fn's own result
