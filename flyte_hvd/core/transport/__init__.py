"""How a communicator's collectives move their data, chosen once per communicator.

The collective API (``core/collectives.py``) checks arguments, fuses, compresses and scales;
below it a transport carries the data and the ranks' agreement:

- ``SharedMemoryTransport``: every rank on one host; the host's shared segment (``shm``).
- ``HierarchicalTransport``: the same number of ranks on each of several hosts; large
  reductions through each host's segment and MPI between hosts, the rest over MPI.
- ``MpiTransport``: anything else (one rank per host, ``FLYTE_HVD_SHM=off``): MPI, its large
  reductions in a ring of its own (``ring``).

``torch/process_group.py`` is a third route, for torch tensors: torch.distributed's process
group (NCCL between GPUs), with the agreement still over the MPI communicator's transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flyte_hvd.core import shm, state
from flyte_hvd.core.transport.mpi import MpiTransport
from flyte_hvd.core.transport.shared import HierarchicalTransport, SharedMemoryTransport

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["HierarchicalTransport", "MpiTransport", "SharedMemoryTransport", "forget", "of"]

_transports: dict[int, MpiTransport] = {}


def of(comm: MPI.Comm) -> MpiTransport:
    """The transport of ``comm``, chosen on first use (collective then: every rank of
    ``comm`` gets here in the same collective)."""
    found = _transports.get(comm.py2f())
    if found is None:
        found = _transports[comm.py2f()] = _choose(comm)
    return found


def _choose(comm: MPI.Comm) -> MpiTransport:
    segment = shm.channel(comm)
    if isinstance(segment, shm.Channel):
        return SharedMemoryTransport(comm, segment)
    if isinstance(segment, shm.Hierarchy):
        return HierarchicalTransport(comm, segment)
    return MpiTransport(comm)


def forget(comm: MPI.Comm) -> None:
    """Drop ``comm``'s transport and its segment (before the communicator is freed, on every
    rank of it)."""
    _transports.pop(comm.py2f(), None)
    shm.forget(comm)


def _forget_all() -> None:
    _transports.clear()


state.on_shutdown(_forget_all, order=2)
