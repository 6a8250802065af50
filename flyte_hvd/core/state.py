"""Process-wide Horovod state: the communicator, this rank's place in it, and its hosts.

``init()`` takes, in order: the communicator passed in, the one a flyte-hvd launcher built for
this process (``flyte-hvd-run``, ``flyte_hvd.spark.run``), or ``MPI.COMM_WORLD`` (plain
``mpiexec -n N`` or a single process).
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flyte_hvd.core import timeline

if TYPE_CHECKING:
    from mpi4py import MPI

HOSTNAME_ENV = "FLYTE_HVD_HOSTNAME"
# "0" skips the argument check before each collective (one exchange of small records over
# MPI, a few us on two local ranks); mismatched calls then behave as in raw MPI: they hang
# or corrupt memory.
CHECK_ENV = "FLYTE_HVD_CHECK_COLLECTIVES"
# Where reductions of ranks on one host go: "auto" (shared memory when every rank of the
# communicator is on this host), "on" (the same, an error where it cannot), "off" (MPI).
SHM_ENV = "FLYTE_HVD_SHM_COLLECTIVES"
SHM_MODES = ("auto", "on", "off")
HIERARCHICAL_ENV = "HOROVOD_HIERARCHICAL_ALLREDUCE"
# Bytes of a call's data that ride in the agreement's own message over MPI (the MPI
# transport's records): a collective that small takes one round between hosts, not two.
EAGER_ENV = "FLYTE_HVD_EAGER_BYTES"
EAGER_DEFAULT = 256 << 10


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool

    @classmethod
    def from_hosts(cls, hosts: list[str], rank: int) -> Topology:
        """Place ``rank`` given every rank's host name (index = rank).

        ``local_*`` count ranks on the same host; ``cross_*`` count ranks that share this
        rank's ``local_rank`` across hosts (Horovod's definitions).
        """
        local_ranks = []
        seen: dict[str, int] = {}
        for host in hosts:
            local_ranks.append(seen.get(host, 0))
            seen[host] = seen.get(host, 0) + 1
        my_host, my_local = hosts[rank], local_ranks[rank]
        peers = [r for r, lr in enumerate(local_ranks) if lr == my_local]
        return cls(
            rank=rank,
            size=len(hosts),
            local_rank=my_local,
            local_size=seen[my_host],
            cross_rank=peers.index(rank),
            cross_size=len(peers),
            homogeneous=len(set(seen.values())) == 1,
        )


def host_name() -> str:
    """This process's host name; overridable so tests can fake hosts."""
    return os.environ.get(HOSTNAME_ENV) or socket.gethostname()


def host_hash(salt: str | None = None) -> str:
    """What ranks are grouped into hosts by (``local_rank``, ``local_size``): the host name,
    and ``CONTAINER_ID`` where it is set, since containers that share a host name (YARN's,
    Docker's with the host's network) share no memory. ``salt`` gives another key for the
    same host."""
    parts = [host_name(), os.environ.get("CONTAINER_ID", ""), salt or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class _State:
    comm: MPI.Comm | None = None
    async_comm: MPI.Comm | None = (
        None  # the background thread's duplicate (``*_async``, optimizers)
    )
    topology: Topology | None = None
    owns_comm: bool = False
    launcher_comm: MPI.Comm | None = None
    check_collectives: bool = True
    shm_mode: str = "auto"
    hierarchical: bool = True
    eager_bytes: int = EAGER_DEFAULT


_state = _State()


def set_launcher_comm(comm: MPI.Comm) -> None:
    """Called by the rank bootstrap: the communicator that ``init()`` picks up by default."""
    _state.launcher_comm = comm


def init(comm: MPI.Comm | None = None) -> None:
    """Initialize Horovod for this process. Calling it again is a no-op, as in Horovod."""
    if _state.comm is not None:
        return
    from mpi4py import MPI

    shm_mode = _shm_mode()  # a bad value fails here, not in the first collective
    hierarchical = _hierarchical()
    eager = _eager_bytes()
    if comm is None:
        comm = _state.launcher_comm if _state.launcher_comm is not None else MPI.COMM_WORLD
    elif not isinstance(comm, MPI.Comm):
        raise ValueError(
            f"`init(comm=...)` expects an mpi4py communicator (mpi4py.MPI.Comm); "
            f"found {type(comm).__name__}. Pass e.g. MPI.COMM_WORLD, or nothing."
        )
    # A private duplicate keeps our collectives from matching the user's own messages.
    own = comm.Dup()
    hosts = own.allgather(host_hash())
    _state.comm = own
    # Made here, while every rank is in init(): a rank that has joined must be able to serve
    # the others' background collectives on it (see ``collectives.join``).
    _state.async_comm = own.Dup()
    _state.owns_comm = True
    _state.topology = Topology.from_hosts(hosts, own.Get_rank())
    # Read once here: an environment lookup per call costs a tenth of a small reduction.
    _state.check_collectives = os.environ.get(CHECK_ENV, "1") != "0"
    _state.shm_mode = shm_mode
    _state.hierarchical = hierarchical
    _state.eager_bytes = eager
    timeline.start_from_env(own.Get_rank())


# What modules above the state release on shutdown (the background thread, process sets),
# registered by them so that the state imports neither.
_shutdown_hooks: list[tuple[int, Callable[[], None]]] = []


def on_shutdown(hook: Callable[[], None], order: int) -> None:
    """Run ``hook`` at ``shutdown()``, before the communicator is freed; lower ``order``
    first."""
    if all(h is not hook for _, h in _shutdown_hooks):
        _shutdown_hooks.append((order, hook))


def shutdown() -> None:
    """Release the communicator; ``init()`` may be called again afterwards."""
    if _state.comm is None:
        return
    timeline.stop(_state.comm)
    for _, hook in sorted(_shutdown_hooks, key=lambda h: h[0]):
        hook()
    assert _state.async_comm is not None  # init() sets both communicators
    _state.async_comm.Free()
    _state.async_comm = None
    if _state.owns_comm:
        _state.comm.Free()
    _state.comm = None
    _state.topology = None


def checks_collectives() -> bool:
    return _state.check_collectives


def _shm_mode() -> str:
    raw = os.environ.get(SHM_ENV, "auto").strip().lower() or "auto"
    if raw not in SHM_MODES:
        raise ValueError(
            f"{SHM_ENV}={raw!r}: expected one of {', '.join(SHM_MODES)} (auto: shared memory "
            f"when all ranks of a communicator share a host)."
        )
    return raw


def _hierarchical() -> bool:
    raw = os.environ.get(HIERARCHICAL_ENV, "1").strip().lower() or "1"
    if raw not in ("0", "1", "true", "false"):
        raise ValueError(
            f"{HIERARCHICAL_ENV}={raw!r}: expected 1 or 0 (1: ranks on several hosts reduce "
            f"within each host in shared memory first; 0: MPI carries their allreduces)."
        )
    return raw in ("1", "true")


def _eager_bytes() -> int:
    raw = os.environ.get(EAGER_ENV, "").strip()
    if not raw:
        return EAGER_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{EAGER_ENV}={raw!r}: expected a number of bytes >= 0 (0: the agreement carries "
            f"no data; default {EAGER_DEFAULT})."
        )
    return value


def eager_bytes() -> int:
    """``FLYTE_HVD_EAGER_BYTES`` as read at ``init()``."""
    return _state.eager_bytes


def hierarchical() -> bool:
    """``HOROVOD_HIERARCHICAL_ALLREDUCE`` as ``init()`` read it."""
    return _state.hierarchical


def shm_mode() -> str:
    """``FLYTE_HVD_SHM_COLLECTIVES`` as ``init()`` read it: ``auto``, ``on`` or ``off``."""
    return _state.shm_mode


def is_initialized() -> bool:
    return _state.comm is not None


def mpi_enabled() -> bool:
    """Collectives always run on MPI here (no Gloo); True once mpi4py is importable."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def comm() -> MPI.Comm:
    """The communicator collectives run on; raises the Horovod error before ``init()``."""
    if _state.comm is None:
        raise ValueError(
            "Horovod has not been initialized: call `flyte_hvd.core.init()` (hvd.init()) "
            "before using rank(), size() or any collective."
        )
    return _state.comm


def async_comm() -> MPI.Comm:
    """The communicator of the background thread (a duplicate of ``comm()``)."""
    comm()
    assert _state.async_comm is not None  # init() sets both communicators
    return _state.async_comm


def _topology() -> Topology:
    comm()
    assert _state.topology is not None
    return _state.topology


def rank() -> int:
    return _topology().rank


def size() -> int:
    return _topology().size


def local_rank() -> int:
    return _topology().local_rank


def local_size() -> int:
    return _topology().local_size


def cross_rank() -> int:
    return _topology().cross_rank


def cross_size() -> int:
    return _topology().cross_size


def is_homogeneous() -> bool:
    return _topology().homogeneous


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Begin recording collectives into a Chrome-tracing file; call on every rank.
    ``mark_cycles`` is accepted for Horovod compatibility (there is no background cycle to
    mark here)."""
    timeline.start(file_path, rank())


def stop_timeline() -> None:
    """Stop recording and write the file on rank 0 (collective: call on every rank)."""
    timeline.stop(comm())
