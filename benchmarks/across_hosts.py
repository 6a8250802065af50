"""Where the time goes between hosts: ours against raw MPICH, one rank per host and more.

    python -m benchmarks.across_hosts [--quick] [--rounds N]
        [--kinds allreduce,allgather,broadcast,broadcast_in_place]
        [--layouts 2x1,2x2,2x2-hier,4x1,containers] [--sizes 4096,65536,...]

How Kubernetes runs us: every executor pod is a host of its own, so each rank is alone on its
host and every collective crosses the network. Two ranks, each on a simulated host (its own
UTS namespace, as tests/cluster_harness.py's ``mpiexec_on_hosts`` starts them), MPICH on
libfabric's tcp provider over loopback. For allreduce (sum), allgather and broadcast of
float32 buffers, 4 KB to 64 MB per rank, three sides in alternating launches:

- raw: mpi4py's ``Allreduce``/``Allgather``/``Bcast`` on preallocated buffers;
- ours: ``hvd.allreduce``/``hvd.allgather``/``hvd.broadcast`` with the defaults (the argument
  check on: one agreement round before each call); ``broadcast_in_place`` is
  ``hvd.broadcast(x, 0, in_place=True)``, what raw ``Bcast`` does (the root sends from the
  caller's array, the others receive into theirs; Horovod's ``broadcast_``, and how
  ``broadcast_parameters``/``broadcast_variables`` move a model), where ``broadcast`` returns a
  new array (the root copies its input into it);
- unchecked: ours with ``FLYTE_HVD_CHECK_COLLECTIVES=0`` (no agreement round).

ours - unchecked is what the agreement costs; unchecked - raw is the rest of ours (the Python
call, the argument handling, the output buffer and its copies). Each launch times each size
as the median of 5 batches of calls (~0.1 s each), best of 2; the table shows each side's
median over the launches. Needs root and ``unshare`` (without them it says so and measures
nothing). Prints a table and ends with one JSON line.

``--layouts`` runs the same on other layouts of simulated hosts: ``HxR`` is H hosts of R ranks
each (2x1 by default; with R > 1 MPICH uses shared memory within a host, as in a pod of
several ranks), ``-hier`` with ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` (large reductions through
each host's segment first). ``containers`` is two containers of the project's image, one rank
each, on an internal podman network the benchmark creates (each its own network namespace,
veth and bridge between them: two pods' way), whose ranks join as a task's ranks do (each
under its own ``mpiexec -n 1``, one ``Accept``/``Connect``), the repository mounted read-only;
it needs the image (``make image``) and says so without it. The JSON line then holds one
entry per layout under ``layouts``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.allreduce import size_label, time_per_call

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cluster_harness import MPI_TCP_ENV, mpiexec_on_hosts, namespaces_unavailable

KINDS = ("allreduce", "allgather", "broadcast", "broadcast_in_place")
SIDES = ("raw", "ours", "unchecked")
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 1 << 20]
ROUNDS = 5
CONTAINERS = "containers"  # the layout of two containers of the image, one rank each


def measure_on_rank(kind: str, side: str, sizes: list[int], world=None) -> dict[int, float]:
    """Seconds per call of ``kind`` at each size, on this rank (every rank runs it), on
    ``world`` (default ``COMM_WORLD``)."""
    from mpi4py import MPI

    if side == "raw":
        comm = world or MPI.COMM_WORLD
    else:
        import flyte_hvd.core as hvd
        from flyte_hvd.core import state

        hvd.init(world)
        comm = state.comm()
    size = comm.Get_size()
    out = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        if side == "raw":
            into = np.empty(x.size * (size if kind == "allgather" else 1), np.float32)
            call = {
                "allreduce": lambda x=x, r=into: comm.Allreduce(x, r, MPI.SUM),
                "allgather": lambda x=x, r=into: comm.Allgather(x, r),
                "broadcast": lambda x=x: comm.Bcast(x, root=0),
                "broadcast_in_place": lambda x=x: comm.Bcast(x, root=0),
            }[kind]
        else:
            call = {
                "allreduce": lambda x=x: hvd.allreduce(x, op=hvd.Sum),
                "allgather": lambda x=x: hvd.allgather(x),
                "broadcast": lambda x=x: hvd.broadcast(x, root_rank=0),
                "broadcast_in_place": lambda x=x: hvd.broadcast(x, root_rank=0, in_place=True),
            }[kind]
        out[nbytes] = min(
            time_per_call(call, comm.Barrier, lambda n: comm.bcast(n, root=0)) for _ in range(2)
        )
    return out


def joined_world(folder: Path, rank: int, wait_s: float = 120):
    """Two singleton MPI processes (rank 0 and 1) as one communicator, as a task's ranks join
    (``flyte_hvd.launch.rendezvous``): rank 0 opens a port and writes its name into
    ``folder``, rank 1 connects to it (waiting up to ``wait_s`` for the name), and the two
    merge."""
    import time

    from mpi4py import MPI

    port_file = folder / "port"
    if rank == 0:
        port = MPI.Open_port()
        (folder / "port.tmp").write_text(port)
        (folder / "port.tmp").rename(port_file)  # whole or absent for the reader
        inter = MPI.COMM_SELF.Accept(port)
        MPI.Close_port(port)
    else:
        deadline = time.monotonic() + wait_s
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no port name in {port_file} after {wait_s} s: rank 0 did not start or "
                    f"cannot write there; see its output"
                )
            time.sleep(0.05)
        inter = MPI.COMM_SELF.Connect(port_file.read_text())
    return inter.Merge(high=rank == 1)


class ContainerPair:
    """Two containers of the image on an internal podman network of their own, the
    repository mounted read-only; ``launch`` runs one rank in each."""

    def __init__(self) -> None:
        from test_container_cluster import IMAGE, MPI_ENV, PODMAN_CONF, RUN_OPTIONS, podman

        self.podman = podman
        self.podman_env = {**os.environ, "CONTAINERS_CONF": PODMAN_CONF}
        self.tag = f"flyte-hvd-bench-{os.getpid()}"
        self.root = Path(tempfile.mkdtemp(prefix="flyte-hvd-bench-", dir="/var/tmp"))
        self.root.chmod(0o777)  # the image's user (uid 185) writes the port names there
        self.env = {k: v for k, v in MPI_ENV.items() if k != "MPIR_CVAR_DEBUG_SUMMARY"}
        self.launches = 0
        repo = Path(__file__).resolve().parent.parent
        try:
            podman("network", "create", "--internal", "--label", self.tag, self.tag)
            for rank in (0, 1):
                podman(
                    "run", "--detach", *RUN_OPTIONS, "--name", f"{self.tag}-{rank}",
                    "--label", self.tag, "--hostname", f"rank-host-{rank}", "--network", self.tag,
                    "--volume", f"{repo}:/bench:ro", "--volume", f"{self.root}:/join",
                    IMAGE, "sleep", "infinity",
                )  # fmt: skip
        except BaseException:  # nothing left behind: what started is removed
            self.stop()
            raise

    def launch(self, kind: str, side: str, sizes: list[int]) -> dict[int, float]:
        self.launches += 1
        folder = self.root / f"launch-{self.launches}"
        folder.mkdir(mode=0o777)
        folder.chmod(0o777)
        env = {**self.env, **({"FLYTE_HVD_CHECK_COLLECTIVES": "0"} if side == "unchecked" else {})}
        exec_options = ["--workdir", "/bench", *[f"--env={k}={v}" for k, v in env.items()]]
        command = [
            "/opt/venv/bin/mpiexec", "-n", "1", "/opt/venv/bin/python", "-m",
            "benchmarks.across_hosts", "--rank", kind, side, "--sizes", ",".join(map(str, sizes)),
            "--join", f"/join/{folder.name}",
        ]  # fmt: skip
        ranks = [
            subprocess.Popen(
                ["podman", "exec", *exec_options, f"{self.tag}-{rank}", *command, str(rank)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=self.podman_env,
            )
            for rank in (0, 1)
        ]
        outputs = [rank.communicate(timeout=1200) for rank in ranks]
        failed = [i for i, rank in enumerate(ranks) if rank.returncode != 0]
        if failed:
            raise RuntimeError(
                f"{kind} ({side}, containers): rank {failed[0]} failed:\n"
                f"{outputs[failed[0]][1][-3000:]}"
            )
        out = json.loads([x for x in outputs[0][0].splitlines() if x.startswith("{")][-1])
        seen = out.pop("hosts")
        if len(set(seen)) != 2:
            raise RuntimeError(f"{kind} ({side}, containers): the ranks ran on {seen}")
        return {int(k): v for k, v in out.items()}

    def stop(self) -> None:
        listed = self.podman("ps", "--all", "--filter", f"label={self.tag}", "--format",
                             "{{.Names}}", check=False).stdout.split()  # fmt: skip
        if listed:
            self.podman("rm", "--force", "--time", "0", *listed, check=False, timeout=300)
        self.podman("network", "rm", "--force", self.tag, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def image_unavailable() -> str | None:
    """Why two containers of the image cannot run here, or None when they can."""
    from needs import image_tools

    if missing := image_tools():
        return missing
    if not shutil.which("podman"):
        return "podman not found: `make image` installs it"
    from test_container_cluster import IMAGE, podman

    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        return f"no image {IMAGE}: build it with `make image`"
    return None


def parse_layout(text: str) -> tuple[int, int, bool]:
    """``HxR`` or ``HxR-hier`` as (hosts, ranks per host, hierarchical)."""
    shape, _, mode = text.partition("-")
    hosts, _, per_host = shape.partition("x")
    if not (hosts.isdigit() and per_host.isdigit() and mode in ("", "hier")) or int(hosts) < 2:
        raise ValueError(
            f"layout {text!r}: expected HOSTSxRANKS with at least 2 hosts, optionally with "
            f"-hier (e.g. 2x1, 2x2-hier), or {CONTAINERS}"
        )
    return int(hosts), int(per_host), mode == "hier"


def launch(kind: str, side: str, sizes: list[int], layout: str = "2x1") -> dict[int, float]:
    """One launch on the simulated hosts of ``layout``; rank 0's figures."""
    hosts, per_host, hierarchical = parse_layout(layout)
    env = {**os.environ, **MPI_TCP_ENV}
    if per_host > 1:  # MPICH's shared memory within a host, as in a pod of several ranks
        del env["MPIR_CVAR_NOLOCAL"]
    if side == "unchecked":
        env["FLYTE_HVD_CHECK_COLLECTIVES"] = "0"
    if hierarchical:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    command = [sys.executable, "-m", "benchmarks.across_hosts", "--rank", kind, side]
    command += ["--sizes", ",".join(map(str, sizes))]
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run(
            mpiexec_on_hosts(Path(folder), hosts, per_host, command),
            env=env, cwd=str(Path(__file__).resolve().parent.parent),
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{kind} ({side}, {layout}) failed:\n{result.stderr[-3000:]}")
    out = json.loads([x for x in result.stdout.splitlines() if x.startswith("{")][-1])
    seen = out.pop("hosts")
    if sorted(seen.count(h) for h in set(seen)) != [per_host] * hosts:
        raise RuntimeError(f"{kind} ({side}, {layout}): the ranks ran on {seen}")
    return {int(k): v for k, v in out.items()}


def mermaid_chart(rows: list[dict]) -> str:
    """The ratios as a Mermaid chart for the performance page: one bar per kind and size
    (ours with the check, raw's time over ours), and raw's level (1.0) as a line."""
    labels = [f"{r['kind']} {size_label(r['bytes'])}" for r in rows]
    ratios = [r["ratio_vs_raw"] for r in rows]
    top = max(1.2, round(max(ratios) + 0.1, 1))
    return "\n".join(
        [
            "```mermaid",
            "xychart-beta",
            '    title "Across hosts: raw MPICH time / ours (above 1: ours faster)"',
            f"    x-axis [{', '.join(repr(label) for label in labels)}]".replace("'", '"'),
            f'    y-axis "ratio" 0 --> {top}',
            f"    bar {ratios}",
            f"    line {[1.0] * len(rows)}",
            "```",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="two sizes, two rounds")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="launches per side")
    parser.add_argument("--kinds", default=",".join(KINDS), help="e.g. allreduce,allgather")
    parser.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)  # KIND SIDE, on each rank
    parser.add_argument("--layouts", default="2x1", help="e.g. 2x1,2x2,2x2-hier,4x1,containers")
    parser.add_argument("--sizes", help="bytes per rank, e.g. 4096,268435456")
    parser.add_argument("--join", nargs=2, help=argparse.SUPPRESS)  # FOLDER RANK, in a container
    args = parser.parse_args()
    if args.rank:
        from mpi4py import MPI

        world = joined_world(Path(args.join[0]), int(args.join[1])) if args.join else None
        comm = world or MPI.COMM_WORLD
        result = measure_on_rank(*args.rank, [int(s) for s in args.sizes.split(",")], world)
        hosts = comm.gather(socket.gethostname(), root=0)
        if comm.Get_rank() == 0:
            print(json.dumps({**result, "hosts": hosts}), flush=True)
        return
    layouts = args.layouts.split(",")
    try:
        for layout in layouts:
            if layout != CONTAINERS:
                parse_layout(layout)
    except ValueError as error:
        parser.error(str(error))
    why = (image_unavailable() if CONTAINERS in layouts else None) or (
        namespaces_unavailable() if layouts != [CONTAINERS] else None
    )
    if why:  # nothing measured: say why, in the JSON line too
        print(f"benchmarks.across_hosts: skipped: {why}")
        print(json.dumps({"benchmark": "across_hosts", "skipped": why}))
        return
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    rounds = 2 if args.quick else args.rounds
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    if not kinds:
        parser.error(f"--kinds {args.kinds!r} names none of {', '.join(KINDS)}")
    results = {layout: measure_layout(layout, kinds, sizes, rounds) for layout in layouts}
    if layouts == ["2x1"]:  # the line as before: one layout
        print(json.dumps(results["2x1"]))
        return
    print(json.dumps({"benchmark": "across_hosts", "rounds": rounds, "layouts": results}))


def measure_layout(layout: str, kinds: list[str], sizes: list[int], rounds: int) -> dict:
    """Every side of ``kinds`` at ``sizes`` on ``layout``, alternating launches; prints the
    table and chart, returns the layout's summary."""
    pair = ContainerPair() if layout == CONTAINERS else None
    hosts, per_host, hierarchical = (2, 1, False) if pair else parse_layout(layout)
    runs: dict[tuple[str, str], list[dict[int, float]]] = {}
    try:
        for kind in kinds:
            for _ in range(rounds):
                for side in SIDES:  # alternating: the machine's load drifts within a minute
                    run = (
                        pair.launch(kind, side, sizes)
                        if pair
                        else launch(kind, side, sizes, layout)
                    )
                    runs.setdefault((kind, side), []).append(run)
    finally:
        if pair:
            pair.stop()
    rows = []
    how = ", hierarchical" if hierarchical else ""
    where = "containers" if pair else "hosts"
    print(
        f"{hosts} {where} x {per_host} rank{'s' if per_host > 1 else ''}{how}, MPICH over TCP "
        f"between {where}, medians of {rounds} launches per side"
    )
    print(
        f"{'kind':>18} {'size':>7} {'raw us':>9} {'ours us':>9} {'unchecked':>9} "
        f"{'agreement':>9} {'rest':>8} {'ratio':>6} {'unchecked':>9}"
    )
    for kind in kinds:
        for nbytes in sizes:
            t = {s: statistics.median(run[nbytes] for run in runs[(kind, s)]) for s in SIDES}
            row = {
                "kind": kind,
                "bytes": nbytes,
                **{f"{s}_us": round(t[s] * 1e6, 1) for s in SIDES},
                "agreement_us": round((t["ours"] - t["unchecked"]) * 1e6, 1),
                "rest_us": round((t["unchecked"] - t["raw"]) * 1e6, 1),
                "ratio_vs_raw": round(t["raw"] / t["ours"], 3),
                "unchecked_ratio_vs_raw": round(t["raw"] / t["unchecked"], 3),
            }
            rows.append(row)
            print(
                f"{kind:>18} {size_label(nbytes):>7} {row['raw_us']:9.1f} {row['ours_us']:9.1f} "
                f"{row['unchecked_us']:9.1f} {row['agreement_us']:9.1f} {row['rest_us']:8.1f} "
                f"{row['ratio_vs_raw']:6.2f} {row['unchecked_ratio_vs_raw']:9.2f}"
            )
    print("ratio: raw's time over ours (above 1: ours is faster); agreement = ours - unchecked")
    print(mermaid_chart(rows))  # for docs/performance.md
    return {
        "benchmark": "across_hosts",
        "containers" if pair else "hosts": hosts,
        "ranks_per_host": per_host,
        "hierarchical": hierarchical,
        "rounds": rounds,
        "rows": rows,
        **{
            f"{kind}_min_ratio": min(r["ratio_vs_raw"] for r in rows if r["kind"] == kind)
            for kind in kinds
        },
    }


if __name__ == "__main__":
    main()
