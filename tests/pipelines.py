"""The Rossmann pipelines' command lines (`make run`'s flytekit workflow, `make run-flyte2`'s
Flyte 2 pipeline), each run once per test session and asserted by several tests.

When a session's tests ask for both, both start together (the fixture ``pipeline_runs`` in
conftest.py): on this project's 2-core machines they finished in 138-139 s side by side where
one after the other took 154 s, and each still runs as a user would, from the repository, as
its own process group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
BIN = os.path.dirname(sys.executable)

# fixture name -> the command line the user types (without --work_dir)
COMMANDS = {
    "main_job": [os.path.join(BIN, "pyflyte"), "run", "workflows/rossmann.py", "horovod_spark_wf"],
    "flyte2_job": [
        os.path.join(BIN, "flyte"),
        "run",
        "--local",
        "workflows/rossmann_flyte2.py",
        "rossmann",
    ],
}


class MainJob(NamedTuple):
    """One run of a pipeline's command line and what it left: its output, seconds and
    ``work_dir``."""

    stdout: str
    seconds: float
    work_dir: str
    stderr: str = ""

    def line(self, prefix: str) -> str:
        return next(x for x in self.stdout.splitlines() if x.startswith(prefix))

    def path(self, label: str) -> str:
        """A path the summary prints (``model:``, ``submission:``)."""
        return re.search(rf"^{label}: +(\S+)", self.stdout, re.M).group(1)


class PipelineRun:
    """A pipeline's command line started in the background (the synthetic default, 2 ranks,
    ``work_dir`` under ``folder``), from the repository, as a user would run it."""

    def __init__(self, command: list[str], folder: Path):
        self.work_dir = str(folder / "work")
        self._stdout = open(folder / "stdout.log", "w+")  # noqa: SIM115
        self._stderr = open(folder / "stderr.log", "w+")  # noqa: SIM115
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [*command, "--work_dir", self.work_dir],
            cwd=REPO,
            stdout=self._stdout,
            stderr=self._stderr,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            start_new_session=True,
        )
        self._job: MainJob | None = None

    def result(self, timeout: float = 660) -> MainJob:
        """Waits for the run and asserts that it succeeded."""
        if self._job is None:
            try:
                self.process.wait(timeout)
            finally:
                seconds = time.monotonic() - self.started
                self.stop()
            self._stdout.seek(0)
            self._stderr.seek(0)
            stdout, stderr = self._stdout.read(), self._stderr.read()
            assert self.process.returncode == 0, stdout[-2000:] + stderr[-4000:]
            self._job = MainJob(stdout, seconds, self.work_dir, stderr)
        return self._job

    def stop(self) -> None:
        """Kills what is left of the run (a test that failed before waiting for it)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
