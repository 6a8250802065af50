"""Rank output as bytes: whatever a rank writes reaches the user, and never stops the rank.

A rank's stdout and stderr are pipes the launcher reads as fast as the rank writes (its reading
threads never wait on anything else). Every byte goes to the run's full-output file as it came
(the file a failed run's error names); the user's console gets lines decoded for display:
invalid UTF-8 shows as ``\\x..`` escapes, a line redrawn with ``\\r`` (a progress bar) shows its
latest state when it ends and at most once every ``FLYTE_HVD_PROGRESS_INTERVAL_S`` seconds
(default 5) while it is redrawn, a line longer than ``PIECE_BYTES`` shows in pieces, and
TensorFlow's import-time notices (``IMPORT_NOTICES``) stay in the file only. The
console is written by a thread of its own behind a ``Spool``: if the console (or the link to
the driver) is slower than the ranks, output waits in memory and then in a temporary file,
in order, instead of blocking the ranks.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import IO, BinaryIO

PIECE_BYTES = 1 << 20  # a line longer than this is shown (and logged) in pieces
PROGRESS_INTERVAL_ENV = "FLYTE_HVD_PROGRESS_INTERVAL_S"
DEFAULT_PROGRESS_INTERVAL_S = 5.0
# What TensorFlow's C++ libraries print when a process imports them, through absl logging that
# TF_CPP_MIN_LOG_LEVEL does not reach: two lines per library with its own copy of absl, so two
# ranks show eight lines before their first step. Kept in the output log, not on the console.
IMPORT_NOTICES = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    rb"|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on\. "
)
STREAMS = ("stdout", "stderr")
_PENDING_BYTES = 1 << 20  # a line longer than this is passed on in pieces


# What a Spark Python worker prints when the JVM closed its connection before the worker's last
# flush (a task killed, a query that needed no more rows, a session stopped): a traceback through
# PySpark's daemon only, ending in a broken pipe. The JVM side reports what the task's end meant;
# on the console these lines only cost a user's attention.
_TRACEBACK_START = b"Traceback (most recent call last):"
_DAEMON_FRAME = re.compile(rb'  File ".*[/\\]pyspark[/\\]daemon\.py", line \d+, in ')
_CLOSED_CONNECTION = re.compile(rb"(BrokenPipeError|ConnectionResetError)\b")
_HELD_LINES = 200  # a longer traceback is passed on: none of PySpark's daemon is this deep


class _ClosedConnectionTracebacks:
    """Holds a traceback back until its last line says whether it is a Spark worker's
    closed-connection traceback (dropped) or anything else (passed on, line for line)."""

    def __init__(self) -> None:
        self.held: list[bytes] = []

    def lines_to_keep(self, line: bytes) -> list[bytes]:
        kept: list[bytes] = []
        if self.held:
            if line.startswith(b" ") and len(self.held) < _HELD_LINES:
                self.held.append(line)
                return kept
            if not line.startswith(_TRACEBACK_START):
                block, self.held = [*self.held, line], []
                return [] if self._from_a_closed_connection(block) else block
            kept, self.held = self.held, []
        if line.startswith(_TRACEBACK_START):
            self.held = [line]
        else:
            kept.append(line)
        return kept

    @staticmethod
    def _from_a_closed_connection(block: list[bytes]) -> bool:
        frames = [line for line in block if line.startswith(b'  File "')]
        return (
            bool(frames)
            and all(_DAEMON_FRAME.match(frame) for frame in frames)
            and bool(_CLOSED_CONNECTION.match(block[-1]))
        )


def copy_without_notices(source: int, target: int, parent: int | None = None) -> None:
    """Copy the bytes read from the file descriptor ``source`` to ``target`` until the end of
    the file, less the lines ``IMPORT_NOTICES`` matches and the tracebacks of Spark workers
    whose JVM connection closed first (the stderr of Spark's Python workers:
    ``flyte_hvd.stage.worker_daemon``). With ``parent``, stop as soon as that process (the
    daemon this copy serves) has ended: what its orphaned workers write then is dropped, as it
    was when they wrote straight to the daemon's stderr."""
    pending = b""
    tracebacks = _ClosedConnectionTracebacks()
    while True:
        if parent is not None:
            while not select.select([source], [], [], 0.2)[0]:
                if os.getppid() != parent:
                    return
            if os.getppid() != parent:
                return
        data = os.read(source, 65536)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        kept = b"".join(
            shown + b"\n"
            for line in lines
            if not IMPORT_NOTICES.match(line)
            for shown in tracebacks.lines_to_keep(line)
        )
        if len(pending) > _PENDING_BYTES:
            kept, pending = kept + pending, b""
        _write_all(target, kept)
    held = b"".join(line + b"\n" for line in tracebacks.held)
    _write_all(target, held if IMPORT_NOTICES.match(pending) else held + pending)


@contextlib.contextmanager
def import_notices_dropped() -> Iterator[None]:
    """Within the block this process's stderr (file descriptor 2) passes through
    ``copy_without_notices``: around an import of TensorFlow, whose C++ libraries print the
    ``IMPORT_NOTICES`` that ``TF_CPP_MIN_LOG_LEVEL`` does not reach."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    read_end, write_end = os.pipe()
    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)
    copier = threading.Thread(target=copy_without_notices, args=(read_end, saved), daemon=True)
    copier.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the copier reads to its end
        copier.join(timeout=5.0)
        os.close(read_end)
        os.close(saved)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


OutputSink = Callable[[int, str, str], None]
"""``sink(rank, stream, line)``: where a rank's display lines go (``stream`` is stdout/stderr)."""

ByteSink = Callable[[int, str, bytes], None]
"""``sink(rank, stream, data)``: a rank's output bytes as read; ``b""`` ends the stream. Must
not block (see ``RankOutput`` and ``Spool``)."""


def progress_interval() -> float:
    raw = os.environ.get(PROGRESS_INTERVAL_ENV, "")
    try:
        return max(float(raw), 0.0) if raw else DEFAULT_PROGRESS_INTERVAL_S
    except ValueError:
        return DEFAULT_PROGRESS_INTERVAL_S


class LineSplitter:
    """Cuts one stream's bytes into lines (without their ``\\n``), and a line longer than
    ``piece_bytes`` into pieces, cut between UTF-8 characters. Each comes as ``(bytes,
    continued)``: ``continued`` when it goes on from the piece before it."""

    def __init__(self, piece_bytes: int = PIECE_BYTES):
        self._pending = bytearray()
        self._piece = piece_bytes
        self._continued = False  # the pending bytes go on from a piece already returned

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        self._pending += data
        pieces: list[tuple[bytes, bool]] = []
        if b"\n" in data:
            *lines, rest = bytes(self._pending).split(b"\n")
            self._pending = bytearray(rest)
            for line in lines:
                pieces.extend(self._cut(line, self._continued))
                self._continued = False
        while len(self._pending) > self._piece:
            cut = _char_boundary(self._pending, self._piece)
            pieces.append((bytes(self._pending[:cut]), self._continued))
            del self._pending[:cut]
            self._continued = True
        return pieces

    def _cut(self, line: bytes, continued: bool) -> list[tuple[bytes, bool]]:
        pieces = []
        while len(line) > self._piece:
            cut = _char_boundary(line, self._piece)
            pieces.append((line[:cut], continued))
            line, continued = line[cut:], True
        pieces.append((line, continued))
        return pieces

    @property
    def pending(self) -> bytes:
        return bytes(self._pending)

    def flush(self) -> list[tuple[bytes, bool]]:
        """The last line, when the stream ended without a newline."""
        rest, self._pending = bytes(self._pending), bytearray()
        continued, self._continued = self._continued, False
        return [(rest, continued)] if rest else []


def _char_boundary(data: bytes | bytearray, at: int) -> int:
    """``at``, moved back (at most 3 bytes) so as not to cut a UTF-8 character."""
    for cut in range(at, max(at - 4, 0), -1):
        if data[cut] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return cut
    return at


def render(line: bytes) -> str:
    """What a terminal would show of ``line``: the last state of a ``\\r`` redraw, backspaces
    applied, undecodable bytes as ``\\x..`` escapes. Never raises."""
    if b"\r" in line:
        segments = [s for s in line.split(b"\r") if s]
        line = segments[-1] if segments else b""
    text = line.decode("utf-8", "backslashreplace")
    if "\b" in text:
        kept: list[str] = []
        for char in text:
            if char == "\b":
                if kept:
                    kept.pop()
            else:
                kept.append(char)
        text = "".join(kept)
    return text


class Spool:
    """A first-in first-out queue of byte records whose writer never waits: past
    ``memory_bytes`` held, records go to a temporary file until the reader has caught up."""

    _HEADER = struct.Struct("<iQ")  # tag, length

    def __init__(self, memory_bytes: int = 8 << 20):
        self._cond = threading.Condition()
        self._memory: deque[tuple[int, bytes]] = deque()
        self._held = 0
        self._limit = memory_bytes
        self._file: BinaryIO | None = None
        self._write_at = self._read_at = 0
        self._closed = False
        self.spilled_bytes = 0  # how much ever went through the file

    def put(self, tag: int, data: bytes) -> None:
        with self._cond:
            if self._file is None and self._held + len(data) <= self._limit:
                self._memory.append((tag, data))
                self._held += len(data)
            else:
                if self._file is None:
                    self._file = tempfile.TemporaryFile(prefix="flyte-hvd-spool-")  # noqa: SIM115
                    self._write_at = self._read_at = 0
                self._file.seek(self._write_at)
                self._file.write(self._HEADER.pack(tag, len(data)))
                self._file.write(data)
                self._write_at = self._file.tell()
                self.spilled_bytes += len(data)
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> list[tuple[int, bytes]] | None:
        """The records waiting (in order, at least one), ``[]`` after ``timeout`` seconds with
        none, or None once the spool is closed and empty."""
        with self._cond:
            if not self._cond.wait_for(self._ready, timeout):
                return []
            if self._memory:
                records = list(self._memory)
                self._memory.clear()
                self._held = 0
                return records
            if self._file is not None:
                return self._read_spilled()
            return None

    def _ready(self) -> bool:
        return bool(self._memory) or self._file is not None or self._closed

    def _read_spilled(self) -> list[tuple[int, bytes]]:
        assert self._file is not None
        records: list[tuple[int, bytes]] = []
        size = 0
        self._file.seek(self._read_at)
        while self._read_at < self._write_at and size < self._limit:
            tag, length = self._HEADER.unpack(self._file.read(self._HEADER.size))
            data = self._file.read(length)
            records.append((tag, data))
            size += length
            self._read_at += self._HEADER.size + length
        if self._read_at >= self._write_at:  # caught up: new records go to memory again
            self._file.close()
            self._file = None
        return records

    def empty(self) -> bool:
        with self._cond:
            return not self._memory and self._file is None

    def close(self) -> None:
        """No more records; the reader gets what is left, then None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def discard(self) -> None:
        with self._cond:
            self._memory.clear()
            self._held = 0
            if self._file is not None:
                self._file.close()
                self._file = None
            self._closed = True
            self._cond.notify_all()


def encode_tag(rank: int, stream: str, interim: bool = False) -> int:
    return rank * 4 + STREAMS.index(stream) * 2 + int(interim)


def decode_tag(tag: int) -> tuple[int, str, bool]:
    return tag // 4, STREAMS[(tag // 2) % 2], bool(tag % 2)


class ConsoleSink:
    """Writes display lines as ``[rank]<stream>:line`` to the given streams (default: sys's,
    looked up at each write); a character the stream cannot encode is escaped, not raised."""

    def __init__(
        self, stdout: IO[str] | None = None, stderr: IO[str] | None = None, timestamps: bool = False
    ):
        self._stdout, self._stderr = stdout, stderr
        self._timestamps = timestamps
        self._touched: set[int] = set()

    def _target(self, stream: str) -> IO[str]:
        import sys

        if stream == "stdout":
            return self._stdout or sys.stdout
        return self._stderr or sys.stderr

    def __call__(self, rank: int, stream: str, line: str) -> None:
        target = self._target(stream)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S ") if self._timestamps else ""
        text = f"{stamp}[{rank}]<{stream}>:{line}\n"
        try:
            target.write(text)
        except UnicodeEncodeError:
            encoding = getattr(target, "encoding", None) or "ascii"
            target.write(text.encode(encoding, "backslashreplace").decode(encoding))
        self._touched.add(id(target))

    def flush(self) -> None:
        for stream in STREAMS:
            target = self._target(stream)
            if id(target) in self._touched:
                with contextlib.suppress(OSError, ValueError):
                    target.flush()
        self._touched.clear()


def console_sink(
    stdout: IO[str] | None = None, stderr: IO[str] | None = None, timestamps: bool = False
) -> ConsoleSink:
    """Write rank lines as ``[rank]<stream>:line`` to the given streams (default: sys's)."""
    return ConsoleSink(stdout, stderr, timestamps)


class OutputLog:
    """Every rank's output as it came, one ``[rank]<stream>:`` prefix per line (``+`` instead of
    ``:`` where a line longer than ``PIECE_BYTES`` goes on), and the failing
    ranks' tracebacks, in an anonymous temporary file while the run lasts: written out under
    a name only when the run fails (the error names it), so a run that ends well, or a killed
    launcher, leaves no file."""

    def __init__(self) -> None:
        # Closed by `close`, which every launcher calls in `finally`.
        self._file: BinaryIO = tempfile.TemporaryFile(prefix="flyte-hvd-output-")  # noqa: SIM115
        self._lock = threading.Lock()
        self._closed = False
        self.path: str | None = None

    def write_lines(self, rank: int, stream: str, lines: list[tuple[bytes, bool]]) -> None:
        """Lines as ``LineSplitter`` cuts them: a piece that goes on from the one before it
        is written as its own line prefixed ``[rank]<stream>+``."""
        if not lines:
            return
        first, more = f"[{rank}]<{stream}>:".encode(), f"[{rank}]<{stream}>+".encode()
        data = b"".join((more if continued else first) + line + b"\n" for line, continued in lines)
        with self._lock:
            if not self._closed:
                self._file.write(data)

    def write(self, rank: int, stream: str, text: str) -> None:
        """A text of the launcher's about this rank (e.g. its traceback), line by line."""
        lines = [(line.encode(errors="replace"), False) for line in text.split("\n")]
        self.write_lines(rank, stream, lines)

    def close(self, keep: bool) -> str | None:
        """Write the file out (``keep``) and return its path, or drop it. Only the first call
        counts."""
        with self._lock:
            if self._closed:
                return self.path
            self._closed = True
            if keep:
                fd, path = tempfile.mkstemp(prefix="flyte-hvd-output-", suffix=".log")
                self._file.seek(0)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(self._file, out, 1 << 20)
                self.path = path
            self._file.close()
        return self.path


class RankOutput:
    """Where ranks' bytes end up on the machine that shows them: ``write`` (a ``ByteSink``) logs
    them to the ``OutputLog`` at once and hands their lines to a display thread that writes
    ``display``, so nothing waits for the console."""

    def __init__(self, display: OutputSink | None = None, interval: float | None = None):
        self.log = OutputLog()
        self._display = display or console_sink()
        self._interval = progress_interval() if interval is None else interval
        self._splitters: dict[tuple[int, str], LineSplitter] = {}
        self._shown_at: dict[tuple[int, str], float] = {}
        self._lock = threading.Lock()
        self._spool = Spool()
        self._thread = threading.Thread(target=self._show, name="flyte-hvd-output", daemon=True)
        self._thread.start()

    def write(self, rank: int, stream: str, data: bytes) -> None:
        key = (rank, stream)
        with self._lock:
            splitter = self._splitters.setdefault(key, LineSplitter())
            lines = splitter.feed(data) if data else splitter.flush()
            self.log.write_lines(rank, stream, lines)
            tag = encode_tag(rank, stream)
            for line, continued in lines:
                if continued or not IMPORT_NOTICES.match(line):
                    self._spool.put(tag, line)
            if lines:
                self._shown_at[key] = time.monotonic()
            pending = splitter.pending
            if data and b"\r" in pending and self._due(key):
                self._spool.put(encode_tag(rank, stream, interim=True), pending)

    def _due(self, key: tuple[int, str]) -> bool:
        now = time.monotonic()
        if now - self._shown_at.setdefault(key, now) < self._interval:
            return False
        self._shown_at[key] = now
        return True

    def _show(self) -> None:
        while True:
            records = self._spool.get()
            if records is None:
                return
            for tag, line in records:
                rank, stream, _ = decode_tag(tag)
                with contextlib.suppress(Exception):  # a broken console must not stop the reading
                    self._display(rank, stream, render(line))
            flush = getattr(self._display, "flush", None)
            if flush is not None:
                with contextlib.suppress(Exception):
                    flush()

    def end_streams(self) -> None:
        """Shows every stream's last line that had no newline."""
        for rank, stream in list(self._splitters):
            self.write(rank, stream, b"")

    def close(self, keep: bool, wait: float = 30.0) -> str | None:
        """Shows what is left (waiting up to ``wait`` seconds for the console), then keeps the
        full-output file (``keep``: its path) or drops it."""
        self.end_streams()
        self._spool.close()
        self._thread.join(timeout=wait)
        if self._thread.is_alive():
            self._spool.discard()
        return self.log.close(keep)


# -- the rank's pipes --------------------------------------------------------------------------

# In a rank process: "stdout fd,stderr fd", the write ends of its output pipes. The launcher
# passes them through `mpiexec` (which keeps inherited descriptors), so the rank's output never
# goes through mpiexec's own forwarding: MPICH's single-host `mpiexec.gforker` cuts a line at
# its first byte >= 0x80 and then closes the pipe, which kills the rank on its next write.
OUTPUT_FDS_ENV = "FLYTE_HVD_OUTPUT_FDS"


def open_rank_pipes() -> tuple[tuple[int, int], tuple[int, int], dict[str, str]]:
    """New output pipes for a rank process: the read ends (the launcher's), the write ends
    (to pass to the process, then close here) and the environment entry naming them."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return (out_r, err_r), (out_w, err_w), {OUTPUT_FDS_ENV: f"{out_w},{err_w}"}


def adopt_rank_pipes() -> None:
    """In a rank process: make the launcher's pipes its stdout and stderr (fd 1 and 2)."""
    raw = os.environ.pop(OUTPUT_FDS_ENV, "")
    if not raw:
        return
    import sys

    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for fd, target in zip((int(f) for f in raw.split(",")), (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
