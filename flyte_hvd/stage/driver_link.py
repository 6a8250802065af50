"""The channel between Spark tasks and the driver: the rendezvous, rank output, timings,
failures and large results.

Executors' stdout ends up in executor logs, where Horovod's users never find their
tracebacks. Each barrier task opens one TCP connection to a server on the driver, answers the
server's challenge with a proof that it knows the run's secret, and sends JSON lines: output
lines (printed on the driver with a ``[rank]`` prefix), start-up events, the failing rank's
traceback, which the driver puts in the exception it raises, and a large return value, which
the driver keeps in a file so that it never passes through a JVM's heap.

The ranks' rendezvous rounds (MPI port names) go over the same link: the server answers a
round as soon as every task has sent its value. Spark's ``BarrierTaskContext.allGather``
would do the same, but its task side polls the barrier's RPC once a second, so every call
costs a second however fast the tasks arrive.

The server listens where the tasks reach it (loopback for a local master), and until a
connection has proved the secret it gets one short line within a few seconds: the proof is
an HMAC of a nonce the server made for that connection alone, so an observed handshake
cannot be replayed, and a stranger can neither fill the driver's memory nor keep its threads.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import queue
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from flyte_hvd.core.log import get_logger
from flyte_hvd.launch import messages
from flyte_hvd.launch.messages import LinkKind
from flyte_hvd.launch.output import (
    PIECE_BYTES,
    RankOutput,
    Spool,
    console_sink,
    decode_tag,
    encode_tag,
)
from flyte_hvd.launch.stall import StallWatch

logger = get_logger(__name__)

# A connection that has not proved the run's secret yet may send one line of at most this many
# bytes, within this many seconds; then the server hangs up.
HELLO_MAX_BYTES = 4096
HELLO_TIMEOUT_S = 5.0
# The role a Spark task's connection proves (a proof for one role is worthless for another).
TASK_ROLE = "task"


def max_connections(size: int) -> int:
    """Connections a run's server keeps at once: a link per task, room for a retried stage
    attempt's tasks while the failed attempt's hang up, and a few for strangers, which
    are hung up on within ``HELLO_TIMEOUT_S``."""
    return 4 * size + 16


def _proof(secret: str, nonce: str, role: str, rank: int) -> str:
    message = f"flyte-hvd driver link:{nonce}:{role}:{rank}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


class DriverServer:
    """Runs on the driver for the length of one ``run()`` of ``size`` ranks. A result above
    ``max_result_bytes`` is refused (the ranks check the same limit first, with a better
    message)."""

    def __init__(
        self,
        host: str,
        secret: str,
        size: int,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        prefix_output_with_timestamp: bool = False,
        on_failure: Callable[[int, int, str], bool] | None = None,
        watch: StallWatch | None = None,
        on_stuck: Callable[[], None] | None = None,
        max_result_bytes: int = 1 << 31,
    ):
        self._secret = secret
        self._size = size  # tasks in a rendezvous round
        self._max_connections = max_connections(size)
        self._max_result_bytes = max_result_bytes
        # round -> rank -> (value, the task's connection)
        self._gathers: dict[int, dict[int, tuple[str, socket.socket]]] = {}
        # Bumped by every failure and lost task: a task whose link is older belongs to a stage
        # attempt that failed (Spark cannot tell a Python task its stage attempt), so its
        # rendezvous rounds are refused and cannot mix with the retried attempt's.
        self._generation = 0
        self._on_failure = on_failure
        # A ``core.stall.StallWatch`` over all ranks: tasks forward their ranks' reports here.
        self.watch = watch
        self._on_stuck = on_stuck
        self.stuck: tuple[int, str] | None = None
        self._closed = threading.Event()
        self.attempts_started = 0  # how many times the stage's tasks have started
        self._lock = threading.Lock()
        # The ranks' output: shown on the driver's console, and every byte in the full-output
        # file that a failed run's error names.
        self.output = RankOutput(console_sink(stdout, stderr, prefix_output_with_timestamp))
        self.output_log = self.output.log
        self.events: dict[int, dict[str, float]] = {}
        self.failures: dict[int, tuple[int, str]] = {}  # rank -> (stage attempt, traceback)
        self._results: dict[str, str] = {}  # id -> the file holding a rank's pickled result
        self._results_dir: str | None = None
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._conns: dict[socket.socket, threading.Thread] = {}  # open connections
        threading.Thread(target=self._accept, name="flyte-hvd-driver-link", daemon=True).start()
        if watch is not None:
            threading.Thread(target=self._watch, name="flyte-hvd-stall", daemon=True).start()

    def _watch(self) -> None:
        assert self.watch is not None  # the thread starts only with a watch
        while not self._closed.wait(0.25):
            verdict = self.watch.check()
            if verdict is not None:
                self.stuck = verdict
                if self._on_stuck is not None:
                    self._on_stuck()
                return

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed.is_set():  # accepted as the run ended: hang up
                    _hang_up(conn)
                    return
                if len(self._conns) >= self._max_connections:
                    logger.debug(
                        "driver link: hung up on %s: %d connections open already",
                        peer,
                        len(self._conns),
                    )
                    _hang_up(conn)
                    continue
                thread = threading.Thread(target=self._serve, args=(conn, peer), daemon=True)
                self._conns[conn] = thread
                thread.start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            with conn:
                if self._authenticate(conn, peer):
                    with conn.makefile("rb") as stream:
                        self._serve_task(conn, stream)
        finally:
            with self._lock:
                self._conns.pop(conn, None)

    def _authenticate(self, conn: socket.socket, peer: object) -> bool:
        """Challenges a new connection; whether it proved the run's secret in time."""
        nonce = secrets.token_hex(16)
        try:
            conn.sendall(_line(messages.link_challenge(nonce)))
            line = _read_hello(conn, time.monotonic() + HELLO_TIMEOUT_S)
            conn.settimeout(None)
        except OSError:
            line = None
        hello = _parse(line) if line is not None else None
        if hello is None:
            logger.debug(
                "driver link: hung up on %s: no hello line of at most %d bytes within %gs",
                peer,
                HELLO_MAX_BYTES,
                HELLO_TIMEOUT_S,
            )
            return False
        role, rank = hello.get("role"), hello.get("rank")
        if (
            role != TASK_ROLE
            or not isinstance(rank, int)
            or not hmac.compare_digest(
                str(hello.get("proof", "")), _proof(self._secret, nonce, role, rank)
            )
        ):
            logger.debug("driver link: hung up on %s: it did not prove the run's secret", peer)
            return False
        return True

    def _serve_task(self, conn: socket.socket, stream: IO[bytes]) -> None:
        with self._lock:
            born = self._generation
        try:
            for line in stream:
                message = _parse(line)
                if message is None:
                    continue
                try:
                    if message.get("kind") == LinkKind.RESULT:
                        if not self._receive_result(message, conn, stream):
                            return  # the bytes that follow cannot be skipped
                        continue
                    final = self._handle(message, conn, born)
                except (KeyError, TypeError, ValueError) as error:
                    logger.debug(
                        "driver link: dropped a %r message with bad fields (%s: %s)",
                        message.get("kind"),
                        type(error).__name__,
                        error,
                    )
                    continue
                if final is not None:  # the failing task waits for the verdict
                    with self._lock:
                        _reply(conn, messages.verdict_reply(final))
        except OSError:
            pass  # the task's process went away (killed with its Spark task)
        finally:
            with self._lock:
                # A task of this attempt is gone: a pending round can never complete.
                if born == self._generation and self._gathers:
                    self._abort_gathers("a task's link to the driver closed")

    def _receive_result(
        self, message: messages.Message, conn: socket.socket, stream: IO[bytes]
    ) -> bool:
        """Copies a rank's pickled result from the link into a file of the driver's and tells
        the task the id it is kept under; False when the link cannot go on."""
        rank, size = int(message["rank"]), message["size"]
        if not isinstance(size, int) or not 0 <= size <= self._max_result_bytes:
            logger.warning(
                "driver link: refused rank %d's result of %r bytes (the limit is %d bytes)",
                rank,
                size,
                self._max_result_bytes,
            )
            return False
        with self._lock:
            if self._results_dir is None:
                self._results_dir = tempfile.mkdtemp(prefix="flyte-hvd-results-")
            fd, path = tempfile.mkstemp(prefix=f"rank{rank}-", dir=self._results_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                left = size
                while left:
                    chunk = stream.read(min(left, 1 << 20))
                    if not chunk:
                        raise OSError(f"the link closed in the middle of rank {rank}'s result")
                    f.write(chunk)
                    left -= len(chunk)
        except BaseException:
            os.remove(path)
            raise
        result_id = secrets.token_hex(8)
        with self._lock:
            self._results[result_id] = path
            _reply(conn, messages.stored_reply(result_id))
        return True

    def result_path(self, result_id: str) -> str:
        """The file holding the result a task sent under ``result_id`` (removed by
        ``close``)."""
        with self._lock:
            if result_id not in self._results:
                raise RuntimeError(
                    f"a task reported that the driver kept its rank's result as "
                    f"{result_id!r}, but it holds no such result"
                )
            return self._results[result_id]

    def _handle(self, message: messages.Message, conn: socket.socket, born: int) -> bool | None:
        """Takes one message; for a failure, returns whether the run ends here."""
        kind, rank = message["kind"], message["rank"]
        with self._lock:
            if kind == LinkKind.GATHER:
                self._gather(message, conn, born)
            elif kind == LinkKind.OUT:
                self.output.write(rank, message["stream"], base64.b64decode(message["data"]))
            elif kind == LinkKind.EVENT:
                self.events.setdefault(rank, {})[message["name"]] = message["time"]
                if message["name"] == "task_started":
                    if rank == 0:
                        self.attempts_started += 1
                    if self.watch is not None:
                        self.watch.reset(rank)
            elif kind == LinkKind.PROBE and self.watch is not None:
                self.watch.probe(rank, message)
            elif kind == LinkKind.ENDED and self.watch is not None:
                self.watch.ended(rank, message["how"])
            elif kind == LinkKind.FAILED:
                # A retried stage reports again; keep each rank's latest failure.
                self.failures[rank] = (self.attempts_started, message["traceback"])
                for line in message["traceback"].rstrip().splitlines():
                    self.output_log.write(rank, "stderr", line)
                # A round that waits for the failed rank would never complete.
                self._abort_gathers(f"rank {rank} failed")
        if kind != LinkKind.FAILED:
            return None
        if self._on_failure is None:
            return False
        return self._on_failure(self.attempts_started, rank, message["traceback"])

    def _gather(self, message: messages.Message, conn: socket.socket, born: int) -> None:
        """One task's value for a rendezvous round; when all are in, every task gets them all
        in rank order."""
        round_ = int(message["round"])
        if born < self._generation:
            _reply(conn, messages.round_reply(round_, aborted="this stage attempt has failed"))
            return
        values = self._gathers.setdefault(round_, {})
        values[int(message["rank"])] = (str(message["value"]), conn)
        if len(values) < self._size:
            return
        del self._gathers[round_]
        ordered = [values[r][0] for r in sorted(values)]
        for _, task_conn in values.values():
            _reply(task_conn, messages.round_reply(round_, ordered))

    def _abort_gathers(self, why: str) -> None:
        """Ends the stage attempt's rendezvous: its waiting tasks are told why."""
        self._generation += 1
        for round_, values in self._gathers.items():
            for _, task_conn in values.values():
                _reply(task_conn, messages.round_reply(round_, aborted=why))
        self._gathers.clear()

    def latest_failures(self) -> dict[int, str]:
        """Tracebacks from the latest stage attempt that reported any."""
        with self._lock:
            if not self.failures:
                return {}
            last = max(attempt for attempt, _ in self.failures.values())
            return {r: tb for r, (attempt, tb) in self.failures.items() if attempt == last}

    def close(self) -> None:
        """Ends the run's link. Tasks still running (a failed run's) see the link end and stop
        their ranks; this waits up to ``CLOSE_WAIT_S`` for them to hang up, so that when
        ``run()`` raises, no rank process is left."""
        with self._lock:  # from here on the accepting thread takes no connection
            self._closed.set()
            conns, threads = list(self._conns), list(self._conns.values())
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; close does not
        self._sock.close()
        with self._lock:
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            for conn in conns:  # a task that did not hang up in time
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.output.close(keep=False)  # a no-op once the run's error kept the file
        if self._results_dir is not None:
            shutil.rmtree(self._results_dir, ignore_errors=True)

    def output_file(self) -> str | None:
        """Shows what is left of the ranks' output and keeps the full-output file: its path."""
        return self.output.close(keep=True)


def _hang_up(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()


def _line(message: messages.Message) -> bytes:
    return json.dumps(message).encode() + b"\n"


def _reply(conn: socket.socket, message: messages.Message) -> None:
    """Sends one line to a task (under the server's lock: replies to one task may come from
    several connections' threads); a task that went away is not the sender's problem."""
    with contextlib.suppress(OSError):
        conn.sendall(_line(message))


def _parse(line: bytes) -> messages.Message | None:
    """One JSON object, or None (said at DEBUG) for anything else."""
    try:
        message = json.loads(line)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        logger.debug("driver link: dropped a line that is not a JSON object (%d bytes)", len(line))
        return None
    return message


def _read_hello(conn: socket.socket, deadline: float) -> bytes | None:
    """The first line of an unauthenticated connection, without its newline; None when it is
    longer than ``HELLO_MAX_BYTES`` or not complete by ``deadline``. Only the line's own bytes
    are taken from the socket (it peeks first): what follows it belongs to the stream that
    serves the connection next."""
    line = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        ahead = conn.recv(HELLO_MAX_BYTES + 1 - len(line), socket.MSG_PEEK)
        if not ahead:
            return None
        end = ahead.find(b"\n")
        line += conn.recv(len(ahead) if end < 0 else end + 1)
        if line.endswith(b"\n"):
            return bytes(line[:-1])
        if len(line) > HELLO_MAX_BYTES:
            return None


# How long the driver waits, at the end of a failed run, for its tasks to stop their ranks.
CLOSE_WAIT_S = 5.0
# How long a failing task waits for the driver's verdict (retry or end) before failing itself.
VERDICT_TIMEOUT_S = 10.0
# How long a task waits for the driver to confirm a result it sent (all its bytes were sent).
RESULT_ACK_TIMEOUT_S = 60.0
# How often a task waiting for a rendezvous round checks whether it was aborted.
_GATHER_POLL_S = 0.1


class DriverLink:
    """Runs in a Spark task: sends to the ``DriverServer``. Never raises on a broken link:
    losing log lines must not fail training."""

    def __init__(self, address: tuple[str, int], secret: str, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        sock = socket.create_connection(address, timeout=30)
        stream = sock.makefile("rb")
        try:
            challenge = json.loads(stream.readline(HELLO_MAX_BYTES))
            nonce = str(challenge["nonce"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            stream.close()
            sock.close()
            raise ConnectionError(
                f"the Spark driver at {address[0]}:{address[1]} did not open the link "
                f"({type(error).__name__}: {error}); its run may be over"
            ) from None
        sock.settimeout(None)
        self._sock: socket.socket | None = sock
        self._verdicts: queue.Queue[messages.Message] = queue.Queue()
        self._rounds: queue.Queue[messages.Message] = queue.Queue()
        self._stored: queue.Queue[messages.Message] = queue.Queue()
        self._lost = threading.Event()  # the driver closed the link
        self._closing = False
        # Rank output waits here, never blocking the ranks, while one thread sends it.
        self._spool = Spool()
        self._sender = threading.Thread(
            target=self._send_output, name="flyte-hvd-link-output", daemon=True
        )
        self._sender.start()
        # Called once if the driver closes the link first: its run is over (it raised, or the
        # driver is gone), so whatever this task still runs is for nobody.
        self.on_lost: Callable[[], None] | None = None
        self._send(messages.link_hello(TASK_ROLE, rank, _proof(secret, nonce, TASK_ROLE, rank)))
        threading.Thread(
            target=self._read, args=(stream,), name="flyte-hvd-link-reader", daemon=True
        ).start()

    def _read(self, stream: IO[bytes]) -> None:
        """The driver's replies: rendezvous rounds, the failure verdict, stored results."""
        with contextlib.suppress(OSError, ValueError), stream:
            for line in stream:
                reply = json.loads(line)
                if "final" in reply:
                    self._verdicts.put(reply)
                elif "stored" in reply:
                    self._stored.put(reply)
                else:
                    self._rounds.put(reply)
        self._lost.set()
        if not self._closing and self.on_lost is not None:
            self.on_lost()

    def _connected(self) -> bool:
        return self._sock is not None and not self._lost.is_set()

    def _send(self, message: messages.Message) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(data)
            except OSError:
                self._sock = None

    def output(self, rank: int, stream: str, data: bytes) -> None:
        """A rank's output bytes (a ``ByteSink``: returns at once; ``b""`` ends the stream)."""
        self._spool.put(encode_tag(rank, stream), data)

    def _send_output(self) -> None:
        """Sends the spooled output in order, consecutive bytes of one stream together."""
        while (records := self._spool.get()) is not None:
            batch: list[bytes] = []
            for i, (tag, data) in enumerate(records):
                batch.append(data)
                last = i + 1 == len(records)
                if (
                    last
                    or records[i + 1][0] != tag
                    or not data
                    or not records[i + 1][1]
                    or (sum(map(len, batch)) >= PIECE_BYTES)
                ):
                    rank, stream, _ = decode_tag(tag)
                    payload = base64.b64encode(b"".join(batch)).decode()
                    self._send(messages.output(rank, stream, payload))
                    batch = []

    def drain(self, timeout: float = 30.0) -> None:
        """Sends what output is left (waiting at most ``timeout`` seconds)."""
        self._spool.close()
        self._sender.join(timeout)

    def event(self, name: str, at: float | None = None) -> None:
        self._send(messages.event(self.rank, name, at or time.time()))

    def forward(self, kind: str, rank: int, message: messages.Message) -> None:
        """A rank's probe report or ending, for the driver's stall watch."""
        self._send(messages.forwarded(LinkKind(kind), rank, message))

    def all_gather(self, round_: int, value: str, aborted: threading.Event) -> list[str]:
        """Every task's value for rendezvous round ``round_``, in rank order. Raises when
        ``aborted`` is set, the driver aborts the round (a rank failed) or the link is
        lost."""
        self._send(messages.gather(self.rank, round_, value))
        while not aborted.is_set():
            try:
                reply = self._rounds.get(timeout=_GATHER_POLL_S)
            except queue.Empty:
                if not self._connected():
                    raise RuntimeError(
                        "lost the connection to the Spark driver during the rendezvous"
                    ) from None
                continue
            if reply.get("round") != round_:
                continue  # an answer to an earlier, abandoned round
            if "aborted" in reply:
                raise RuntimeError(f"rendezvous aborted: {reply['aborted']}")
            return [str(v) for v in reply["values"]]
        raise RuntimeError("rendezvous aborted")

    def failed(self, traceback: str) -> bool:
        """Reports this rank's failure; returns whether the driver ends the run here (no
        stage attempt left), False when it lets Spark retry or cannot be reached."""
        self.drain()  # the rank's last output reaches the driver before its failure
        self._send(messages.link_failed(self.rank, traceback))
        if not self._connected():
            return False
        try:
            return bool(self._verdicts.get(timeout=VERDICT_TIMEOUT_S)["final"])
        except queue.Empty:  # the driver is unreachable, or too slow to answer
            return False

    def send_result(self, path: str) -> str:
        """Sends this rank's pickled result, the file at ``path``, to the driver, which keeps
        it in a file of its own; returns the id it is kept under. Raises when the link cannot
        carry it."""
        size = os.path.getsize(path)
        with self._lock:
            if self._sock is None:
                raise ConnectionError("the link to the Spark driver is closed")
            try:
                self._sock.sendall(_line(messages.result(self.rank, size)))
                with open(path, "rb") as f:
                    self._sock.sendfile(f)
            except OSError as error:
                self._sock = None
                raise ConnectionError(
                    f"rank {self.rank}'s result ({size} bytes) could not be sent to the Spark "
                    f"driver: {error}"
                ) from None
        deadline = time.monotonic() + RESULT_ACK_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return str(self._stored.get(timeout=_GATHER_POLL_S)["stored"])
            except queue.Empty:
                if not self._connected():
                    break
        raise ConnectionError(
            f"the Spark driver did not confirm that it received rank {self.rank}'s result "
            f"({size} bytes)"
        )

    def close(self) -> None:
        self._closing = True
        self.drain()
        with self._lock:
            if self._sock is not None:
                # shutdown wakes the reader thread; close alone may leave it in recv.
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                self._sock.close()
                self._sock = None
