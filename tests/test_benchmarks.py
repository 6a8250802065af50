"""The benchmarks' own arguments: a layout of simulated hosts that cannot be run is refused
before anything is launched."""

import subprocess
import sys

import pytest
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
