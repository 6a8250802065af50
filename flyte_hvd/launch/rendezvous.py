"""How separately launched rank processes become one MPI communicator.

Each rank runs under its own ``mpiexec -n 1`` (MPICH cannot merge two singletons) and talks
to its supervisor over a private control socket: JSON lines, one request and one reply at a
time. The supervisor backs ``all_gather`` with whatever its launcher has: other local ranks
(``flyte-hvd-run``) or the Spark driver, over each task's link to it (one rank per Spark task).

The join admits rank k only in round k, on a port of its own: ``Accept`` is collective over
the group built so far and pairs with whichever process connects first, so with one shared
port two ranks racing to connect were admitted in the wrong order and hung. After the merge
every rank proves it holds the run's secret before any user code runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import queue
import shutil
import socket
import threading
from typing import TYPE_CHECKING

from flyte_hvd.launch import messages

if TYPE_CHECKING:
    from mpi4py import MPI

CONTROL_ENV = "FLYTE_HVD_CONTROL"
RANK_ENV = "FLYTE_HVD_RANK"
SIZE_ENV = "FLYTE_HVD_SIZE"
JOB_ENV = "FLYTE_HVD_JOB"
RESULT_ENV = "FLYTE_HVD_RESULT"
# A rank of `run(fn, data=df)`: its partition's local file (`flyte_hvd.stage.partition`).
PARTITION_ENV = "FLYTE_HVD_PARTITION"

# Exit status of a rank whose supervisor went away: it must not outlive its launcher.
ORPHANED_EXIT = 97

SHM_DIR = "/dev/shm"
# MPICH's intranode segments (``mpich_shm_<random>_<n>``): ``MPI_Finalize`` removes them, so a
# rank that ends any other way (fails, is killed) would leave 1 MiB each in ``/dev/shm``.
_MPICH_SHM_PREFIX = "mpich_shm_"


def own_shm_segments() -> list[str]:
    """Names of the MPICH segments in ``/dev/shm`` this process has mapped: its own, never
    another run's."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if SHM_DIR in line}
    except OSError:
        return []
    folder = SHM_DIR + "/"
    return sorted(
        p[len(folder) :]
        for p in paths
        if p.startswith(folder + _MPICH_SHM_PREFIX) and not p.endswith("(deleted)")
    )


def remove_shm_segments(names: list[str]) -> None:
    """Unlink ``names`` from ``/dev/shm`` (mappings still open stay valid); plain names only."""
    for name in names:
        if name.startswith(_MPICH_SHM_PREFIX) and "/" not in name:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))


def encode(message: messages.Message) -> bytes:
    return (json.dumps(message) + "\n").encode()


class ControlClient:
    """The rank's side of its control socket.

    A reader thread owns the socket's input: replies go to a queue, and if the supervisor
    closes the socket (it died, or it is stopping the run) the rank exits at once, even while
    the main thread is blocked inside MPI.
    """

    def __init__(self, path: str, rank: int):
        self.rank = rank
        self._path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
        except ConnectionRefusedError:
            # The supervisor listened before it started this rank: it is gone (killed with
            # its Spark task while this rank started), and nobody else would remove its folder.
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            raise
        self._replies: queue.Queue[messages.Message] = queue.Queue()
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._read, name="flyte-hvd-control", daemon=True).start()
        self.send(messages.hello(rank, os.getpid()))
        # The run's secret comes over this private socket, never through the environment.
        self.secret: str = self._replies.get()["secret"]

    def _read(self) -> None:
        stream = self._sock.makefile("rb")
        for line in stream:
            self._replies.put(json.loads(line))
        if not self._closing:
            # The supervisor is gone (killed with its Spark task, say): remove what it left.
            shutil.rmtree(os.path.dirname(self._path), ignore_errors=True)
            os._exit(ORPHANED_EXIT)

    def send(self, message: messages.Message) -> None:
        with self._lock:
            self._sock.sendall(encode(message))

    def all_gather(self, value: str) -> list[str]:
        self.send(messages.allgather(value))
        return self._replies.get()["values"]

    def finish(self) -> None:
        """Report success; from now on the supervisor may close the socket."""
        self._closing = True
        self.send(messages.rank_event(messages.RankOp.DONE))


def join(client: ControlClient, rank: int, size: int) -> MPI.Intracomm:
    """Build the ``size``-rank intracommunicator, ordered by ``rank``.

    Rank 0 opens one port per joining rank and a single ``all_gather`` hands them out. In
    round k the ranks joined so far ``Accept`` on port k, which only rank k connects to, so
    ranks may connect concurrently without being admitted out of order, and the rounds need
    no barriers between them (one exchange instead of one per rank).
    """
    from mpi4py import MPI

    # MPI made its shared-memory segments as it started. Only this process maps them (its MPI
    # world is itself; the merged communicator does not use them), and MPI_Finalize does not
    # mind their names gone: removed now, they go with the process however it ends (killed
    # with its Spark task, say). The supervisor is told first, should the rank die before.
    segments = own_shm_segments()
    client.send(messages.shm(segments))
    remove_shm_segments(segments)
    ports = [MPI.Open_port() for _ in range(size - 1)] if rank == 0 else []
    ports = client.all_gather("|".join(ports))[0].split("|")
    comm = MPI.COMM_SELF
    for k in range(1, size):
        if rank < k:
            inter = comm.Accept(ports[k - 1], root=0)
            comm = inter.Merge(high=False)
            inter.Free()
        elif rank == k:
            inter = MPI.COMM_SELF.Connect(ports[k - 1], root=0)
            comm = inter.Merge(high=True)
            inter.Free()
    if rank == 0:
        for port in ports[: size - 1]:
            MPI.Close_port(port)
    if comm.Get_rank() != rank or comm.Get_size() != size:
        raise RuntimeError(
            f"rendezvous built a communicator where rank {rank} of {size} is "
            f"{comm.Get_rank()} of {comm.Get_size()}; this is a bug in flyte-hvd."
        )
    return comm


def verify_secret(comm: MPI.Comm, secret: str) -> None:
    """Every rank proves it holds the run's secret; a stranger that joined is named."""
    challenge = comm.bcast(os.urandom(16).hex() if comm.Get_rank() == 0 else None, root=0)
    proofs = comm.allgather(_proof(secret, challenge, comm.Get_rank()))
    bad = [
        r for r, p in enumerate(proofs) if not hmac.compare_digest(p, _proof(secret, challenge, r))
    ]
    if bad:
        raise RuntimeError(
            f"ranks {bad} do not hold this run's secret: a process that this launcher did not "
            f"start joined the rendezvous. Check who can reach the ranks' network."
        )


def _proof(secret: str, challenge: str, rank: int) -> str:
    return hmac.new(secret.encode(), f"{challenge}:{rank}".encode(), hashlib.sha256).hexdigest()
