"""The benchmarks' own arguments: a layout of simulated hosts that cannot be run is refused
before anything is launched; the ranks of the containers layout join as two singletons."""

import json
import os
import subprocess
import sys

import pytest
from cluster_harness import MPI_TCP_ENV, VENV_BIN
from conftest import REPO

from benchmarks.across_hosts import parse_layout


def test_a_layout_reads_as_hosts_ranks_per_host_and_hierarchy():
    assert parse_layout("2x1") == (2, 1, False)
    assert parse_layout("4x2-hier") == (4, 2, True)


@pytest.mark.parametrize("layout", ["2", "1x4", "2x", "2x2-flat", "twoxone"])
def test_a_layout_that_is_not_hosts_x_ranks_is_refused(layout):
    with pytest.raises(ValueError, match=rf"layout '{layout}': expected HOSTSxRANKS"):
        parse_layout(layout)


def test_the_benchmark_refuses_a_bad_layout_before_it_launches():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.across_hosts", "--layouts", "2x1,3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "layout '3': expected HOSTSxRANKS with at least 2 hosts" in done.stderr
    assert "MPICH" not in done.stdout  # nothing measured


@pytest.mark.mpi
@pytest.mark.parametrize("side", ["raw", "ours"])
def test_two_singleton_ranks_join_and_measure_as_in_the_containers_layout(tmp_path, side):
    """What each container runs: a rank under its own ``mpiexec -n 1``, the two joined by a
    port name in a shared folder, then the side measured on the joined pair."""
    command = [sys.executable, "-m", "benchmarks.across_hosts", "--rank", "allreduce", side,
               "--sizes", "4096", "--join", str(tmp_path)]  # fmt: skip
    env = {**os.environ, **MPI_TCP_ENV}
    ranks = [
        subprocess.Popen(
            [str(VENV_BIN / "mpiexec"), "-n", "1", *command, str(rank)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    (line,) = [x for x in outputs[0][0].splitlines() if x.startswith("{")]
    result = json.loads(line)
    assert len(result.pop("hosts")) == 2
    assert 0 < result["4096"] < 0.1  # seconds per call
    assert not [x for x in outputs[1][0].splitlines() if x.startswith("{")]  # rank 0 reports


def test_the_containers_layout_says_why_it_measures_nothing_without_the_image():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.across_hosts", "--layouts", "containers"],
        cwd=REPO,
        env={**os.environ, "FLYTE_HVD_TEST_IMAGE": "localhost/flyte-hvd-absent:none"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["benchmark"] == "across_hosts"
    # Here: no such image (or, on a machine without podman, podman not found).
    assert "localhost/flyte-hvd-absent:none" in result["skipped"] or "podman" in result["skipped"]
    assert "MPICH" not in done.stdout  # nothing measured


def test_a_rank_whose_peer_never_writes_the_port_name_stops_and_says_so(tmp_path):
    script = ("import sys; from pathlib import Path; from benchmarks.across_hosts import "
              "joined_world; joined_world(Path(sys.argv[1]), 1, 0.3)")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO, env={**os.environ, **MPI_TCP_ENV}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"TimeoutError: no port name in {tmp_path / 'port'} after 0.3 s" in done.stderr
