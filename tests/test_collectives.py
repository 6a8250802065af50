"""Every collective case at size 1 (in this process) and sizes 2 and 3 (rank processes)."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pytest

import flyte_hvd.core as hvd
from flyte_hvd.core import shm
from flyte_hvd.launch.job import FunctionJob
from flyte_hvd.launch.supervisor import launch_local

import collective_cases

cloudpickle.register_pickle_by_value(collective_cases)

_results: dict[int | str, list[dict]] = {}
# Ranks on one host reduce through shared memory by default; "2-mpi" runs the cases at size 2
# with that path off (MPI carries everything), "3-shm" at size 3 with it forced on.
_PATHS = {"2-mpi": "off", "3-shm": "on"}


def results_at(size: int | str) -> list[dict[str, str | None]]:
    """Run all cases once per size (rank start-up is the slow part) and cache per-rank results."""
    if size not in _results:
        if size == 1:
            _results[size] = [collective_cases.run_cases()]
        else:
            ranks = int(str(size).split("-")[0])
            env = {shm.MODE_ENV: _PATHS[size]} if size in _PATHS else None
            _results[size] = launch_local(
                FunctionJob(collective_cases.run_cases), ranks, start_timeout=60, env=env
            )
    return _results[size]


@pytest.mark.mpi
@pytest.mark.parametrize("size", [1, 2, "2-mpi", "3-shm"])
@pytest.mark.parametrize("name", list(collective_cases.CASES))
def test_collective(name: str, size: int | str):
    failures = {r: res[name] for r, res in enumerate(results_at(size)) if res[name] is not None}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


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


def test_shared_memory_forced_on_where_it_cannot_serve_says_why():
    with pytest.raises(RuntimeError) as raised:
        shm._refuse("on", "the ranks run on more than one host")
    assert str(raised.value) == (
        "FLYTE_HVD_SHM_COLLECTIVES=on, but the ranks run on more than one host; set "
        "FLYTE_HVD_SHM_COLLECTIVES=auto to let MPI carry these collectives."
    )
    shm._refuse("auto", "the ranks run on more than one host")  # auto: MPI, no error


def test_bad_fusion_threshold(monkeypatch):
    from flyte_hvd.core.collectives import fusion_threshold

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="number of bytes"):
        fusion_threshold()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        fusion_threshold()


def test_fusion_buckets_respect_threshold_and_dtype():
    from flyte_hvd.core.collectives import fusion_buckets

    # Five float32[4] (16 bytes each), one int64[2], one float32[100] (400 bytes).
    arrays = [np.zeros(4, np.float32)] * 5 + [np.zeros(2, np.int64), np.zeros(100, np.float32)]
    items = [(a.dtype, a.nbytes) for a in arrays]
    assert fusion_buckets(items, threshold=40) == [[0, 1], [2, 3], [4], [6], [5]]
    assert fusion_buckets(items, threshold=1 << 20) == [[0, 1, 2, 3, 4, 6], [5]]
    assert fusion_buckets(items, threshold=0) == [[0], [1], [2], [3], [4], [6], [5]]


def test_packed_offsets_start_every_part_on_64_bytes():
    from flyte_hvd.core.collectives import packed_offsets

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
