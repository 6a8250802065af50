"""Shared fixtures. Heavy ones (rank processes, Spark) are session-scoped and named after
what they start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_processes() -> list[str]:
    """Command lines of rank processes (and their mpiexec) alive on this machine."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if "flyte_hvd.core.bootstrap" in line or "hydra_pmi_proxy" in line
    ]


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if it leaves a rank process or mpiexec behind."""
    before = set(rank_processes())
    yield
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = set(rank_processes()) - before
        if not left:
            return
        time.sleep(0.1)
    pytest.fail(f"rank processes outlived the run: {sorted(left)}")


@pytest.fixture
def cli():
    """Runs ``flyte-hvd-run`` as a user would, from the repo root."""

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        exe = os.path.join(os.path.dirname(sys.executable), "flyte-hvd-run")
        return subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
        )

    return run
