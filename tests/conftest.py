"""Shared fixtures. Heavy ones (rank processes, Spark) are session-scoped and named after
what they start."""

from __future__ import annotations

import atexit
import contextlib
import gc
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from needs import require

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Spark's Python workers must be this interpreter (the venv with flyte_hvd, mpi4py, mpich).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
# Every process this test session starts (Spark's JVMs, their Python workers, the ranks)
# inherits this marker, so the leftover check below ignores other test runs on the machine.
_SESSION_MARKER = f"FLYTE_HVD_TEST_SESSION={os.getpid()}"
os.environ["FLYTE_HVD_TEST_SESSION"] = str(os.getpid())
# gcsfs asks a bucket's layout over gRPC before using it (waiting 60 s for an answer); the
# Cloud Storage emulator serves only the JSON API. Set before anything imports gcsfs, and
# inherited by Spark's workers and the ranks.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _suite_spark_defaults() -> tuple[str, str]:
    """The properties file of the suite's Spark JVMs and its driver's JVM options:
    tests/spark-defaults.conf (the JIT's first tier: short jobs on small data; see the file)
    and, once made, the class-data archive of Spark's classes (tests/spark_class_archive.py: a
    JVM starts in half the time), which the project venv's run makes where it is missing (about
    40 s, once per Spark installation; `make test` makes it beside its first steps)."""
    import spark_class_archive

    defaults = os.path.join(REPO, "tests", "spark-defaults.conf")
    with open(defaults) as f:
        text = f.read()
    archive = spark_class_archive.existing()
    fast = os.environ.get("FLYTE_HVD_TEST_FAST")  # `make test-fast`: no Spark to start
    if archive is None and not fast and sys.prefix == os.path.join(REPO, ".venv"):
        archive = spark_class_archive.build(Path(defaults))
    if archive is not None:
        # A JVM that cannot use the archive (another class path) starts without it, and says
        # so on its stdout unless its CDS warnings are off.
        option = f"-XX:SharedArchiveFile={archive} -Xlog:cds=off,cds+dynamic=off"
        java_options = r"^(spark\.(driver|executor)\.defaultJavaOptions .*)$"
        text = re.sub(java_options, rf"\1 {option}", text, flags=re.M)
        session = archive.with_suffix(".conf")
        if not session.exists() or session.read_text() != text:
            partial = session.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(text)
            partial.rename(session)  # other runs of the suite read it whole
        defaults = str(session)
    driver = re.search(r"^spark\.driver\.defaultJavaOptions\s+(.*)$", text, re.M)
    return defaults, driver.group(1).strip() if driver else ""


# Spark's defaults for the JVMs the suite starts here and in the pipelines it runs as
# subprocesses, as a properties file: the archive needs Spark's conf folder (on the JVM's class
# path) missing or empty, so no SPARK_CONF_DIR of the suite's own.
if "PYSPARK_SUBMIT_ARGS" not in os.environ:
    _SPARK_DEFAULTS, _DRIVER_OPTIONS = _suite_spark_defaults()
    os.environ["PYSPARK_SUBMIT_ARGS"] = f"--properties-file {_SPARK_DEFAULTS} pyspark-shell"
    # Drivers that spark-submit starts itself (the image's entrypoint in driver mode) read no
    # PYSPARK_SUBMIT_ARGS: the driver's options reach them in SPARK_SUBMIT_OPTS.
    os.environ.setdefault("SPARK_SUBMIT_OPTS", _DRIVER_OPTIONS)


def _ours(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return _SESSION_MARKER.encode() in f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def rank_processes() -> list[str]:
    """Command lines of rank processes (and their mpiexec) this test session started; idle
    spare rank processes (``flyte_hvd.launch.spare``), which outlive runs by design, are not
    counted: a spare that was handed a rank has removed its folder and counts again."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if ("flyte_hvd.launch.bootstrap" in line or "hydra_pmi_proxy" in line or "mpiexec" in line)
        and _ours(line.split()[0])
        and not idle_spare(line.split()[0])
    ]


def idle_spares(module: str) -> set[int]:
    """Pids of this session's idle spare rank processes (not their mpiexec) that preload
    ``module``."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or not _ours(pid) or not idle_spare(pid):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            is_rank = b"flyte_hvd.launch.bootstrap" in argv and b"mpiexec" not in argv[0]
        except OSError:
            continue
        preload = env.get(b"FLYTE_HVD_SPARE_PRELOAD", b"").decode().split(",")
        if is_rank and module in preload:
            found.add(int(pid))
    return found


def idle_spare(pid: str) -> bool:
    """Whether ``pid`` is an idle spare rank process or its mpiexec: its folder is still there
    (made before the spare starts, so a spare still starting counts as idle too; removed once
    it takes a rank or stops)."""
    from flyte_hvd.launch.spare import SPARE_ENV

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return False
    prefix = f"{SPARE_ENV}=".encode()
    paths = [e[len(prefix) :].decode() for e in entries if e.startswith(prefix)]
    return bool(paths) and os.path.isdir(os.path.dirname(paths[0]))


def partition_leftovers() -> list[str]:
    """Partition folders of data stages (``flyte-hvd-partition-*``) left anywhere under the
    temp folder, where executors keep their scratch space; copies that tests keep in their own
    ``tmp_path`` do not count."""
    pattern = os.path.join(tempfile.gettempdir(), "**", "flyte-hvd-partition-*")
    return [p for p in glob.glob(pattern, recursive=True) if "pytest-of-" not in p]


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if it leaves a rank process or mpiexec behind."""
    before = set(rank_processes())
    yield
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = set(rank_processes()) - before
        if not left:
            return
        time.sleep(0.1)
    pytest.fail(f"rank processes outlived the run: {sorted(left)}")


@pytest.fixture
def cli():
    """Runs ``flyte-hvd-run`` as a user would, from the repo root."""

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        exe = os.path.join(os.path.dirname(sys.executable), "flyte-hvd-run")
        return subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
        )

    return run


# -- Spark -----------------------------------------------------------------------------------
# One SparkContext per process: the fixtures below switch between a local[2] session (most
# tests) and a local-cluster one (separate executor processes); tests that need the cluster
# run last, so each kind starts at most once.

_spark: dict = {"kind": None, "session": None, "last_test": None}


def _spark_session(kind: str, configure):
    _fail_if_the_jvm_ended()
    _spark["last_test"] = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    if _spark["kind"] != kind:
        if _spark["session"] is not None:
            _spark["session"].stop()
        from pyspark.sql import SparkSession

        from flyte_hvd.stage.flyte_task import PYTHON_WORKER_CONF

        builder = (
            SparkSession.builder.appName(f"flyte-hvd-tests-{kind}")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            # One JVM serves every Spark test: its heap held 1.7 GB live at the suite's end
            # (G1's log, 2026-12-01) where Spark's default driver heap is 1 GB, and in local
            # mode a task's OutOfMemoryError ends the whole JVM (exit 52).
            .config("spark.driver.memory", "4g")
        )
        for key, value in PYTHON_WORKER_CONF.items():  # as a HorovodSpark task's session
            builder = builder.config(key, value)
        _spark["session"] = configure(builder).getOrCreate()
        _spark["session"].sparkContext.setLogLevel("ERROR")
        _spark["kind"] = kind
    return _spark["session"]


def _fail_if_the_jvm_ended() -> None:
    """Fails the test if the shared JVM has ended (killed, crashed) since the last test that
    took it, and forgets it, so the next test starts a new one: one lost JVM costs one failed
    test with what is known of why, not every Spark test after it."""
    session = _spark["session"]
    gateway = getattr(getattr(session, "sparkContext", None), "_gateway", None)
    process = getattr(gateway, "proc", None)  # the JVM (spark-submit execs java)
    status = None if process is None else process.poll()
    if status is None:
        return
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    with contextlib.suppress(Exception):  # its accumulator server; the JVM side is gone
        session.sparkContext.stop()
    SparkContext._gateway = SparkContext._jvm = SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = SparkSession._activeSession = None
    kind, last = _spark["kind"], _spark["last_test"]
    _spark.update(kind=None, session=None)
    try:
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        kernel = ""
    killed = [line for line in kernel.splitlines() if "Killed process" in line]
    pytest.fail(
        f"the tests' {kind} Spark JVM ended with status {status} (52: a task's "
        f"OutOfMemoryError) during or after {last}; the next test starts a new one. The "
        f"kernel's last memory kills: {killed[-3:] or 'none'}",
        pytrace=False,
    )


@pytest.fixture
def spark_local2():
    """A SparkSession on local[2] (two task slots in the driver JVM)."""
    return _spark_session("local2", lambda b: b.master("local[2]"))


FAKE_GPU_SCRIPT = r"""#!/usr/bin/env bash
# Hands out one fake GPU address per caller (0, 1, ...), like a host with several GPUs.
exec 9>"$(dirname "$0")/gpus.lock"
flock 9
n=$(cat "$(dirname "$0")/gpus.next" 2>/dev/null || echo 0)
echo $((n + 1)) > "$(dirname "$0")/gpus.next"
printf '{"name": "gpu", "addresses": ["%s"]}\n' "$n"
"""


@pytest.fixture
def spark_cluster(tmp_path_factory):
    """local-cluster[2,1,1024]: two executor processes with one core and one fake GPU each;
    a failed task may be retried once."""

    def configure(builder):
        folder = tmp_path_factory.mktemp("gpus")
        script = folder / "discover_gpus.sh"
        script.write_text(FAKE_GPU_SCRIPT)
        script.chmod(0o755)
        return (
            builder.master("local-cluster[2,1,1024]")
            .config("spark.task.maxFailures", "2")
            .config("spark.worker.resource.gpu.amount", "1")
            .config("spark.worker.resource.gpu.discoveryScript", str(script))
            .config("spark.executor.resource.gpu.amount", "1")
            .config("spark.task.resource.gpu.amount", "1")
            .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        )

    return _spark_session("cluster", configure)


# What a fixture starts, and the marker a test that uses it must carry: `make test-fast`
# deselects those markers, so an unmarked test would start Spark or ranks there.
_FIXTURE_MARKERS = {
    "spark_local2": "spark", "spark_cluster": "spark", "spark": "spark",
    "spark_connect": "spark", "spark_connect_url": "spark", "cli": "mpi",
    "no_leftover_ranks": "mpi", "container_cluster": "container", "pipeline_runs": "e2e",
}  # fmt: skip


def pytest_collection_modifyitems(items):
    unmarked = [
        f"{item.nodeid} uses `{name}` but has no `{marker}` marker"
        for item in items
        for name, marker in _FIXTURE_MARKERS.items()
        if name in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that start Spark or rank processes must say so with a marker (`make "
            "test-fast` deselects them):\n  " + "\n  ".join(unmarked)
        )
    items.sort(key=lambda item: "spark_cluster" in getattr(item, "fixturenames", ()))
    _place_the_container_test_after_the_waiting_ones(items)
    _start_the_pipelines_with_the_fast_tests(items)
    for item in items:
        _heavy_markers[item.nodeid] = tuple(m for m in _MARKERS if item.get_closest_marker(m))


# -- the container run beside the tests that wait ----------------------------------------------
# The container test's run (tests/test_container_cluster.py) keeps about 1.5 of the 2 cores busy
# for 100-150 s; the tests of test_faults.py and test_spark_run.py keep about one busy (their
# ranks fail, hang or wait on deadlines). So the run starts in the background with the first of
# those tests, and its test comes right after them. Measured on this project's 2-core machine
# (2026-12-01, quiet): the two files 168 s and the container test 113 s one after the other;
# side by side the files took 207 s and the container test 170 s.
_WAITING_FILES = ("tests/test_faults.py", "tests/test_spark_run.py")
_CONTAINER_FILE = "tests/test_container_cluster.py"
_beside_the_waiting: dict[str, pytest.Item] = {}
_background_runs: list = []


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _heavy(item: pytest.Item) -> bool:
    """Whether the test starts Spark, ranks, Flyte or more (one of the markers)."""
    return any(item.get_closest_marker(m) for m in _MARKERS)


def _place_the_container_test_after_the_waiting_ones(items: list[pytest.Item]) -> None:
    # Their fast tests run with the others, first; those on the local-cluster session stay
    # last (the sort above), with their session.
    waiting = [
        i for i in items
        if _file(i) in _WAITING_FILES and _heavy(i)
        and "spark_cluster" not in getattr(i, "fixturenames", ())
    ]  # fmt: skip
    container = [i for i in items if _file(i) == _CONTAINER_FILE]
    if not waiting or not container:
        return
    moved = {id(i) for i in waiting + container}
    at = sum(1 for i in items[: items.index(waiting[0])] if id(i) not in moved)
    rest = [i for i in items if id(i) not in moved]
    items[:] = rest[:at] + waiting + container + rest[at:]
    _beside_the_waiting.update(first=waiting[0], container=container[0])


def pytest_runtest_setup(item):
    if _beside_the_waiting and item is _beside_the_waiting["first"]:
        run = _beside_the_waiting["container"].module.start_beside_other_tests()
        if run is not None:
            _background_runs.append(run)


# -- the Rossmann pipelines --------------------------------------------------------------------
# `make run`'s and `make run-flyte2`'s pipelines run once per session, side by side when the
# session's tests ask for both (tests/pipelines.py), each in a folder of its own.


# They start with the session's first test, and the tests that start no Spark, rank or Flyte
# (about a minute, mostly one core busy) run first, beside them; the pipelines' own tests
# follow, then the rest.
_pipelines_start: dict[str, pytest.Item] = {}


def _start_the_pipelines_with_the_fast_tests(items: list[pytest.Item]) -> None:
    pipelines = [i for i in items if "pipeline_runs" in getattr(i, "fixturenames", ())]
    if not pipelines:
        return
    fast = [i for i in items if not _heavy(i)]
    moved = {id(i) for i in fast + pipelines}
    items[:] = fast + pipelines + [i for i in items if id(i) not in moved]
    _pipelines_start["first"] = items[0]


@pytest.fixture(autouse=True)
def _pipelines_start_with_the_first_test(request):
    if request.node is _pipelines_start.get("first"):
        request.getfixturevalue("pipeline_runs")


@pytest.fixture(scope="session")
def pipeline_runs(request, tmp_path_factory):
    from pipelines import COMMANDS, PipelineRun

    asked = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    wanted = [name for name in COMMANDS if name in asked]
    runs = {name: PipelineRun(COMMANDS[name], tmp_path_factory.mktemp(name)) for name in wanted}
    yield runs
    for run in runs.values():
        run.stop()


# -- where the suite's time goes ---------------------------------------------------------------
# Each test's set-up, call and tear-down seconds, summed per marker (a test with several
# markers counts under each) and per file at the end of the run, and the skipped tests with
# their reasons: `make test`'s log says what the suite costs and what it left out. Per file,
# also how many of the machine's cores were busy on average while its tests ran (from
# /proc/stat, every process counted): a file far below the core count waits more than it
# computes (deadlines, sleeps, start-up on one core), where a parallel run could pay.
_MARKERS = ("spark", "mpi", "flyte", "e2e", "cluster", "container")
_heavy_markers: dict[str, tuple[str, ...]] = {}
_seconds: dict[str, float] = {}
_busy_core_seconds: dict[str, float] = {}


def _busy_seconds() -> float | None:
    """Core-seconds the whole machine has spent busy since boot (None without /proc/stat)."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _busy_seconds()
    yield
    after = _busy_seconds()
    if before is not None and after is not None:
        _busy_core_seconds[item.nodeid] = after - before


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    write = terminalreporter.write_line
    groups: dict[str, list[float]] = {}
    files: dict[str, list[float]] = {}
    busy: dict[str, float] = {}
    for nodeid, seconds in _seconds.items():
        for marker in _heavy_markers.get(nodeid) or ("(none: the fast tests)",):
            groups.setdefault(marker, []).append(seconds)
        name = nodeid.split("::")[0]
        files.setdefault(name, []).append(seconds)
        busy[name] = busy.get(name, 0.0) + _busy_core_seconds.get(nodeid, 0.0)
    terminalreporter.section("time per marker (set-up, call and tear-down)")
    write(f"{'marker':<24}{'tests':>7}{'seconds':>10}")
    for marker, times in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        write(f"{marker:<24}{len(times):>7}{sum(times):>10.0f}")
    write(f"{'all':<24}{len(_seconds):>7}{sum(_seconds.values()):>10.0f}")
    terminalreporter.section("time per file (the 15 slowest)")
    write(f"{'file':<44}{'tests':>7}{'seconds':>10}{f'busy cores of {os.cpu_count()}':>22}")
    for name, times in sorted(files.items(), key=lambda kv: -sum(kv[1]))[:15]:
        # Below a second the clock ticks of /proc/stat (1/100 s) make the ratio meaningless.
        cores = f"{busy[name] / sum(times):.2f}" if _busy_core_seconds and sum(times) >= 1 else "-"
        write(f"{name:<44}{len(times):>7}{sum(times):>10.0f}{cores:>22}")
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        reasons: dict[str, int] = {}
        for report in skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "?"
            reasons[reason] = reasons.get(reason, 0) + 1
        terminalreporter.section(f"{len(skipped)} tests skipped")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            write(f"{count:>5}  {reason}")


# Under `make test-fast` (FLYTE_HVD_TEST_FAST=1), a test that starts a rank process, a Spark
# JVM or a Flyte execution anyway fails at once, naming the marker it lacks.
_FAST = os.environ.get("FLYTE_HVD_TEST_FAST") == "1"
_HEAVY_COMMANDS = {"mpiexec": "mpi", "flyte-hvd-run": "mpi", "spark-submit": "spark",
                   "pyflyte": "flyte", "podman": "container",
                   "buildah": "container"}  # fmt: skip


@pytest.fixture(autouse=True)
def _only_light_work_in_fast_runs(request, monkeypatch):
    if not _FAST:
        yield
        return
    original = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        program = args if isinstance(args, str | bytes) else (list(args) or [""])[0]
        name = os.path.basename(os.fsdecode(program).split(" ")[0])
        for command, marker in _HEAVY_COMMANDS.items():
            if name.startswith(command):
                raise RuntimeError(
                    f"{request.node.nodeid} starts `{name}` under `make test-fast`: mark it "
                    f"`@pytest.mark.{marker}`."
                )
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield


def pytest_collection_finish(session):
    if any(_uses_connect(item) for item in session.items):  # those left after `-k`/`-m`
        _connect_server.start()  # in the background: it starts while other tests run


# A failed run keeps every rank's output in a file its error names, for its user; the tests of
# failure paths make dozens of them. The suite removes those it made when it ends.
_KEPT_OUTPUT = os.path.join(tempfile.gettempdir(), "flyte-hvd-output-*.log")
_kept_before: set[str] = set()


def pytest_sessionstart(session):
    _kept_before.update(glob.glob(_KEPT_OUTPUT))


def pytest_sessionfinish(session, exitstatus):
    for path in set(glob.glob(_KEPT_OUTPUT)) - _kept_before:
        with contextlib.suppress(OSError):
            os.remove(path)
    _within(60, "the Spark Connect server's stop", _connect_server.stop)
    for run in _background_runs:  # a session that ended before the container test's end
        _within(180, "the container run's clean-up", run.close)
    if _spark["session"] is not None:
        _within(60, "SparkSession.stop", _spark["session"].stop)


def _within(seconds: float, what: str, stop) -> None:
    """Runs ``stop`` for at most ``seconds``: a JVM that stopped answering must not hold the
    end of the suite (its process ends with this one: Spark's gateway exits when the Python
    side's pipe closes)."""
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            stop()
        except Exception as error:  # a JVM a test already took down: nothing left to stop
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        print(f"{what} at the end of the tests: no answer in {seconds:.0f} s", file=sys.stderr)
    elif errors:
        print(f"{what} at the end of the tests: {errors[0]}", file=sys.stderr)


# -- Spark Connect -----------------------------------------------------------------------------
# One Spark Connect server (local[2]) per test session, in its own process: a Connect server
# started in this process (`SparkSession.builder.remote("local[2]")`) would be a second
# SparkContext in this JVM, which the classic fixtures above already own. Clients connect
# through Connect's own builder, which leaves the classic session alone; the `spark_connect`
# fixture makes its session the active one for one test only.


def _uses_connect(item) -> bool:
    names = getattr(item, "fixturenames", ())
    params = getattr(getattr(item, "callspec", None), "params", {})
    return bool({"spark_connect", "spark_connect_url"} & set(names)) or params.get("spark") == (
        "connect"
    )


class _ConnectServer:
    def __init__(self):
        self.process = None
        self.port = None
        self.token = None
        self.session = None

    def start(self) -> None:
        if self.process is not None:
            return
        import secrets
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.token = secrets.token_hex(16)
        env = dict(os.environ, SPARK_CONNECT_AUTHENTICATE_TOKEN=self.token)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "connect_server.py"), str(self.port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
        )  # fmt: skip

    def client(self):
        """The test process's Connect session (created once)."""
        if self.session is None:
            self.start()
            line = self.process.stdout.readline()  # blocks until the server is up
            if line.strip() != "ready":
                raise RuntimeError(f"the Spark Connect test server did not start: {line!r}")
            from pyspark.sql.connect.session import SparkSession as ConnectSession

            url = f"sc://localhost:{self.port}/;token={self.token}"
            self.session = ConnectSession.builder.remote(url).getOrCreate()
        return self.session

    def stop(self) -> None:
        if self.process is None:  # never started (where Connect's packages may be missing)
            return
        if self.session is not None:
            self.session.stop()
        # Every other Connect client of this process too (the sessions Flyte tasks built on
        # this server): at exit pyspark sends each open client's cache clean-up to its server,
        # and with the server gone it retried for 10 minutes after the suite's summary.
        from pyspark.sql.connect.client.core import SparkConnectClient

        for client in [o for o in gc.get_objects() if isinstance(o, SparkConnectClient)]:
            atexit.unregister(client._on_exit)
            if not client.is_closed:
                with contextlib.suppress(Exception):
                    client.close()
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


_connect_server = _ConnectServer()


@pytest.fixture
def spark_connect(monkeypatch):
    """A Spark Connect session on a local[2] server, active for this test only. As
    `SparkSession.builder.remote(...)` does for a user, the process is in Connect mode
    meanwhile: `pyspark.sql.functions` build Connect columns."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = _connect_server.client()
    ConnectSession._set_default_and_active_session(session)
    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    yield session
    ConnectSession._active_session.session = None
    ConnectSession._default_session = None


@pytest.fixture
def spark_connect_url():
    """The URL (with its token) of the test session's Spark Connect server; whatever Connect
    session a test makes active stops being active after it."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    _connect_server.client()
    yield f"sc://localhost:{_connect_server.port}/;token={_connect_server.token}"
    ConnectSession._active_session.session = None
    ConnectSession._default_session = None


@pytest.fixture(params=["classic", "connect"])
def spark(request):
    """The Run API's tests on both kinds of session: classic local[2] and Spark Connect."""
    return request.getfixturevalue(
        "spark_local2" if request.param == "classic" else "spark_connect"
    )


# -- S3 (moto server) ------------------------------------------------------------------------
# A real S3 HTTP endpoint on 127.0.0.1 (moto's server mode, in a thread of this process) with
# authentication on: the fixture's access key works, any other key or secret is refused, as on
# AWS. Tests talk to it through s3fs/boto3 with `endpoint_url`; nothing is mocked.

S3_BUCKET = "flyte-hvd-test"


class S3Server:
    """Where the test S3 endpoint is and how to sign in to it."""

    protocol = "s3"

    def __init__(self, endpoint_url: str, key: str, secret: str, bucket: str):
        self.endpoint_url = endpoint_url
        self.key = key
        self.secret = secret
        self.bucket = bucket

    def storage_options(self, **overrides) -> dict:
        """fsspec/s3fs options for this endpoint (override `key`/`secret` to test failures)."""
        options = {
            "key": self.key,
            "secret": self.secret,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        options.update(overrides)
        return options

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
        )

    def list_keys(self, prefix: str) -> list[str]:
        """The object keys under ``prefix`` in the bucket, as S3's own client lists them."""
        listed = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for o in listed.get("Contents", []))


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port) with one bucket and one IAM user."""
    import logging

    import boto3
    import requests
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam.create_user(UserName="flyte-hvd-tests")
    iam.put_user_policy(
        UserName="flyte-hvd-tests",
        PolicyName="all",
        PolicyDocument='{"Version": "2012-10-17", "Statement": '
        '[{"Effect": "Allow", "Action": "*", "Resource": "*"}]}',
    )
    access = iam.create_access_key(UserName="flyte-hvd-tests")["AccessKey"]
    # From here on every request must be signed with a known key and the right secret.
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
    info = S3Server(endpoint, access["AccessKeyId"], access["SecretAccessKey"], S3_BUCKET)
    info.client().create_bucket(Bucket=S3_BUCKET)
    try:
        yield info
    finally:
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10)
        server.stop()


# -- Google Cloud Storage and Azure Blob Storage emulators -------------------------------------
# Real HTTP endpoints on 127.0.0.1, each in a process of its own started for the session:
# gcp-storage-emulator (Cloud Storage's JSON API; no authentication) and Azurite (Azure's blob
# service; Shared Key signatures checked against its well-known development account). Tests
# reach them through gcsfs and adlfs as a user would, and check through the vendors' SDKs.


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_server(name: str, command: list[str], port: int, timeout: float = 60):
    """Starts ``command`` and waits until it listens on ``port``; fails naming ``name`` and
    its output if it exits or does not listen in time."""
    import socket
    import time

    log = tempfile.TemporaryFile()  # noqa: SIM115 (the server writes to it while it runs)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    _stop_server(process)
    log.seek(0)
    pytest.fail(
        f"{name} did not start on 127.0.0.1:{port} within {timeout:.0f} s (`{' '.join(command)}`, "
        f"exit status {process.returncode}); its output:\n{log.read().decode(errors='replace')}"
    )


def _stop_server(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class GCSServer:
    """Where the test Cloud Storage endpoint is, and its bucket."""

    protocol = "gs"

    def __init__(self, endpoint_url: str, bucket: str):
        self.endpoint_url = endpoint_url
        self.bucket = bucket

    def storage_options(self, **overrides) -> dict:
        """gcsfs options for this endpoint (no credentials: the emulator checks none)."""
        return {"token": "anon", "endpoint_url": self.endpoint_url, **overrides}

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.endpoint_url})  # fmt: skip

    def list_keys(self, prefix: str) -> list[str]:
        """The object names under ``prefix`` in the bucket, as Google's own client lists them."""
        return sorted(b.name for b in self.client().list_blobs(self.bucket, prefix=prefix))


@pytest.fixture(scope="session")
def gcs_server():
    """gcp-storage-emulator on 127.0.0.1 (a free port), in memory, with one bucket."""
    port = _free_port()
    bucket = "flyte-hvd-test"
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
               "--port", str(port), "--in-memory", "--quiet",
               "--default-bucket", bucket]  # fmt: skip
    process = _start_server("the Cloud Storage emulator", command, port)
    try:
        yield GCSServer(f"http://127.0.0.1:{port}", bucket)
    finally:
        _stop_server(process)


# Azurite's development account: a fixed, published name and key (not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


class AzuriteServer:
    """Where the test Azure blob endpoint is, how to sign in to it, and its container."""

    protocol = "abfs"

    def __init__(self, blob_endpoint: str, bucket: str):
        self.blob_endpoint = blob_endpoint
        self.bucket = bucket  # a container

    def connection_string(self, key: str = AZURITE_KEY) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={self.blob_endpoint};"
        )

    def storage_options(self, **overrides) -> dict:
        """adlfs options for this endpoint (override `connection_string` to test failures)."""
        return {"connection_string": self.connection_string(), **overrides}

    def client(self):
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def list_keys(self, prefix: str) -> list[str]:
        """The blob names under ``prefix`` in the container, as Azure's own client lists them."""
        container = self.client().get_container_client(self.bucket)
        return sorted(b.name for b in container.list_blobs(name_starts_with=prefix))


def find_azurite(env: dict[str, str] | None = None) -> str:
    """The path of Azurite's blob service, installed first if missing; when it cannot be, the
    test is skipped (failed under CI) saying what is missing."""
    script = os.path.join(REPO, "scripts", "install_azurite.sh")
    found = subprocess.run([script], capture_output=True, text=True, timeout=600, env=env)
    if found.returncode != 0:
        require(
            f"Azurite (the Azure Storage emulator the abfs:// tests run against), which is "
            f"missing, and `scripts/install_azurite.sh` could not install it (exit status "
            f"{found.returncode}): {found.stderr.strip()[-2000:]}\nIt needs node and npm with a "
            f"reachable registry; run `make setup` once that holds."
        )
    return found.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def azurite_server():
    """Azurite's blob service on 127.0.0.1 (a free port), in memory, with one container.
    Azurite comes from npm, installed into the user's cache by scripts/install_azurite.sh (at
    once when it is there)."""
    port = _free_port()
    command = [find_azurite(), "--blobHost", "127.0.0.1", "--blobPort",
               str(port), "--inMemoryPersistence", "--silent", "--skipApiVersionCheck",
               "--disableTelemetry"]  # fmt: skip
    process = _start_server("Azurite", command, port)
    try:
        server = AzuriteServer(f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}", "flyte-hvd-test")
        server.client().create_container(server.bucket)
        yield server
    finally:
        _stop_server(process)
