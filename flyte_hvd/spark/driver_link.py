"""The channel from Spark tasks back to the driver: rank output, timings and failures.

Executors' stdout ends up in executor logs, where Horovod's users never find their
tracebacks. Each barrier task opens one TCP connection to a server on the driver, proves it
knows the run's secret, and sends JSON lines: output lines (printed on the driver with a
``[rank]`` prefix), start-up events, and the failing rank's traceback, which the driver puts
in the exception it raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from flyte_hvd.core.launcher import OutputLog


def _proof(secret: str) -> str:
    return hmac.new(secret.encode(), b"flyte-hvd driver link", hashlib.sha256).hexdigest()


class DriverServer:
    """Runs on the driver for the length of one ``run()``."""

    def __init__(
        self,
        host: str,
        secret: str,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        prefix_output_with_timestamp: bool = False,
        on_failure: Callable[[int, int, str], bool] | None = None,
        watch: Any = None,
        on_stuck: Callable[[], None] | None = None,
    ):
        self._secret_proof = _proof(secret)
        self._on_failure = on_failure
        # A ``core.stall.StallWatch`` over all ranks: tasks forward their ranks' reports here.
        self.watch = watch
        self._on_stuck = on_stuck
        self.stuck: tuple[int, str] | None = None
        self._closed = threading.Event()
        self.attempts_started = 0  # how many times the stage's tasks have started
        self._stdout, self._stderr = stdout, stderr
        self._timestamps = prefix_output_with_timestamp
        self._lock = threading.Lock()
        self.output_log = OutputLog()  # kept, and named in the error, if the run fails
        self.events: dict[int, dict[str, float]] = {}
        self.failures: dict[int, tuple[int, str]] = {}  # rank -> (stage attempt, traceback)
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, name="flyte-hvd-driver-link", daemon=True).start()
        if watch is not None:
            threading.Thread(target=self._watch, name="flyte-hvd-stall", daemon=True).start()

    def _watch(self) -> None:
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
                conn, _ = self._sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            first = stream.readline()
            try:
                hello = json.loads(first)
            except ValueError:
                return
            if not hmac.compare_digest(str(hello.get("proof", "")), self._secret_proof):
                return
            for line in stream:
                final = self._handle(json.loads(line))
                if final is not None:  # the failing task waits for the verdict
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"final": final}).encode() + b"\n")

    def _handle(self, message: dict[str, Any]) -> bool | None:
        """Takes one message; for a failure, returns whether the run ends here."""
        kind, rank = message["kind"], message["rank"]
        with self._lock:
            if kind == "out":
                self._print(rank, message["stream"], message["text"])
            elif kind == "event":
                self.events.setdefault(rank, {})[message["name"]] = message["time"]
                if message["name"] == "task_started":
                    if rank == 0:
                        self.attempts_started += 1
                    if self.watch is not None:
                        self.watch.reset(rank)
            elif kind == "probe" and self.watch is not None:
                self.watch.probe(rank, message)
            elif kind == "ended" and self.watch is not None:
                self.watch.ended(rank, message["how"])
            elif kind == "failed":
                # A retried stage reports again; keep each rank's latest failure.
                self.failures[rank] = (self.attempts_started, message["traceback"])
                for line in message["traceback"].rstrip().splitlines():
                    self.output_log.write(rank, "stderr", line)
        if kind != "failed":
            return None
        if self._on_failure is None:
            return False
        return self._on_failure(self.attempts_started, rank, message["traceback"])

    def _print(self, rank: int, stream: str, text: str) -> None:
        target = (
            (self._stdout or sys.stdout) if stream == "stdout" else (self._stderr or sys.stderr)
        )
        self.output_log.write(rank, stream, text)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S ") if self._timestamps else ""
        target.write(f"{stamp}[{rank}]<{stream}>:{text}\n")
        target.flush()

    def latest_failures(self) -> dict[int, str]:
        """Tracebacks from the latest stage attempt that reported any."""
        with self._lock:
            if not self.failures:
                return {}
            last = max(attempt for attempt, _ in self.failures.values())
            return {r: tb for r, (attempt, tb) in self.failures.items() if attempt == last}

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self.output_log.close(keep=False)  # a no-op once the run's error kept it
        for thread in self._threads:
            thread.join(timeout=2)


# How long a failing task waits for the driver's verdict (retry or end) before failing itself.
VERDICT_TIMEOUT_S = 10.0


class DriverLink:
    """Runs in a Spark task: sends to the ``DriverServer``. Never raises on a broken link:
    losing log lines must not fail training."""

    def __init__(self, address: tuple[str, int], secret: str, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self._sock: socket.socket | None = socket.create_connection(address, timeout=30)
        self._sock.settimeout(None)
        self._send({"proof": _proof(secret)})

    def _send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(data)
            except OSError:
                self._sock = None

    def output(self, rank: int, stream: str, text: str) -> None:
        self._send({"kind": "out", "rank": rank, "stream": stream, "text": text})

    def event(self, name: str, at: float | None = None) -> None:
        self._send({"kind": "event", "rank": self.rank, "name": name, "time": at or time.time()})

    def forward(self, kind: str, rank: int, message: dict[str, Any]) -> None:
        """A rank's probe report or ending, for the driver's stall watch."""
        self._send({**message, "kind": kind, "rank": rank})

    def failed(self, traceback: str) -> bool:
        """Reports this rank's failure; returns whether the driver ends the run here (no
        stage attempt left), False when it lets Spark retry or cannot be reached."""
        self._send({"kind": "failed", "rank": self.rank, "traceback": traceback})
        with self._lock:
            sock = self._sock
        if sock is None:
            return False
        try:
            sock.settimeout(VERDICT_TIMEOUT_S)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(256)
                if not chunk:
                    return False
                reply += chunk
            return bool(json.loads(reply).get("final"))
        except (OSError, ValueError):
            return False
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(None)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
