"""The Rossmann workflow on a Spark standalone cluster of simulated hosts that share nothing
but S3 (tests/cluster_harness.py says what is simulated and how)."""

from __future__ import annotations

import json
import re
import time

import pytest
from cluster_harness import (
    OBJSTORE,
    RAW_BUCKET,
    REPO,
    STORE_BUCKET,
    SimCluster,
    namespaces_unavailable,
)
from needs import require

pytestmark = [pytest.mark.cluster, pytest.mark.spark, pytest.mark.flyte, pytest.mark.e2e]

RANK_LINE = re.compile(
    r"rank (\d+) of (\d+) on host (\S+): local_rank (\d+) of (\d+), cross_rank (\d+) of (\d+)"
)


def _keys(cluster: SimCluster, bucket: str, prefix: str = "") -> set[str]:
    pages = cluster.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


@pytest.mark.timeout(1800)
def test_rossmann_runs_on_two_simulated_hosts_that_share_only_s3():
    require(namespaces_unavailable())
    started = time.monotonic()
    hp = {"num_proc": 2, "epochs": 1, "sample_rate": 0.3, "batch_size": 128, "verbose": 1}
    work_dir = f"s3://{STORE_BUCKET}/rossmann"
    with SimCluster() as cluster:
        up = time.monotonic()
        # The driver leaves a file in its private /tmp before the run, as it leaves the dataset.
        run = cluster.run_on_driver(
            ["sh", "-c", 'echo driver-only > /tmp/driver/driver-only.txt && exec "$@"', "run",
             "pyflyte", "run", "--raw-output-data-prefix", f"s3://{RAW_BUCKET}/raw",
             str(REPO / "workflows" / "rossmann.py"), "horovod_spark_wf",
             "--hp", json.dumps(hp), "--work_dir", work_dir],
            timeout=1500,
        )  # fmt: skip
        output = run.stdout
        ran = time.monotonic()
        assert run.returncode == 0, f"exit {run.returncode} after {ran - up:.0f}s: {output[-6000:]}"

        # Two ranks on two hosts: one rank per host.
        ranks = {int(m[1]): m.groups() for m in RANK_LINE.finditer(output)}
        assert sorted(ranks) == [0, 1], output[-6000:]
        hosts = {ranks[r][2] for r in ranks}
        assert hosts == {"sim-worker-1", "sim-worker-2"}
        for _, size, _, local_rank, local_size, _, cross_size in ranks.values():
            assert (size, local_rank, local_size, cross_size) == ("2", "0", "1", "2")

        # Rank 0's Keras progress bar (`verbose` 1, redrawn with \r) crossed hosts intact.
        plain = re.sub(r"\x1b\[[0-9;]*m", "", output)  # Keras colours its bar
        assert re.search(r"^\[0\]<stdout>:\s*\d+/\d+ ━+ .*/step", plain, re.M), output[-6000:]

        # The run's artefacts are in S3.
        (summary,) = re.findall(r"model:\s+(s3://\S+)", output)
        run_path = summary.removeprefix(f"s3://{STORE_BUCKET}/").rsplit("/", 1)[0]
        stored = _keys(cluster, STORE_BUCKET, run_path)
        for name in ("checkpoint.keras", "state.json", "submission.csv"):
            assert f"{run_path}/{name}" in stored, sorted(stored)
        assert any(key.startswith(f"{run_path}/logs/") for key in stored), sorted(stored)
        # Flyte's raw outputs went to S3; Spark's Parquet of its DataFrames to the stand-in.
        assert _keys(cluster, RAW_BUCKET, "raw/")
        assert list((cluster.root / "objstore" / RAW_BUCKET).rglob("*.parquet"))

        # What the executors could see: not the checkout, not the driver's files; the
        # workflow's code came as the zip the driver shipped.
        for worker in ("sim-worker-1", "sim-worker-2"):
            for path in (REPO / "workflows" / "rossmann.py", "/tmp/driver/driver-only.txt"):
                assert cluster.on_host(worker, ["test", "-e", str(path)]).returncode == 1
            find = ["find", "/tmp/spark-work", "-name", "workflows-*.zip"]
            shipped = cluster.on_host(worker, find)
            assert shipped.stdout.strip(), f"{worker}: no shipped workflows zip"
            assert cluster.on_host(worker, ["test", "-d", OBJSTORE]).returncode == 0
    assert not cluster.leftovers()
    print(
        f"cluster test: start {up - started:.0f}s, workflow {ran - up:.0f}s, "
        f"total {time.monotonic() - started:.0f}s"
    )


@pytest.mark.timeout(300)
def test_an_interrupted_cluster_leaves_nothing_behind():
    """Ctrl-C (KeyboardInterrupt) while hosts run: every process, namespace and mount goes."""
    require(namespaces_unavailable())
    cluster = SimCluster(workers=1)
    with pytest.raises(KeyboardInterrupt), cluster:
        # A process that leaves its host's session still dies with the host.
        cluster.on_host("sim-worker-1", ["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 &"])
        assert cluster.on_host("sim-worker-1", ["hostname"]).stdout.strip() == "sim-worker-1"
        assert len(cluster._pids_in_namespaces()) >= 3
        raise KeyboardInterrupt
    assert cluster.leftovers() == []
