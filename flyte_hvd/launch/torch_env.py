"""The variables ``torch.distributed`` and the tools around it read, set on every rank.

``torch.distributed.init_process_group()`` finds its peers through ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` (its ``env://`` method); Lightning's
``rank_zero_only``, Accelerate and the MLflow and W&B plugins decide "am I rank 0" from
``RANK``/``LOCAL_RANK``. The rank bootstrap sets them, from the communicator the ranks just
joined, before the job is loaded:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``NODE_RANK`` are the
  rank's place (Horovod's rank, size, local rank, local size and cross rank). They always
  replace what the environment had: any other value would disagree with the communicator.
- ``MASTER_ADDR`` is ``127.0.0.1`` when every rank is on one host, else rank 0's address as
  the other hosts reach it (``ADDRESS_ENV``, which a Spark task sets to its executor's
  address; else what rank 0's host name resolves to).
- ``MASTER_PORT`` is a port that rank 0 reserved by binding to port 0 on every interface
  before the rendezvous; it holds the socket until just before the job runs, so two runs that
  start together on one host can never be handed the same port. The race left: between that
  release and the job's ``init_process_group`` another process on rank 0's host may bind the
  same port (the kernel hands out free ports in a pseudo-random order, so this needs a
  process that binds at that moment and draws that one number); ``init_process_group`` then
  fails on rank 0 with "address already in use", and the run ends with that error, naming
  rank 0, instead of hanging.
- A ``MASTER_ADDR`` or ``MASTER_PORT`` that the ranks' environment already has (the ``env``
  a launcher was given, the shell of ``flyte-hvd-run``) is kept: a fixed port a firewall
  allows, say. One exception: a loopback ``MASTER_ADDR`` while the ranks span hosts cannot
  reach rank 0, so it is replaced (with a warning).

``NODE_PER_RANK_ENV=1`` makes each rank a node of its own (``LOCAL_RANK=0``,
``LOCAL_WORLD_SIZE=1``, ``NODE_RANK=RANK``): how pyspark's ``TorchDistributor`` presents a
Spark task, whose GPUs are the only ones the rank sees.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flyte_hvd.core.log import get_logger

if TYPE_CHECKING:
    from flyte_hvd.core.state import Topology

# The address this rank's host is reached at by the other hosts of the run (set by a Spark
# task from its executor's address).
ADDRESS_ENV = "FLYTE_HVD_ADDRESS"
NODE_PER_RANK_ENV = "FLYTE_HVD_NODE_PER_RANK"
# Every variable this module sets: a driver's own values of these describe its own process
# group, not a run it launches (``environment.driver_env`` leaves them out).
PLACE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT")
LOOPBACK = "127.0.0.1"

logger = get_logger(__name__)


def reserve_port() -> socket.socket:
    """A socket bound to a free port on every interface; the caller closes it just before
    the job may bind the port itself."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    return sock


def own_address(env: Mapping[str, str]) -> str:
    """This host's address as the other hosts of the run reach it."""
    if env.get(ADDRESS_ENV):
        return env[ADDRESS_ENV]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def rendezvous_value(
    rank: int, host: str, env: Mapping[str, str], reserved: socket.socket | None
) -> list[Any]:
    """What a rank contributes to the rendezvous' host exchange: its host, and for rank 0
    its address and reserved port."""
    if rank != 0 or reserved is None:
        return [host, None, None]
    return [host, own_address(env), reserved.getsockname()[1]]


def rank_env(
    rank: int, size: int, topology: Topology, gathered: list[list[Any]], env: Mapping[str, str]
) -> dict[str, str]:
    """The variables for this rank (see the module's docstring), from every rank's
    ``rendezvous_value`` (index = rank) and the rank's environment as it is now."""
    hosts = [value[0] for value in gathered]
    one_host = len(set(hosts)) == 1
    _, address, port = gathered[0]
    if env.get(NODE_PER_RANK_ENV, "").strip() == "1":
        local_rank, local_size, node_rank = 0, 1, rank
    else:
        local_rank, local_size, node_rank = (
            topology.local_rank,
            topology.local_size,
            topology.cross_rank,
        )
    out = {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": LOOPBACK if one_host else str(address),
        "MASTER_PORT": str(port),
    }
    given_addr = env.get("MASTER_ADDR", "").strip()
    if given_addr:
        if not one_host and _is_loopback(given_addr):
            if rank == 0:
                logger.warning(
                    "MASTER_ADDR=%s is a loopback address but the ranks run on %d hosts: "
                    "using rank 0's address %s instead",
                    given_addr,
                    len(set(hosts)),
                    out["MASTER_ADDR"],
                )
        else:
            out["MASTER_ADDR"] = given_addr
    if env.get("MASTER_PORT", "").strip():
        out["MASTER_PORT"] = env["MASTER_PORT"].strip()
    return out


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address).is_loopback
    return False
