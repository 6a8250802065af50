"""The order the suite runs its tests in (tests/conftest.py): the fast tests first, beside the
two local pipelines; the pipelines' own tests next; the container test right after the tests
that wait most (test_faults.py, test_spark_run.py), beside which its run goes; the tests on the
local-cluster session last. Checked on stand-in items, as pytest hands them to the hook."""

from __future__ import annotations

import conftest
import pytest


class _Item:
    def __init__(self, nodeid: str, markers: tuple[str, ...] = (), fixtures: tuple[str, ...] = ()):
        self.nodeid = nodeid
        self.fixturenames = list(fixtures)
        self._markers = markers

    def get_closest_marker(self, name: str):
        return name if name in self._markers else None

    def __repr__(self) -> str:
        return self.nodeid


def _order(items: list[_Item]) -> list[str]:
    items.sort(key=lambda item: "spark_cluster" in item.fixturenames)  # as the hook does first
    conftest._place_the_container_test_after_the_waiting_ones(items)
    conftest._start_the_pipelines_with_the_fast_tests(items)
    return [item.nodeid for item in items]


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(conftest, "_beside_the_waiting", {})
    monkeypatch.setattr(conftest, "_pipelines_start", {})


def test_fast_tests_then_pipelines_then_the_container_test_after_the_waiting_ones(fresh_state):
    items = [
        _Item("tests/test_buffers.py::fast"),
        _Item("tests/test_cluster.py::hosts", ("cluster", "e2e")),
        _Item("tests/test_container_cluster.py::containers", ("container", "e2e")),
        _Item("tests/test_faults.py::fast"),
        _Item("tests/test_faults.py::rank", ("mpi",)),
        _Item("tests/test_faults.py::on_the_cluster", ("spark",), ("spark_cluster",)),
        _Item("tests/test_first_day.py::fit", ("spark",)),
        _Item("tests/test_rossmann.py::main_job", ("e2e",), ("main_job", "pipeline_runs")),
        _Item("tests/test_rossmann.py::features", ("spark",)),
        _Item("tests/test_spark_run.py::run", ("spark", "mpi")),
        _Item("tests/test_store.py::fast"),
    ]
    assert _order(items) == [
        "tests/test_buffers.py::fast",
        "tests/test_faults.py::fast",
        "tests/test_store.py::fast",
        "tests/test_rossmann.py::main_job",
        "tests/test_cluster.py::hosts",
        "tests/test_faults.py::rank",
        "tests/test_spark_run.py::run",
        "tests/test_container_cluster.py::containers",
        "tests/test_first_day.py::fit",
        "tests/test_rossmann.py::features",
        "tests/test_faults.py::on_the_cluster",
    ]
    # The pipelines start with the first test; the container run with the first waiting one.
    assert conftest._pipelines_start["first"].nodeid == "tests/test_buffers.py::fast"
    assert conftest._beside_the_waiting["first"].nodeid == "tests/test_faults.py::rank"
    assert conftest._beside_the_waiting["container"].nodeid.startswith("tests/test_container")


def test_a_session_without_pipelines_or_containers_keeps_its_order(fresh_state):
    """`make test-fast`, `pytest tests/test_faults.py`: nothing moves and nothing starts."""
    items = [
        _Item("tests/test_faults.py::rank", ("mpi",)),
        _Item("tests/test_faults.py::fast"),
        _Item("tests/test_spark_run.py::run", ("spark", "mpi")),
    ]
    assert _order(items) == [
        "tests/test_faults.py::rank",
        "tests/test_faults.py::fast",
        "tests/test_spark_run.py::run",
    ]
    assert conftest._pipelines_start == {} and conftest._beside_the_waiting == {}
