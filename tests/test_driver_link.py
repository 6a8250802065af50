"""The driver link between a ``DriverServer`` and ``DriverLink``s on loopback (what the Spark
tasks of one barrier stage do, without Spark): its rendezvous rounds, large results, and
what it does with connections that have not proved the run's secret."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flyte_hvd.launch import messages
from flyte_hvd.stage import driver_link
from flyte_hvd.stage.driver_link import (
    HELLO_TIMEOUT_S,
    TASK_ROLE,
    DriverLink,
    DriverServer,
    _proof,
    max_connections,
)
from flyte_hvd.stage.rdd_stage import ClassicBackend

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


# -- before a connection proves the secret --------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _challenge(sock: socket.socket) -> str:
    """The nonce of the server's first line on ``sock``."""
    line = sock.makefile("rb").readline()
    return json.loads(line)["nonce"]


def _hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (reading what it sent)."""
    sock.settimeout(within)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _hello(rank: int, proof: str) -> bytes:
    return json.dumps(messages.link_hello(TASK_ROLE, rank, proof)).encode() + b"\n"


def _out(rank: int, text: str) -> bytes:
    data = base64.b64encode(text.encode()).decode()
    return json.dumps(messages.output(rank, "stdout", data)).encode() + b"\n"


@pytest.fixture
def shown():
    """A server whose ranks' output is shown in a string, with what it showed."""
    out = io.StringIO()
    server = DriverServer("127.0.0.1", SECRET, 2, stdout=out)
    yield server, out
    server.close()


def test_an_observed_handshake_cannot_be_replayed(shown):
    server, out = shown
    # A task's handshake, as someone watching the network sees it: its nonce and proof.
    task = socket.create_connection(server.address)
    nonce = _challenge(task)
    observed = _proof(SECRET, nonce, TASK_ROLE, 0)
    task.sendall(_hello(0, observed) + _out(0, "from the task"))
    # The observer replays it on a connection of its own: the server's nonce there differs.
    replay = socket.create_connection(server.address)
    assert _challenge(replay) != nonce
    replay.sendall(_hello(0, observed) + _out(0, "INJECTED"))
    assert _hung_up(replay, within=5)
    # Neither is a proof for another role or rank on the task's own nonce.
    for rank, role in ((1, TASK_ROLE), (0, "result")):
        other = socket.create_connection(server.address)
        other_nonce = _challenge(other)
        assert _proof(SECRET, other_nonce, role, rank) != _proof(SECRET, other_nonce, TASK_ROLE, 0)
        other.close()
    task.close()
    server.close()
    assert "[0]<stdout>:from the task" in out.getvalue()
    assert "INJECTED" not in out.getvalue()


def test_an_unauthenticated_line_is_cut_at_a_few_kb_without_memory_growth(server):
    chunk = b"x" * (1 << 20)  # no newline anywhere
    before = _rss_bytes()
    stranger = socket.create_connection(server.address)
    started = time.monotonic()
    sent = 0
    with pytest.raises(OSError):  # the server hangs up long before 300 MB
        while sent < 300 << 20:
            stranger.sendall(chunk)
            sent += len(chunk)
    took = time.monotonic() - started
    growth = _rss_bytes() - before
    print(f"\nunauthenticated line: hung up after {sent >> 20} MiB sent in {took:.2f}s, "
          f"driver RSS +{growth >> 20} MiB")  # fmt: skip
    assert sent < 64 << 20  # what the kernel's buffers took before the reset
    assert growth < 16 << 20
    assert took < HELLO_TIMEOUT_S
    stranger.close()


def test_idle_connections_beyond_the_cap_are_refused_and_the_rest_dropped(monkeypatch):
    monkeypatch.setattr(driver_link, "HELLO_TIMEOUT_S", 1.0)
    server = DriverServer("127.0.0.1", SECRET, 2)
    threads_before = threading.active_count()
    cap = max_connections(2)
    idle = [socket.create_connection(server.address) for _ in range(cap)]
    for sock in idle:
        _challenge(sock)  # each was taken and challenged
    assert threading.active_count() <= threads_before + cap
    extra = socket.create_connection(server.address)
    assert extra.recv(1024) == b""  # hung up on, not challenged
    started = time.monotonic()
    assert all(_hung_up(sock, within=5) for sock in idle)  # silent past the hello deadline
    took = time.monotonic() - started
    print(f"\n{cap} idle connections dropped {took:.1f}s after the hello deadline")
    assert took < 3
    # The run's tasks still get in.
    links = _links(server)
    assert _round(links, 0, ["a", "b"]) == [["a", "b"]] * 2
    for link in links:
        link.close()
    for sock in [*idle, extra]:
        sock.close()
    server.close()


def test_malformed_messages_are_dropped_with_one_debug_line_and_no_traceback(shown, caplog, capsys):
    server, out = shown
    task = socket.create_connection(server.address)
    nonce = _challenge(task)
    malformed = [b"[1, 2]", b'"text"', b"not json", b'{"kind": "out", "rank": 0}',
                 b'{"kind": "gather", "rank": 0, "round": "x", "value": 1}']  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="flyte_hvd"):
        task.sendall(_hello(0, _proof(SECRET, nonce, TASK_ROLE, 0)))
        task.sendall(b"\n".join(malformed) + b"\n" + _out(0, "still served"))
        task.close()
        server.close()  # once the server has read all the task sent
    assert "[0]<stdout>:still served" in out.getvalue()
    dropped = [r for r in caplog.records if r.getMessage().startswith("driver link: dropped")]
    assert len(dropped) == len(malformed), [r.getMessage() for r in dropped]
    assert all(r.levelno == logging.DEBUG and r.exc_info is None for r in dropped)
    assert "Traceback" not in capsys.readouterr().err


def test_a_non_object_hello_is_hung_up_on_quietly(server, caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="flyte_hvd"):
        stranger = socket.create_connection(server.address)
        _challenge(stranger)
        stranger.sendall(b"[1, 2, 3]\n")
        assert _hung_up(stranger, within=5)
    assert any("not a JSON object" in r.getMessage() for r in caplog.records)
    assert "Traceback" not in capsys.readouterr().err


def test_a_large_result_travels_over_the_link_into_a_driver_file(server, tmp_path):
    payload = tmp_path / "result.pkl"
    payload.write_bytes(os.urandom(3 << 20))
    link = DriverLink(server.address, SECRET, 1)
    result_id = link.send_result(str(payload))
    with open(server.result_path(result_id), "rb") as f:
        assert f.read() == payload.read_bytes()
    link.close()
    kept = server.result_path(result_id)
    server.close()
    assert not os.path.exists(kept)  # the run's end removes what it did not load
    with pytest.raises(RuntimeError, match="holds no such result"):
        server.result_path("unknown")


def test_a_result_above_the_servers_limit_is_refused(tmp_path):
    server = DriverServer("127.0.0.1", SECRET, 2, max_result_bytes=1000)
    payload = tmp_path / "result.pkl"
    payload.write_bytes(b"x" * 1001)
    link = DriverLink(server.address, SECRET, 0)
    with pytest.raises(ConnectionError, match=r"did not confirm|could not be sent"):
        link.send_result(str(payload))
    link.close()
    server.close()


@pytest.mark.parametrize(
    "master, where",
    [("local", "127.0.0.1"), ("local[2]", "127.0.0.1"), ("local[*, 3]", "127.0.0.1"),
     ("local-cluster[2,1,1024]", "127.0.0.1"), ("spark://head:7077", "192.0.2.7")],
)  # fmt: skip
def test_the_link_listens_on_loopback_for_local_masters(master, where):
    class Context:  # the two members of a SparkContext that `link_host` reads
        def __init__(self):
            self.master = master

        def getConf(self):
            return {"spark.driver.host": "192.0.2.7"}

    assert ClassicBackend(Context()).link_host() == where  # type: ignore[arg-type]
