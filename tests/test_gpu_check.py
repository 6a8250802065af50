"""The GPU check (scripts/gpu_check.sh, benchmarks/gpu_check.py): on this machine its parts
run on CPU ranks over gloo, so the script a GPU machine runs is known to work before one is
at hand; the CUDA run itself skips without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
SMALL = ["--sizes-mb", "0.0625,1", "--rounds", "2", "--steps", "2", "--no-estimator"]


def _script(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), str(out), "--", *args],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _checked(report: dict, ranks: int, backend: str) -> None:
    assert report["benchmark"] == "gpu_check" and report["ranks"] == ranks
    assert report["backend"] == backend
    assert report["results_correct"] == {"ours": True, "ours_mpi": True, "torch_distributed": True}
    assert [row["bytes"] for row in report["allreduce"]] == [1 << 16, 1 << 20]
    for row in report["allreduce"]:
        assert row["ours_ms"] > 0 and row["ours_mpi_ms"] > 0 and row["torch_distributed_ms"] > 0
    assert report["step"]["params"] > 5_000_000 and report["step"]["same_weights_on_ranks"]
    assert report["step"]["ours_ms"] > 0 and report["step"]["ddp_ms"] > 0


@pytest.mark.mpi
def test_the_gpu_check_runs_its_parts_on_cpu_ranks(tmp_path, no_leftover_ranks):
    run = _script(tmp_path, "--device", "cpu", *SMALL)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "nothing to install" in run.stdout  # this venv has mpi4py, cloudpickle, mpiexec
    line = (tmp_path / "gpu_check.json").read_text()
    assert line.endswith("\n") and line.strip() == run.stdout.splitlines()[-2]
    report = json.loads(line)
    _checked(report, ranks=2, backend="gloo")
    assert report["devices"] == ["cpu", "cpu"]
    assert report["estimator"] == {"skipped": "--no-estimator"}
    assert (tmp_path / "gpu_check.log").read_text().rstrip().endswith(line.strip())


def test_the_gpu_check_refuses_what_it_cannot_run(tmp_path):
    run = _script(tmp_path, PYTHON="no-such-python")
    assert run.returncode == 2
    assert "no no-such-python here; PYTHON=... names the Python that has torch" in run.stderr
    with pytest.raises(SystemExit, match=r"--sizes-mb: expected numbers of MiB .*; found '1,x'"):
        gpu_check.main(["--sizes-mb", "1,x"])
    with pytest.raises(SystemExit, match=r"at least one size of 4 bytes or more; found '0'"):
        gpu_check.main(["--sizes-mb", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_the_gpu_check_says_when_there_is_no_gpu():
    with pytest.raises(SystemExit, match=r"sees no CUDA GPU here .* or with --device cpu"):
        gpu_check.main(["--device", "cuda"])


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_the_gpu_checks_fit_trains_and_refuses_a_batch_off_its_device(
    spark_local2, tmp_path, no_leftover_ranks
):
    fit = gpu_check.estimator_part(spark_local2, "cpu", 2, str(tmp_path / "cpu"))
    assert fit["device"] == "cpu" and fit["loss_fell"] and len(fit["losses"]) == 4
    # Asked to check GPU training on a machine without one, the ranks train on the CPU, and
    # the model says so instead of letting a CPU fit pass for a GPU one.
    with pytest.raises(Exception, match=r"a batch on cpu; this check expects cuda"):
        gpu_check.estimator_part(spark_local2, "cuda", 2, str(tmp_path / "cuda"))


@pytest.mark.mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_check_on_cuda(tmp_path, no_leftover_ranks):
    run = _script(tmp_path, "--device", "cuda", *SMALL)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    _checked(report, ranks=torch.cuda.device_count(), backend="nccl")
    assert all(device.startswith("cuda:") for device in report["devices"])
