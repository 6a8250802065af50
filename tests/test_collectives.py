"""Every collective case at size 1 (in this process) and sizes 2 and 3 (rank processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from cluster_harness import MPI_TCP_ENV, mpiexec_on_hosts, namespaces_unavailable
from needs import require

import flyte_hvd.core as hvd
from flyte_hvd.core import shm, state
from flyte_hvd.launch import stall
from flyte_hvd.launch.job import FunctionJob
from flyte_hvd.launch.supervisor import launch_local

import collective_cases

cloudpickle.register_pickle_by_value(collective_cases)

_results: dict[int | str, list[dict]] = {}
# Ranks on one host reduce through shared memory by default; "2-mpi" and "3-mpi" run the cases
# with that path off (MPI carries everything: calls up to FLYTE_HVD_EAGER_BYTES in the
# agreement's records), "2-mpi-eager-0" with no data in the records, "2-mpi-unchecked" with
# the argument check off, "3-shm" at size 3 with shared memory forced on.
_PATHS = {
    "2-mpi": {shm.MODE_ENV: "off"},
    "3-mpi": {shm.MODE_ENV: "off"},
    "2-mpi-eager-0": {shm.MODE_ENV: "off", state.EAGER_ENV: "0"},
    "3-shm": {shm.MODE_ENV: "on"},
    "2-mpi-unchecked": {shm.MODE_ENV: "off", state.CHECK_ENV: "0"},
}
# Cases that call collectives with mismatched arguments or serve joined ranks: only the
# argument check makes those work (without it they hang or abort, as in raw MPI).
_NEEDS_CHECK = {
    "mismatched_shapes_raise_on_every_rank",
    "join_serves_reductions_of_the_other_ranks",
    "allreduce_of_several_chunks",
    "long_gathers_and_broadcasts",
}


# A case that fails on some ranks only leaves them out of step: the next calls no longer
# match and, without the argument check, wait forever. The stall bound ends such a run with
# the ranks and places named, in a minute rather than the test's timeout.
_STALL_BOUND = {stall.CHECK_TIME_ENV: "30", stall.SHUTDOWN_TIME_ENV: "60"}
_failed_runs: dict[int | str, str] = {}


def results_at(size: int | str) -> list[dict[str, str | None]]:
    """Run all cases once per size (rank start-up is the slow part) and cache per-rank results
    (or the run's failure)."""
    if size in _failed_runs:
        failure = _failed_runs[size]
        pytest.fail(f"the run of every case at {size} failed: {failure}", pytrace=False)
    if size not in _results:
        if size == 1:
            _results[size] = [collective_cases.run_cases()]
        else:
            ranks = int(str(size).split("-")[0])
            env = {**_PATHS.get(size, {}), **_STALL_BOUND}
            names = list(collective_cases.CASES)
            if env.get(state.CHECK_ENV) == "0":
                names = [n for n in names if n not in _NEEDS_CHECK]
            job = FunctionJob(collective_cases.run_cases, (names,))
            try:
                _results[size] = launch_local(job, ranks, start_timeout=60, env=env)
            except Exception as error:
                _failed_runs[size] = f"{type(error).__name__}: {error}"
                raise
    return _results[size]


@pytest.mark.mpi
@pytest.mark.parametrize("size", [1, 2, *_PATHS])
@pytest.mark.parametrize("name", list(collective_cases.CASES))
def test_collective(name: str, size: int | str):
    if name in _NEEDS_CHECK and str(size).endswith("unchecked"):
        pytest.skip("needs the argument check (FLYTE_HVD_CHECK_COLLECTIVES=0 here)")
    failures = {r: res[name] for r, res in enumerate(results_at(size)) if res[name] is not None}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


@pytest.mark.mpi
def test_ranks_sharing_one_core_reduce_in_a_ring_without_waiting_out_time_slices():
    """Two ranks over MPI on one core (more ranks than cores, or pods under a CPU limit): the
    ring waits for its transfers in a fixed order, with waits that give the core to the peer;
    MPICH's Waitany did not, and each 1 MB allreduce waited out a time slice (9 ms, not 1)."""

    def median_ring_allreduce_seconds() -> float:
        import time

        from flyte_hvd.core.transport import ring

        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # both ranks: the same core
        hvd.init()
        x = np.ones(1 << 18, np.float32)  # 1 MB: the ring's route for two ranks
        assert ring.takes(hvd.size(), hvd.Sum, x, np.empty_like(x), False)
        times = []
        for _ in range(21):
            start = time.perf_counter()
            got = hvd.allreduce(x, op=hvd.Sum)
            times.append(time.perf_counter() - start)
        np.testing.assert_array_equal(got, np.full_like(x, 2.0))
        return float(np.median(times))

    seconds = launch_local(
        FunctionJob(median_ring_allreduce_seconds), 2, start_timeout=60, env={shm.MODE_ENV: "off"}
    )
    assert max(seconds) < 0.004, f"median 1 MB allreduce per rank: {seconds}"


# Cases that assume every rank on one host.
_ONE_HOST_CASES = {"topology_single_host"}
_HOSTS_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import collective_cases
import flyte_hvd.core as hvd
from flyte_hvd.core import shm, state
hvd.init()
path = type(shm.channel(state.comm())).__name__
failed = {{k: v for k, v in collective_cases.run_cases({names!r}).items() if v}}
with open(f"{{sys.argv[1]}}/rank-{{hvd.rank()}}.json", "w") as f:  # ranks' stdout interleave
    json.dump({{"rank": hvd.rank(), "path": path, "failed": failed}}, f)
"""


@pytest.mark.mpi
@pytest.mark.cluster
def test_hierarchical_allreduce_on_two_simulated_hosts(tmp_path):
    """2 hosts x 2 ranks: every collective case passes with allreduces reduced within each
    host in shared memory, then across hosts over MPI (``HOROVOD_HIERARCHICAL_ALLREDUCE``)."""
    _every_case_on_hosts(tmp_path, 2, 2, "Hierarchy")


@pytest.mark.mpi
@pytest.mark.cluster
@pytest.mark.parametrize("hosts", [2, 3])
def test_every_case_with_one_rank_per_simulated_host(tmp_path, hosts):
    """One rank per host, as Kubernetes runs us: every collective case passes over MPI
    between hosts (TCP), large reductions in the MPI transport's own ring."""
    _every_case_on_hosts(tmp_path, hosts, 1, "NoneType")


def _every_case_on_hosts(tmp_path, hosts: int, per_host: int, path: str) -> None:
    require(namespaces_unavailable())
    names = [n for n in collective_cases.CASES if n not in _ONE_HOST_CASES]
    script = _HOSTS_SCRIPT.format(tests=str(Path(__file__).parent), names=names)
    env = {**os.environ, **MPI_TCP_ENV, shm.MODE_ENV: "auto"}
    del env["MPIR_CVAR_NOLOCAL"]  # MPICH's shared memory within a host, as on real hosts
    command = [sys.executable, "-c", script, str(tmp_path)]
    done = subprocess.run(
        mpiexec_on_hosts(tmp_path, hosts, per_host, command),
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert len(results) == hosts * per_host, done.stdout[-3000:] + done.stderr[-3000:]
    assert {r["path"] for r in results} == {path}  # NoneType: no segment, the MPI transport
    failures = {r["rank"]: r["failed"] for r in results if r["failed"]}
    assert not failures, json.dumps(failures, indent=1)[-6000:]


_UNEVEN_SCRIPT = """
import sys
import numpy as np
import flyte_hvd.core as hvd
hvd.init()
try:
    hvd.allreduce(np.ones(4))
except RuntimeError as e:
    with open(f"{sys.argv[1]}/rank-{hvd.rank()}.txt", "w") as f:  # ranks' stdout interleave
        f.write(str(e))
"""


_NOT_THE_SAME = (
    "the ranks run on more than one host, not the same number of them (at least 2) on each "
    "(ranks per host, by rank: [2, 2, 1])"
)


@pytest.mark.mpi
@pytest.mark.cluster
@pytest.mark.parametrize(
    ("ranks", "hierarchical", "why"),
    [
        (3, "1", _NOT_THE_SAME),
        (4, "0", "the ranks run on more than one host and HOROVOD_HIERARCHICAL_ALLREDUCE=0"),
    ],
)
def test_shared_memory_forced_on_where_hosts_cannot_use_it_says_why(
    tmp_path, ranks, hierarchical, why
):
    """Ranks on 2 hosts with the segment forced on, where it cannot serve (2 + 1 ranks; or the
    hierarchical allreduce off): every rank's first collective raises why, instead of some
    ranks taking another path and hanging."""
    require(namespaces_unavailable())
    env = {**os.environ, **MPI_TCP_ENV, shm.MODE_ENV: "on"}
    env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = hierarchical
    del env["MPIR_CVAR_NOLOCAL"]
    script = [sys.executable, "-c", _UNEVEN_SCRIPT, str(tmp_path)]
    command = mpiexec_on_hosts(tmp_path, 2, 2, script)
    command[command.index("-n") + 1] = str(ranks)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    raised = [p.read_text() for p in sorted(tmp_path.glob("rank-*.txt"))]
    assert len(raised) == ranks, done.stdout[-3000:] + done.stderr[-3000:]
    for line in raised:
        assert line == (
            f"FLYTE_HVD_SHM_COLLECTIVES=on, but {why}; set FLYTE_HVD_SHM_COLLECTIVES=auto to let "
            f"MPI carry these collectives."
        ), line


def test_collective_before_init_names_init():
    hvd.shutdown()
    with pytest.raises(ValueError, match=r"hvd.init\(\)"):
        hvd.allreduce(np.ones(2))
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()


def test_init_rejects_non_communicator():
    hvd.shutdown()
    with pytest.raises(ValueError, match="mpi4py communicator"):
        hvd.init(comm="COMM_WORLD")


def test_init_accepts_mpi4py_comm_and_is_idempotent():
    from mpi4py import MPI

    hvd.shutdown()
    hvd.init(comm=MPI.COMM_SELF)
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (0, 1)
    hvd.shutdown()
    assert not hvd.is_initialized()


def test_bad_shared_memory_setting_is_refused_at_init(monkeypatch):
    from mpi4py import MPI

    hvd.shutdown()
    monkeypatch.setenv(shm.MODE_ENV, "yes")
    with pytest.raises(ValueError, match=r"FLYTE_HVD_SHM_COLLECTIVES='yes': expected one of auto"):
        hvd.init(comm=MPI.COMM_SELF)
    assert not hvd.is_initialized()


def test_records_carry_at_most_256_kib_between_two_ranks_and_64_kib_for_more(monkeypatch):
    """Between two ranks a record is as long as its data, up to 256 KiB; point to point for up
    to 8 ranks up to 64 KiB; in an Allgather every record has the room, so 64 KiB over all."""
    from flyte_hvd.core.transport.records import P2P_MAX_RANKS, eager_bytes

    assert state.EAGER_DEFAULT == 256 << 10 and P2P_MAX_RANKS == 8
    monkeypatch.setattr(state._state, "eager_bytes", 1 << 20)
    assert [eager_bytes(n) for n in (2, 3, 8, 16, 1000, 20000)] == [
        262144,
        65536,
        65536,
        4096,
        64,
        0,
    ]
    monkeypatch.setattr(state._state, "eager_bytes", 1001)  # whole int64 slots
    assert eager_bytes(2) == 1000


@pytest.mark.parametrize("value", ["-1", "4k"])
def test_bad_eager_setting_is_refused_at_init(monkeypatch, value):
    from mpi4py import MPI

    hvd.shutdown()
    monkeypatch.setenv(state.EAGER_ENV, value)
    with pytest.raises(ValueError, match=rf"FLYTE_HVD_EAGER_BYTES='{value}': expected a number"):
        hvd.init(comm=MPI.COMM_SELF)
    assert not hvd.is_initialized()


def test_bad_hierarchical_setting_is_refused_at_init(monkeypatch):
    from mpi4py import MPI

    hvd.shutdown()
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe")
    with pytest.raises(
        ValueError, match=r"HOROVOD_HIERARCHICAL_ALLREDUCE='maybe': expected 1 or 0"
    ):
        hvd.init(comm=MPI.COMM_SELF)
    assert not hvd.is_initialized()


def test_shared_memory_forced_on_where_it_cannot_serve_says_why():
    with pytest.raises(RuntimeError) as raised:
        shm._refuse("on", "the ranks run on more than one host")
    assert str(raised.value) == (
        "FLYTE_HVD_SHM_COLLECTIVES=on, but the ranks run on more than one host; set "
        "FLYTE_HVD_SHM_COLLECTIVES=auto to let MPI carry these collectives."
    )
    shm._refuse("auto", "the ranks run on more than one host")  # auto: MPI, no error


def test_bad_fusion_threshold(monkeypatch):
    from flyte_hvd.core.fusion import fusion_threshold

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="number of bytes"):
        fusion_threshold()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        fusion_threshold()


def test_fusion_buckets_respect_threshold_and_dtype():
    from flyte_hvd.core.fusion import fusion_buckets

    # Five float32[4] (16 bytes each), one int64[2], one float32[100] (400 bytes).
    arrays = [np.zeros(4, np.float32)] * 5 + [np.zeros(2, np.int64), np.zeros(100, np.float32)]
    items = [(a.dtype, a.nbytes) for a in arrays]
    assert fusion_buckets(items, threshold=40) == [[0, 1], [2, 3], [4], [6], [5]]
    assert fusion_buckets(items, threshold=1 << 20) == [[0, 1, 2, 3, 4, 6], [5]]
    assert fusion_buckets(items, threshold=0) == [[0], [1], [2], [3], [4], [6], [5]]


def test_packed_offsets_start_every_part_on_64_bytes():
    from flyte_hvd.core.fusion import packed_offsets

    assert packed_offsets([3, 16, 1], itemsize=4) == ([0, 16, 32], 48)
    assert packed_offsets([], itemsize=8) == ([], 0)


def test_require_int_names_the_argument():
    from flyte_hvd.core.checks import require_int

    assert require_int("n", 3, 1) == 3
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"`n` must be an int >= 1"):
            require_int("n", bad, 1)


def test_timeline_needs_existing_directory(tmp_path):
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_SELF)
    try:
        with pytest.raises(ValueError, match="does not exist"):
            hvd.start_timeline(str(tmp_path / "missing" / "t.json"))
    finally:
        hvd.shutdown()
