"""The driver link's rendezvous rounds, between a ``DriverServer`` and ``DriverLink``s on
loopback (what the Spark tasks of one barrier stage do, without Spark)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flyte_hvd.spark.driver_link import DriverLink, DriverServer

SECRET = "s3cret"


@pytest.fixture
def server():
    server = DriverServer("127.0.0.1", SECRET, 2)
    yield server
    server.close()


def _links(server: DriverServer, n: int = 2) -> list[DriverLink]:
    return [DriverLink(server.address, SECRET, rank) for rank in range(n)]


def _round(links: list[DriverLink], round_: int, values: list[str]) -> list[list[str]]:
    """Every link sends its value for ``round_`` at once (the last rank first); what each got."""
    with ThreadPoolExecutor(len(links)) as pool:
        answers = [
            pool.submit(link.all_gather, round_, value, threading.Event())
            for link, value in reversed(list(zip(links, values, strict=True)))
        ]
        return [answer.result(timeout=10) for answer in reversed(answers)]


def _until_connected(server: DriverServer, n: int) -> None:
    """Until the server has taken ``n`` task connections."""
    deadline = time.monotonic() + 10
    while len(server._conns) < n:
        assert time.monotonic() < deadline, "the server never took the connection"
        time.sleep(0.01)


def _until_waiting(server: DriverServer) -> None:
    """Until the server holds a task's value for an unfinished round."""
    deadline = time.monotonic() + 10
    while not server._gathers:
        assert time.monotonic() < deadline, "the task's value never reached the server"
        time.sleep(0.01)


def test_a_round_answers_every_task_in_rank_order(server):
    links = _links(server)
    # Rank 1 arrives first: the answer is still in rank order.
    assert _round(links, 0, ["port-a", "port-b"]) == [["port-a", "port-b"]] * 2
    assert _round(links, 1, ["x", "y"]) == [["x", "y"]] * 2  # the next round is a new one
    for link in links:
        link.close()


def test_a_failed_rank_aborts_the_waiting_round_and_its_stage_attempt(server):
    links = _links(server)
    never = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(links[0].all_gather, 0, "port-a", never)
        _until_waiting(server)
        assert links[1].failed("Traceback ...\nValueError: boom") is False  # no on_failure
        with pytest.raises(RuntimeError, match="rendezvous aborted: rank 1 failed"):
            waiting.result(timeout=10)
    # A task of the failed attempt cannot start a round that the retry's tasks would join.
    with pytest.raises(RuntimeError, match="this stage attempt has failed"):
        links[0].all_gather(1, "stale", never)
    retry = _links(server)
    assert _round(retry, 0, ["new-a", "new-b"]) == [["new-a", "new-b"]] * 2
    for link in links + retry:
        link.close()


def test_a_lost_task_aborts_the_round(server):
    links = _links(server)
    never = threading.Event()
    assert _round(links, 0, ["port-a", "port-b"]) == [["port-a", "port-b"]] * 2
    with ThreadPoolExecutor(1) as pool:
        # Rank 1's task is lost while rank 0 waits in the next round.
        waiting = pool.submit(links[0].all_gather, 1, "x", never)
        _until_waiting(server)
        links[1].close()
        with pytest.raises(RuntimeError, match="rendezvous aborted: a task's link to the driver"):
            waiting.result(timeout=10)
    links[0].close()


def test_a_task_stops_waiting_when_its_supervisor_aborts(server):
    link = _links(server, 1)[0]
    aborted = threading.Event()
    threading.Timer(0.3, aborted.set).start()
    with pytest.raises(RuntimeError, match="rendezvous aborted"):
        link.all_gather(0, "port-a", aborted)
    link.close()


def test_a_task_whose_driver_went_away_is_told_so():
    server = DriverServer("127.0.0.1", SECRET, 2)
    link = DriverLink(server.address, SECRET, 0)
    link.on_lost = link.close  # as a task does: stop, then hang up
    server.close()  # waits for the task to hang up
    with pytest.raises(RuntimeError, match="lost the connection to the Spark driver"):
        link.all_gather(0, "port-a", threading.Event())
    assert link.failed("Traceback ...") is False  # no verdict wait once the link is lost
    link.close()


def test_a_stranger_without_the_secret_is_never_answered(server):
    stranger = DriverLink(server.address, "wrong", 0)
    member = DriverLink(server.address, SECRET, 1)
    never = threading.Event()
    with pytest.raises(RuntimeError, match="lost the connection"):
        stranger.all_gather(0, "fake-port", never)  # the server hangs up on it
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(member.all_gather, 0, "port-b", never)
        rank0 = DriverLink(server.address, SECRET, 0)
        assert rank0.all_gather(0, "port-a", never) == ["port-a", "port-b"]
        assert waiting.result(timeout=10) == ["port-a", "port-b"]
    for link in (stranger, member, rank0):
        link.close()


def test_a_task_hears_when_the_driver_ends_the_link_first(server):
    lost = threading.Event()
    link = DriverLink(server.address, SECRET, 0)
    link.on_lost = lambda: (lost.set(), link.close())  # a task stops its ranks, hangs up
    _until_connected(server, 1)
    started = time.monotonic()
    server.close()  # a failed run's driver: the task still runs
    assert lost.is_set()  # close() waited for the task to hang up ...
    assert time.monotonic() - started < 5  # ... not for its time limit


def test_a_task_that_connects_as_the_run_ends_is_hung_up_on(server):
    """The driver may close while a task's connection waits to be accepted."""
    links = []
    for rank in range(20):  # some connect before close() and some race it
        link = DriverLink(server.address, SECRET, rank % 2)
        link.on_lost = link.close  # as a task does: stop, then hang up
        links.append(link)
    server.close()
    for link in links:
        with pytest.raises(RuntimeError, match="lost the connection"):
            link.all_gather(0, "port", threading.Event())
        link.close()


def test_a_task_closing_its_own_link_is_not_a_lost_driver(server):
    lost = threading.Event()
    link = DriverLink(server.address, SECRET, 0)
    link.on_lost = lost.set
    link.close()
    assert not lost.wait(0.5)
