"""A lease in a Store: a small JSON file saying that a live process owns something there (a
fit's run, a dataset being written), renewed while it works and removed when it is done.

Another process reads it to tell a live owner from a dead one: a lease not renewed for
``LEASE_SECONDS`` is stale (its owner is gone, or cut off from the store), and so is one whose
process is gone from this host (same boot and pid namespace), and, inside Flyte, one held by an
earlier attempt of the same task (Flyte starts the next attempt only once that one ended).
Every Store call here is ``bounded`` by the Store's timeout: a store that stops answering
fails the caller, naming the call, instead of hanging it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from flyte_hvd.core.log import get_logger
from flyte_hvd.data.store import DEFAULT_TIMEOUT_S, bounded
from flyte_hvd.launch import task_identity

if TYPE_CHECKING:
    from flyte_hvd.data.store import Store

logger = get_logger(__name__)

T = TypeVar("T")  # what a bounded Store call returns

# A lease not renewed for this long is stale: its owner is gone (or cut off).
LEASE_SECONDS = 60.0


def pid_space() -> str | None:
    """This machine's process-id space (boot id and pid namespace): a lease's pid can be
    checked only where it is the same. None where the system does not say (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid space runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def current_attempt() -> dict | None:
    """The Flyte task attempt this process runs (``stale``'s ``flyte``); None outside Flyte."""
    identity = task_identity.current()
    return identity.as_record() if identity else None


def stale(lease: dict, flyte: dict | None = None) -> str | None:
    """Why ``lease`` no longer protects a live owner, as a phrase (None: it does). ``flyte``:
    the Flyte task attempt that asks; an earlier attempt of the same execution and node has
    ended (Flyte starts the next attempt only then)."""
    expires = lease.get("expires")
    if not isinstance(expires, int | float):
        return "is unreadable"
    now = time.time()
    if now > expires:
        return f"expired {now - expires:.0f}s ago"
    pid = lease.get("pid")
    space = pid_space()
    same_machine = space is not None and lease.get("pid_space") == space
    alive = not same_machine or not isinstance(pid, int) or process_alive(pid)
    if not alive:
        return f"is no longer running (process {pid} is gone)"
    held = lease.get("flyte")
    if (
        flyte is not None
        and not same_machine  # a process seen alive here holds it, whatever it claims
        and isinstance(held, dict)
        and held.get("execution") == flyte["execution"]
        and held.get("node") == flyte["node"]
        and isinstance(held.get("attempt"), int)
        and held["attempt"] < flyte["attempt"]
    ):
        return (
            f"was attempt {held['attempt']} of this Flyte task (execution "
            f"{flyte['execution']}), which ended; this is attempt {flyte['attempt']}"
        )
    return None


class StoreLease:
    """The lease at ``path`` of ``store``, held by this process from ``try_acquire`` to
    ``release``; ``label`` names what it protects in log lines (``run `r1```)."""

    def __init__(self, store: Store, path: str, label: str):
        self.store, self.path, self.label = store, path, label
        self.token = secrets.token_hex(8)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.started = time.time()
        self.flyte = current_attempt()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_space": pid_space(),
                "token": self.token,
                "started": self.started,
                "renewed": now,
                "expires": now + LEASE_SECONDS,
                "flyte": self.flyte,
            }
        ).encode()

    def _call(self, verb: tuple[str, str], fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, one Store call on the lease, within the Store's timeout."""
        return bounded(self.store, verb, self.path, 0, fn, *args)

    def read(self) -> dict | None:
        """The lease in the store (None: none; ``{}``: unreadable)."""
        return read_lease(self.store, self.path)

    def held(self) -> bool:
        """Whether the lease in the store is still this one (not taken over as stale)."""
        return (self.read() or {}).get("token") == self.token

    def try_acquire(self) -> bool:
        """Take the lease if no live owner holds it (taking over a stale one, with a warning);
        False when another live one holds it."""
        for _ in range(3):  # a stale lease removed, then another process may win the create
            if self._call(
                ("writing", "to"), self.store.create_exclusive, self.path, self._record()
            ):
                self._start_renewing()
                return True
            held = self.read()
            if held is None:
                continue  # released meanwhile
            why = stale(held, self.flyte)
            if why is None:
                return False
            logger.warning(
                "%s: taking over the lease of %s, which %s",
                self.label,
                held.get("owner", "an unknown owner"),
                why,
            )
            self._call(("deleting", "from"), self.store.delete, self.path)
        return False

    def _start_renewing(self) -> None:
        self._renewer = threading.Thread(
            target=self._renew, name=f"flyte-hvd-lease-{self.token}", daemon=True
        )
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 3):
            try:
                held = self.read()
                if not held or held.get("token") != self.token:
                    logger.warning(
                        "%s: another process (%s) took over its lease `%s`; it is no longer "
                        "renewed",
                        self.label,
                        (held or {}).get("owner", "unknown"),
                        self.path,
                    )
                    return
                self._call(("writing", "to"), self.store.write_bytes, self.path, self._record())
            except Exception as error:  # a store hiccup: the next renewal tries again
                logger.warning("%s: cannot renew its lease `%s`: %s", self.label, self.path, error)

    def release(self) -> None:
        """Stop renewing and remove the lease, if it is still this one. Bounded by the Store's
        timeout: a store that does not answer (the owner may be failing for that very reason)
        leaves the lease to expire by itself."""
        self._stop.set()
        limit = float(getattr(self.store, "timeout", DEFAULT_TIMEOUT_S))
        if self._renewer is not None:
            self._renewer.join(limit)
        remover = threading.Thread(
            target=self._remove, name=f"flyte-hvd-lease-{self.token}-release", daemon=True
        )
        remover.start()
        remover.join(limit)
        if remover.is_alive():
            logger.warning(
                "%s: its lease `%s` could not be removed within %gs (the store does not "
                "answer); it expires by itself %ds after its last renewal",
                self.label,
                self.path,
                limit,
                LEASE_SECONDS,
            )

    def _remove(self) -> None:
        with contextlib.suppress(Exception):  # the owner's own error matters more
            if self.held():
                self._call(("deleting", "from"), self.store.delete, self.path)


def read_lease(store: Store, path: str) -> dict | None:
    """The lease at ``path`` (None: none; ``{}``: unreadable), read within the Store's
    timeout."""
    try:
        text = bounded(store, ("reading", "from"), path, 0, store.read, path)
        record = json.loads(text)
    except FileNotFoundError:
        return None
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
