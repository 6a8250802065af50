"""One rank process as its supervisor (``flyte_hvd.launch.supervisor``) sees it: what it has
said and when, the pipes its output is read from as fast as it is written, what its
``mpiexec`` reports of how it ended, and the text that says how it died."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from typing import IO

from flyte_hvd.launch import failures as failure_kinds
from flyte_hvd.launch.output import ByteSink, LineSplitter, open_rank_pipes, render

# mpiexec's own banner when a rank dies; we report the death ourselves, naming the rank.
_BANNER_PREFIXES = (
    "=====",
    "=   ",
    "YOUR APPLICATION TERMINATED",
    "This typically refers to a problem",
    "Please see the FAQ page",
)
_EXIT_STRING = "YOUR APPLICATION TERMINATED WITH THE EXIT STRING:"
# mpiexec.gforker's report of a rank killed by a signal (it then exits 0 itself).
_GFORKER_SIGNALLED = re.compile(r"^\[\d+\]\d+:Return code = \d+, signaled with (.+)$")
_SIGNAL_NUMBERS = {signal.strsignal(s): int(s) for s in signal.valid_signals()}
_STDERR_TAIL_LINES = 30


class RankProcess:
    """A rank's process (its ``mpiexec -n 1`` launcher) and what the supervisor knows of it."""

    def __init__(self, rank: int):
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.conn: socket.socket | None = None
        self.traceback: str | None = None
        self.exit_string: str | None = None
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self.tail_splitter = LineSplitter(piece_bytes=4096)
        self.outputs: tuple[int, int] | None = None  # read ends of the rank's own pipes
        self.done = False
        # The launcher was ended by the supervisor after the rank returned and exited.
        self.launcher_ended = False
        # Its launcher is ``mpiexec.gforker``, which may sleep a second once its rank is gone
        # (``end_launcher_if_rank_gone``). Hydra's ``mpiexec`` exits at once and removes its
        # temporary files only when it ends by itself or on SIGTERM.
        self.launcher_lingers = False
        self.times: dict[str, float] = {}  # event -> wall-clock time, comparable across hosts' logs
        self.pumps: list[threading.Thread] = []
        self.command: list[str] = []
        self.spare_env: dict[str, str] = {}  # its environment without the run's own entries
        self.spare_started = False
        self.shm: list[str] = []  # MPI's shared-memory segments of the rank (``/dev/shm``)

    # -- starting ----------------------------------------------------------------------------

    def start(self, env: dict[str, str]) -> None:
        """Starts ``command`` in a session of its own, with pipes of its own for the rank's
        output (their entries added to ``env``) beside its launcher's stdout and stderr."""
        self.outputs, write_ends, pipes_env = open_rank_pipes()
        env.update(pipes_env)
        try:
            self.proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=write_ends,
            )
        finally:
            for fd in write_ends:
                os.close(fd)

    def start_pumps(self, output: ByteSink) -> None:
        """Threads that read the launcher's and the rank's output into ``output``."""
        assert self.proc is not None and self.outputs is not None
        pumps: list[tuple[Callable[..., None], str, IO[bytes] | int | None]] = [
            (self._pump_launcher, "stdout", self.proc.stdout),
            (self._pump_launcher, "stderr", self.proc.stderr),
            (self._pump_rank, "stdout", self.outputs[0]),
            (self._pump_rank, "stderr", self.outputs[1]),
        ]
        for target, stream, source in pumps:
            pump = threading.Thread(target=target, args=(stream, source, output), daemon=True)
            pump.start()
            self.pumps.append(pump)

    # -- output ------------------------------------------------------------------------------

    def _pump_rank(self, stream: str, fd: int, output: ByteSink) -> None:
        """Reads the rank's own pipe as fast as it is written: every byte goes on at once to
        ``output``, which must not block (see ``flyte_hvd.launch.output``)."""
        try:
            while True:
                try:
                    data = os.read(fd, 1 << 16)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                if stream == "stderr":
                    self._keep_tail(data)
                output(self.rank, stream, data)
        finally:
            os.close(fd)
            if stream == "stderr":
                self._keep_tail(None)
            output(self.rank, stream, b"")

    def _keep_tail(self, data: bytes | None) -> None:
        lines = self.tail_splitter.feed(data) if data else self.tail_splitter.flush()
        self.stderr_tail.extend(render(line) for line, _ in lines[-_STDERR_TAIL_LINES:])

    def _pump_launcher(self, stream: str, pipe: IO[bytes], output: ByteSink) -> None:
        """mpiexec's own output: its report of how the rank ended is kept, its banner is
        dropped (the run's error says it better), anything else (say, Python failing to
        start) is the rank's output."""
        held_blank = False  # mpiexec's banner starts with a blank line: hold blanks back
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(_EXIT_STRING):
                self.exit_string = line[len(_EXIT_STRING) :].strip()
            signalled = _GFORKER_SIGNALLED.match(line)
            if signalled:
                name = signalled.group(1).strip()
                number = _SIGNAL_NUMBERS.get(name)
                self.exit_string = f"{name} (signal {number})" if number else name
                continue
            if line.startswith(_BANNER_PREFIXES):
                held_blank = False
                continue
            if held_blank:
                output(self.rank, stream, b"\n")
            held_blank = not line
            if held_blank:
                continue
            if stream == "stderr":
                self.stderr_tail.append(line)
            output(self.rank, stream, raw if raw.endswith(b"\n") else raw + b"\n")
        if held_blank:
            output(self.rank, stream, b"\n")
        pipe.close()

    # -- how it ended ------------------------------------------------------------------------

    def end_launcher_if_rank_gone(self) -> None:
        """Once the rank has reported its result and its own process is gone, ends its
        launcher, which has nothing left to do: ``mpiexec.gforker`` often sleeps a whole second
        before it exits (when the rank's pipes close before its exit is reaped), a second added
        to every run. The launcher's session goes with it. What the rank did after it
        reported (MPI_Finalize, the interpreter's exit) no longer counts."""
        if not self.launcher_lingers or not self.done or self.pid is None:
            return
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.kill(self.pid, 0)  # still there, or not yet reaped by its launcher
            return
        except (ProcessLookupError, PermissionError):  # gone (or its pid taken by another)
            pass
        self.launcher_ended = True
        self.kill_launcher_session()
        self.proc.wait()

    def kill_launcher_session(self) -> None:
        """SIGKILL to the launcher's session (it has one of its own): the launcher and
        whatever of the rank is left in it."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def exit_code(self) -> int | None:
        """The rank's exit status; -1 for a signal its launcher reported but exited 0 on; 0
        once its launcher was ended after the rank returned (``end_launcher_if_rank_gone``)."""
        code = self.proc.poll() if self.proc is not None else None
        if code is not None and self.launcher_ended:
            return 0
        return -1 if code == 0 and self.exit_string else code

    def failed(self) -> bool:
        """The rank reported an error, or its process ended with a status other than 0."""
        if self.traceback is not None:
            return True
        code = self.exit_code()
        return code is not None and code != 0

    def death_text(self, code: int, oom_kills_before: int | None) -> str:
        """How the rank died, with the last lines of its stderr; a SIGKILL while the kernel's
        count of out-of-memory kills grew from ``oom_kills_before`` says so."""
        how = f"died: {self.exit_string}" if self.exit_string else f"exited with status {code}"
        killed = f"(signal {int(signal.SIGKILL)})" in (self.exit_string or "")
        if killed and _more(failure_kinds.oom_kills(), oom_kills_before):
            how += f"; {failure_kinds.OOM_KILLED_NOTE}"
        tail = "\n".join(self.stderr_tail)
        return f"rank {self.rank} {how}" + (f"\nlast stderr lines:\n{tail}" if tail else "")


def _more(now: int | None, before: int | None) -> bool:
    return now is not None and before is not None and now > before
