"""Rank output is bytes: any character, any amount, on every launch path, never kills a rank.

Every launch path runs the same printer on 2 ranks: non-ASCII text, invalid UTF-8, a 10 MB
line, 100 ``\\r`` redraws, stderr, and a last line without a newline. The run must succeed and
the user must see each; a failing variant checks that the full-output file holds the bytes.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time

import cloudpickle
import pytest

from flyte_hvd.core.errors import RanksFailedError
from flyte_hvd.launch.output import (
    PIECE_BYTES,
    ConsoleSink,
    LineSplitter,
    OutputLog,
    RankOutput,
    Spool,
    copy_without_notices,
    import_notices_dropped,
    render,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TEXT = "café ━━━ °C → 🙂"
INVALID = b"\xff\xfe bad utf-8"
LONG = 10 << 20
REDRAWS = 100


def printer(fail: bool = False):
    """A rank function that prints everything a user's code may print."""

    def fn():
        import sys

        import flyte_hvd.core as hvd

        hvd.init()
        out = sys.stdout
        out.write(TEXT + "\n")
        out.flush()
        out.buffer.write(INVALID + b"\n")
        out.buffer.flush()
        out.write("L" * LONG + "\n")
        for i in range(REDRAWS):
            out.write(f"\rredraw {i + 1}/{REDRAWS}")
            out.flush()
        out.write("\n")
        print(f"stderr {TEXT}", file=sys.stderr)
        out.write(f"tail of rank {hvd.rank()}")  # no newline
        out.flush()
        if fail and hvd.rank() == 1:
            raise ValueError("failing after printing")
        return hvd.rank()

    return fn


def assert_shown(text: str, ranks=(0, 1)) -> None:
    """What the user sees: each rank's lines, decoded for display."""
    lines = text.splitlines()
    for r in ranks:
        mine = [line for line in lines if line.startswith((f"[{r}]<stdout>:", f"[{r}]<stderr>:"))]
        assert f"[{r}]<stdout>:{TEXT}" in mine
        assert f"[{r}]<stdout>:\\xff\\xfe bad utf-8" in mine
        assert f"[{r}]<stderr>:stderr {TEXT}" in mine
        assert f"[{r}]<stdout>:tail of rank {r}" in mine
        long_pieces = [line for line in mine if line.startswith(f"[{r}]<stdout>:LLLL")]
        assert sum(len(line) - len(f"[{r}]<stdout>:") for line in long_pieces) == LONG
        assert len(long_pieces) == LONG // PIECE_BYTES
        redraws = [line for line in mine if "redraw" in line]
        assert redraws[-1] == f"[{r}]<stdout>:redraw {REDRAWS}/{REDRAWS}"
        assert len(redraws) < 5  # the last state, not one line per redraw


def logged_lines(path: str, rank: int, stream: str = "stdout") -> list[bytes]:
    """A rank's lines in the full-output file, pieces of long lines joined again."""
    first, more = f"[{rank}]<{stream}>:".encode(), f"[{rank}]<{stream}>+".encode()
    lines: list[bytes] = []
    with open(path, "rb") as f:
        for line in f.read().split(b"\n"):
            if line.startswith(first):
                lines.append(line[len(first) :])
            elif line.startswith(more):
                lines[-1] += line[len(more) :]
    return lines


def assert_logged(path: str, ranks=(0, 1)) -> None:
    """The full-output file holds each rank's bytes exactly as written."""
    redraw = b"".join(f"\rredraw {i + 1}/{REDRAWS}".encode() for i in range(REDRAWS))
    for r in ranks:
        lines = logged_lines(path, r)
        assert lines[:4] == [TEXT.encode(), INVALID, b"L" * LONG, redraw]
        assert f"tail of rank {r}".encode() in lines
        assert f"stderr {TEXT}".encode() in logged_lines(path, r, "stderr")


# -- the pieces --------------------------------------------------------------------------------


def test_splitter_cuts_lines_and_long_lines_between_characters():
    splitter = LineSplitter(piece_bytes=8)
    assert splitter.feed(b"ab\ncd") == [(b"ab", False)]
    assert splitter.pending == b"cd"
    # 9 bytes of "é" (2 bytes each) and more: cut at 8, never inside a character
    pieces = splitter.feed("éééééé\n".encode())
    assert pieces == [("cdééé".encode(), False), ("ééé".encode(), True)]
    assert all(p.decode() for p, _ in pieces)
    assert splitter.feed(b"x" * 20) == [(b"x" * 8, False), (b"x" * 8, True)]
    assert splitter.flush() == [(b"xxxx", True)]
    assert splitter.flush() == []


def test_render_shows_what_a_terminal_shows():
    assert render(b"\r1/3\r2/3\r3/3") == "3/3"
    assert render(b"done\r\n"[:-1]) == "done"  # a \r\n line ending
    assert render(b"abc\b\bX") == "aX"
    assert render("━━━\b\b\b\r━━━━".encode()) == "━━━━"
    assert render(b"\xff\xfeok") == "\\xff\\xfeok"
    assert render(b"") == ""


def test_spool_keeps_order_past_memory_and_never_blocks():
    spool = Spool(memory_bytes=100)
    records = [(i % 3, bytes([i % 256]) * (i % 70)) for i in range(300)]
    for tag, data in records:
        spool.put(tag, data)
    assert spool.spilled_bytes > 0
    spool.close()
    got = []
    while (batch := spool.get(timeout=1)) is not None:
        got.extend(batch)
    assert got == records
    # once caught up, records are held in memory again
    spool = Spool(memory_bytes=10)
    spool.put(0, b"x" * 20)
    assert spool.get(timeout=1) == [(0, b"x" * 20)]
    spool.put(1, b"y")
    assert spool.get(timeout=1) == [(1, b"y")] and spool.spilled_bytes == 20
    assert spool.get(timeout=0.01) == []


def test_console_sink_escapes_what_the_console_cannot_encode():
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii")
    sink = ConsoleSink(stdout=ascii_out)
    sink(0, "stdout", TEXT)
    sink.flush()
    escaped = b"caf\\xe9 \\u2501\\u2501\\u2501 \\xb0C \\u2192 \\U0001f642"
    assert raw.getvalue() == b"[0]<stdout>:" + escaped + b"\n"


def test_output_log_is_a_file_only_when_kept():
    log = OutputLog()
    log.write_lines(0, "stdout", [(b"\xff", False), (b"more", True)])
    log.write(1, "stderr", "Traceback\n  boom")
    path = log.close(keep=True)
    assert path is not None and os.path.exists(path)
    with open(path, "rb") as f:
        assert f.read() == (
            b"[0]<stdout>:\xff\n[0]<stdout>+more\n[1]<stderr>:Traceback\n[1]<stderr>:  boom\n"
        )
    os.remove(path)
    assert OutputLog().close(keep=False) is None


def test_a_stuck_console_neither_blocks_the_writer_nor_loses_output():
    """The display waits on a console that does not take lines; the writer goes on at once,
    every byte is in the log, and the console gets every line once it moves again."""
    release = threading.Event()
    shown: list[str] = []

    def stuck(rank, stream, line):
        release.wait()
        shown.append(line)

    output = RankOutput(display=stuck)
    started = time.monotonic()
    for i in range(20_000):
        output.write(0, "stdout", f"line {i} {'x' * 1000}\n".encode())
    assert time.monotonic() - started < 10
    release.set()
    path = output.close(keep=True)
    assert len(shown) == 20_000 and shown[-1].startswith("line 19999 ")
    assert len(logged_lines(path, 0)) == 20_000
    os.remove(path)


def test_progress_redraws_show_their_state_at_most_once_per_interval():
    shown: list[str] = []
    output = RankOutput(display=lambda rank, stream, line: shown.append(line), interval=0.2)
    for i in range(30):
        output.write(0, "stderr", f"\r{i}%".encode())
        time.sleep(0.02)
    output.write(0, "stderr", b"\rdone\n")
    output.close(keep=False)
    assert shown[-1] == "done"
    assert 1 <= len(shown) - 1 <= 4  # interim states, about one per 0.2 s of 0.6 s


def test_tensorflows_import_notices_stay_in_the_log_and_off_the_console():
    notices = [
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        b"I0000 00:00:1795869725.453596   32408 port.cc:153] oneDNN custom operations are on. "
        b"You may see slightly different numerical results due to floating-point round-off.",
    ]
    # A user's line that mentions them, or a notice that is only part of a line, is shown.
    kept = [
        b"my WARNING: All log messages before absl::InitializeLog() is called are written",
        b"oneDNN custom operations are on. (quoted by the user)",
        b"Epoch 1/5",
    ]
    shown: list[str] = []
    output = RankOutput(display=lambda rank, stream, line: shown.append(line))
    for line in notices + kept:
        output.write(1, "stderr", line + b"\n")
    path = output.close(keep=True)
    assert shown == [line.decode() for line in kept]
    assert logged_lines(path, 1, "stderr") == notices + kept
    os.remove(path)


_NOTICES = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"I0000 00:00:1795869725.453596   32408 port.cc:153] oneDNN custom operations are on. "
    b"You may see slightly different numerical results due to floating-point round-off.",
]


def test_copying_a_stream_drops_the_notices_and_keeps_every_other_byte():
    read_end, write_end = os.pipe()
    out_read, out_write = os.pipe()
    kept = b"first\n\xff not utf-8\nmy oneDNN custom operations are on. (quoted)\n" + b"x" * 70000
    os.write(write_end, _NOTICES[0] + b"\nfirst\n\xff not utf-8\n" + _NOTICES[1] + b"\n")
    writer = threading.Thread(
        target=lambda: (
            os.write(write_end, b"my oneDNN custom operations are on. (quoted)\n" + b"x" * 70000),
            os.close(write_end),
        )
    )
    writer.start()
    copier = threading.Thread(target=copy_without_notices, args=(read_end, out_write))
    got: list[bytes] = []
    reader = threading.Thread(
        target=lambda: got.extend(iter(lambda: os.read(out_read, 1 << 16), b""))
    )
    for thread in (copier, reader):
        thread.start()
    copier.join(10)
    writer.join(10)
    os.close(out_write)
    reader.join(10)
    assert not copier.is_alive() and not reader.is_alive()
    assert b"".join(got) == kept  # the last line has no newline: passed on as it is


def _copied(chunks: list[bytes]) -> bytes:
    """What ``copy_without_notices`` passes on of ``chunks`` written one after the other."""
    read_end, write_end = os.pipe()
    out_read, out_write = os.pipe()
    copier = threading.Thread(target=copy_without_notices, args=(read_end, out_write))
    copier.start()
    for chunk in chunks:
        os.write(write_end, chunk)
    os.close(write_end)
    copier.join(10)
    assert not copier.is_alive()
    os.close(out_write)
    with os.fdopen(out_read, "rb") as out:
        return out.read()


_DAEMON = "/venv/lib/python3.12/site-packages/pyspark/daemon.py"
_BROKEN_PIPE = (
    b"Traceback (most recent call last):\n"
    + f'  File "{_DAEMON}", line 264, in manager\n'.encode()
    + b"    code = worker(sock, authenticated)\n"
    + b"           ^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    + f'  File "{_DAEMON}", line 95, in worker\n'.encode()
    + b"    outfile.flush()\n"
    + b"BrokenPipeError: [Errno 32] Broken pipe\n"
)


def test_a_spark_workers_closed_connection_traceback_is_dropped_and_any_other_kept():
    other_error = _BROKEN_PIPE.replace(b"BrokenPipeError: [Errno 32] Broken pipe", b"KeyError: 1")
    user_frame = _BROKEN_PIPE.replace(_DAEMON.encode(), b"/home/me/job.py", 1)
    unfinished = b"Traceback (most recent call last):\n" + f'  File "{_DAEMON}"'.encode()
    # cut anywhere, between tracebacks and lines that are not theirs
    stream = b"before\n" + _BROKEN_PIPE + other_error + user_frame + _BROKEN_PIPE + b"after\n"
    chunks = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    assert _copied(chunks) == b"before\n" + other_error + user_frame + b"after\n"
    # a traceback that another traceback or the end of the stream interrupts is passed on
    assert _copied([unfinished + b"\n" + _BROKEN_PIPE]) == unfinished + b"\n"
    assert _copied([b"x\n" + unfinished]) == b"x\n" + unfinished
    deep = _BROKEN_PIPE.replace(b"    outfile.flush()\n", b"    outfile.flush()\n" * 300)
    assert _copied([deep]) == deep


def test_an_import_inside_the_block_prints_no_notices_and_the_rest_reaches_stderr(capfd):
    with import_notices_dropped():
        os.write(2, _NOTICES[0] + b"\n" + b"a line of the import\n" + _NOTICES[1] + b"\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "a line of the import\nafter\n"


# -- every launch path -------------------------------------------------------------------------


@pytest.mark.mpi
def test_flyte_hvd_run_forwards_any_bytes(cli, tmp_path):
    script = tmp_path / "printer.py"
    script.write_text(
        f"import cloudpickle, sys\nfn = cloudpickle.loads({cloudpickle.dumps(printer())!r})\nfn()\n"
    )
    result = cli("-np", "2", sys.executable, str(script), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_shown(result.stdout + result.stderr)


@pytest.mark.mpi
def test_flyte_hvd_run_failure_keeps_the_exact_bytes(cli, tmp_path):
    script = tmp_path / "printer.py"
    script.write_text(
        "import cloudpickle, sys\n"
        f"fn = cloudpickle.loads({cloudpickle.dumps(printer(fail=True))!r})\n"
        "fn()\n"
    )
    result = cli("-np", "2", sys.executable, str(script), timeout=120)
    assert result.returncode == 1
    assert "ValueError: failing after printing" in result.stderr
    path = result.stderr.split("full output of every rank: ")[1].split()[0]
    try:
        assert_logged(path)
    finally:
        os.remove(path)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [-2])
def test_horovod_runner_local_forwards_any_bytes(capfd, np_):
    from flyte_hvd.spark import HorovodRunner

    assert HorovodRunner(np=np_).run(printer()) == 0
    captured = capfd.readouterr()
    assert_shown(captured.out + captured.err)
    with pytest.raises(RanksFailedError, match="failing after printing") as info:
        HorovodRunner(np=np_).run(printer(fail=True))
    try:
        assert_logged(info.value.output_log)
    finally:
        os.remove(info.value.output_log)


@pytest.mark.spark
@pytest.mark.mpi
def test_spark_run_forwards_any_bytes(spark):
    from flyte_hvd.spark import run

    out, err = io.StringIO(), io.StringIO()
    assert run(printer(), num_proc=2, stdout=out, stderr=err, verbose=0) == [0, 1]
    assert_shown(out.getvalue() + err.getvalue())
    with pytest.raises(RanksFailedError, match="failing after printing") as info:
        run(printer(fail=True), num_proc=2, stdout=io.StringIO(), stderr=io.StringIO())
    try:
        assert_logged(info.value.output_log)
    finally:
        os.remove(info.value.output_log)


@pytest.mark.spark
@pytest.mark.mpi
def test_horovod_runner_on_spark_forwards_any_bytes(spark_local2, capfd):
    from flyte_hvd.spark import HorovodRunner

    assert HorovodRunner(np=2).run(printer()) == 0
    captured = capfd.readouterr()
    assert_shown(captured.out + captured.err)


@pytest.mark.spark
@pytest.mark.mpi
def test_spare_rank_processes_forward_any_bytes(spark_local2):
    """A run with preloaded modules leaves spares; the next run's ranks are those spares, and
    their output takes the same path."""
    from flyte_hvd.stage.dispatch import launch

    def first():
        import flyte_hvd.core as hvd

        hvd.init()
        return os.getpid()

    report = launch(first, num_proc=2, verbose=0, preload=("json",))
    out, err = io.StringIO(), io.StringIO()
    again = launch(printer(), num_proc=2, stdout=out, stderr=err, verbose=0, preload=("json",))
    assert again.results == [0, 1]
    assert all("spare_claimed" in again.events[r] for r in (0, 1)), again.events
    assert_shown(out.getvalue() + err.getvalue())
    assert len(set(report.results)) == 2


@pytest.mark.spark
@pytest.mark.mpi
def test_a_rank_printing_fast_is_not_slowed_by_a_slow_console(spark_local2):
    """50 MB printed as fast as a rank can, to a console that takes 1 ms a line: the rank is
    done long before the console, and every line arrives."""
    from flyte_hvd.spark import run

    class SlowConsole(io.StringIO):
        def write(self, text):
            time.sleep(0.001)
            return super().write(text)

    def flood():
        import time

        started = time.monotonic()
        line = "y" * 1023 + "\n"
        for _ in range(2000):
            print(line, end="")
        return time.monotonic() - started

    out = SlowConsole()
    started = time.monotonic()
    [took] = run(flood, num_proc=1, stdout=out, stderr=io.StringIO(), verbose=0)
    assert took < 1.0  # 2000 lines at 1 ms each would take 2 s if the rank waited
    assert time.monotonic() - started >= 2.0
    assert out.getvalue().count("[0]<stdout>:yyy") == 2000
