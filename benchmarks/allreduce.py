"""How fast is ``flyte_hvd.core.allreduce`` next to raw MPI, memory, and torch's gloo?

    python -m benchmarks.allreduce [--quick]

Two ranks, float32, 4 KB to 256 MB, all measured in this one run:
- ours: ``flyte_hvd.core.allreduce`` on ranks started by ``launch_local`` (merged communicator);
- raw: mpi4py ``Comm.Allreduce`` with preallocated buffers under ``mpiexec -n 2``;
- copy: numpy copy of the same buffer in one process (the memory limit);
- gloo: ``torch.distributed`` gloo ``all_reduce`` (only when torch is importable);
- fusion: 200 float32 arrays of 25 MB in total through ``grouped_allreduce`` against one
  ``allreduce`` of a single 25 MB buffer;
- ours takes the shared-memory path on one host (``FLYTE_HVD_SHM_COLLECTIVES=auto``); "ours,
  MPI path" is the same call with that path off;
- allgather and broadcast of 4 KB to 64 MB per rank: ours (shared memory), ours with MPI
  carrying it, and raw mpi4py ``Allgather``/``Bcast`` on the same communicator;
- two hosts: raw mpi4py ``Allreduce`` of 2 ranks on two simulated hosts (each rank in its own
  UTS namespace, as tests/cluster_harness.py's ``mpiexec_on_hosts`` starts them), MPICH forced
  onto TCP (libfabric's tcp provider on loopback, no shared memory), beside the same 2 ranks
  on one host with the same TCP settings; then 2 hosts x 1 rank and 2 hosts x 2 ranks
  (MPICH's shared memory within a host, TCP between), ours (``hvd.allreduce``) against raw,
  alternating runs: with 1 rank per host MPI carries ours; with 2, ours reduces within each
  host in shared memory first (hierarchical), and "flat" is ours with that off
  (``HOROVOD_HIERARCHICAL_ALLREDUCE=0``). Needs root and ``unshare``; skipped (None)
  otherwise.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Simulated hosts and MPICH's TCP settings for them come from the tests' cluster harness.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cluster_harness import MPI_TCP_ENV, mpiexec_on_hosts

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [4 << 10, 1 << 20, 16 << 20]
GATHER_SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20]  # allgather and broadcast (per rank)
FUSION_BYTES = 25 << 20
FUSION_ARRAYS = 200
ROUNDS = 3
# One host: a launch lands in a fast or a slow mode on this shared machine (the same size
# took 0.2 or 0.5 ms from one launch to the next, raw MPICH too): more alternating launches.
SAME_HOST_ROUNDS = 5


def time_per_call(fn, sync, agree=lambda n: n, repeats: int = 5) -> float:
    """Median seconds per call over ``repeats`` timed batches, sized to ~0.1 s each.

    ``agree`` makes every rank use the same iteration count (rank 0's), or they deadlock.
    """
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-6)
    iters = agree(max(1, min(2000, int(0.1 / once))))
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / iters)
    return float(np.median(samples))


def measure_ours(sizes: list[int]) -> dict:
    import flyte_hvd.core as hvd

    hvd.init()

    def agree(n):
        return hvd.broadcast_object(n, root_rank=0)

    from mpi4py import MPI

    from flyte_hvd.core import shm, state

    comm = state.comm()
    out: dict = {
        "allreduce": {},
        "unchecked": {},
        "raw_merged": {},
        "mpi_path": {},
        "shm": shm.channel(comm) is not None,
    }
    # The same call with the shared-memory path off: a communicator made while it is off.
    previous, state._state.shm_mode = state._state.shm_mode, "off"
    mpi_comm = comm.Dup()
    shm.channel(mpi_comm)
    state._state.shm_mode = previous
    from flyte_hvd.core.collectives import allreduce_on

    warm = np.ones(1024, np.float32)
    for _ in range(500):  # the first size is measured first: not on a cold path
        hvd.allreduce(warm, op=hvd.Sum)
        comm.Allreduce(warm, np.empty_like(warm), MPI.SUM)
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        recv = np.empty_like(x)
        ours, unchecked, raw, mpi_path = [], [], [], []
        for _ in range(2):  # interleaved, so drift in machine load hits all alike
            ours.append(time_per_call(lambda x=x: hvd.allreduce(x, op=hvd.Sum), hvd.barrier, agree))
            state._state.check_collectives = False
            unchecked.append(
                time_per_call(lambda x=x: hvd.allreduce(x, op=hvd.Sum), hvd.barrier, agree)
            )
            state._state.check_collectives = True
            raw.append(
                time_per_call(lambda x=x, r=recv: comm.Allreduce(x, r, MPI.SUM), hvd.barrier, agree)
            )
            mpi_path.append(
                time_per_call(lambda x=x: allreduce_on(mpi_comm, x, hvd.Sum), hvd.barrier, agree)
            )
        out["allreduce"][nbytes] = min(ours)
        out["unchecked"][nbytes] = min(unchecked)
        out["raw_merged"][nbytes] = min(raw)
        out["mpi_path"][nbytes] = min(mpi_path)
    # Allgather and broadcast: ours (shared memory), ours with MPI carrying it, raw mpi4py.
    from flyte_hvd.core.collectives import allgather_on, broadcast_on

    for kind in ("allgather", "broadcast", "allgather_mpi", "broadcast_mpi"):
        out[kind] = {}
    out["allgather_raw"], out["broadcast_raw"] = {}, {}
    for nbytes in [b for b in sizes if b in GATHER_SIZES]:
        x = np.ones(nbytes // 4, np.float32)
        gathered = np.empty(x.size * comm.Get_size(), np.float32)
        calls = {
            "allgather": lambda x=x: hvd.allgather(x),
            "allgather_mpi": lambda x=x: allgather_on(mpi_comm, x),
            "allgather_raw": lambda x=x, g=gathered: comm.Allgather(x, g),
            "broadcast": lambda x=x: hvd.broadcast(x, root_rank=0),
            "broadcast_mpi": lambda x=x: broadcast_on(mpi_comm, x, 0),
            "broadcast_raw": lambda x=x: comm.Bcast(x, root=0),
        }
        best: dict[str, list[float]] = {kind: [] for kind in calls}
        for _ in range(2):  # interleaved, as above
            for kind, call in calls.items():
                best[kind].append(time_per_call(call, hvd.barrier, agree))
        for kind in calls:
            out[kind][nbytes] = min(best[kind])
    shm.forget(mpi_comm)
    mpi_comm.Free()
    rng = np.random.default_rng(0)
    weights = rng.random(FUSION_ARRAYS) + 0.5
    counts = np.maximum(1, (weights / weights.sum() * FUSION_BYTES / 4).astype(int))
    arrays = [np.ones(int(c), np.float32) for c in counts]
    single = np.ones(int(counts.sum()), np.float32)
    out["fused_200"] = time_per_call(
        lambda: hvd.grouped_allreduce(arrays, op=hvd.Sum), hvd.barrier, agree
    )
    out["single_25mb"] = time_per_call(
        lambda: hvd.allreduce(single, op=hvd.Sum), hvd.barrier, agree
    )
    out["fusion_bytes"] = int(single.nbytes)
    return out


def measure_raw(sizes: list[int]) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for nbytes in sizes:
        send = np.ones(nbytes // 4, np.float32)
        recv = np.empty_like(send)
        out[nbytes] = min(
            time_per_call(
                lambda s=send, r=recv: comm.Allreduce(s, r, MPI.SUM),
                comm.Barrier,
                lambda n: comm.bcast(n, root=0),
            )
            for _ in range(2)
        )
    return out


def measure_ours_world(sizes: list[int]) -> dict:
    """``hvd.allreduce`` under plain ``mpiexec`` (``hvd.init()`` on ``COMM_WORLD``)."""
    import flyte_hvd.core as hvd
    from flyte_hvd.core import state

    hvd.init()
    comm = state.comm()
    out = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        out[nbytes] = min(
            time_per_call(
                lambda x=x: hvd.allreduce(x, op=hvd.Sum),
                comm.Barrier,
                lambda n: comm.bcast(n, root=0),
            )
            for _ in range(2)
        )
    return out


def measure_copy(sizes: list[int]) -> dict:
    out = {}
    for nbytes in sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        out[nbytes] = time_per_call(lambda s=src, d=dst: np.copyto(d, s), lambda: None)
    return out


def _gloo_agree(n: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([n])
    dist.broadcast(t, src=0)
    return int(t[0])


def _gloo_worker(rank: int, port: int, sizes: list[int], path: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        out[nbytes] = time_per_call(lambda t=t: dist.all_reduce(t), dist.barrier, _gloo_agree)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def measure_gloo(sizes: list[int]) -> dict | None:
    try:
        import torch.multiprocessing as mp
    except ImportError:
        return None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "gloo.json")
        mp.spawn(_gloo_worker, args=(port, sizes, path), nprocs=2, join=True)
        with open(path) as f:
            return {int(k): v for k, v in json.load(f).items()}


def _run_raw(sizes: list[int]) -> dict:
    from flyte_hvd.launch.supervisor import find_mpiexec

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "raw.json")
        subprocess.run(
            [
                find_mpiexec(),
                "-n",
                "2",
                sys.executable,
                "-m",
                "benchmarks.allreduce",
                "--raw-json",
                path,
                "--sizes",
                ",".join(map(str, sizes)),
            ],
            check=True,
        )
        with open(path) as f:
            return {int(k): v for k, v in json.load(f).items()}


def _run_raw_tcp(
    sizes: list[int],
    two_hosts: bool,
    per_host: int = 1,
    ours: bool = False,
    extra_env: dict[str, str] | None = None,
) -> dict | None:
    """Raw ``Allreduce`` (``ours``: ``hvd.allreduce``) over TCP, on two simulated hosts with
    ``per_host`` ranks each (more than one: MPICH's shared memory within a host) or 2 ranks on
    this one."""
    from flyte_hvd.launch.supervisor import find_mpiexec

    if two_hosts and (os.geteuid() != 0 or not shutil.which("unshare")):
        return None
    env = {**os.environ, **MPI_TCP_ENV, **(extra_env or {})}
    if per_host > 1:
        del env["MPIR_CVAR_NOLOCAL"]
    with tempfile.TemporaryDirectory() as d:
        command = [sys.executable, "-m", "benchmarks.allreduce", "--raw-json", "-"]
        command += ["--sizes", ",".join(map(str, sizes))] + (["--ours"] if ours else [])
        if two_hosts:
            command = mpiexec_on_hosts(Path(d), 2, per_host, command)
        else:
            command = [find_mpiexec(), "-n", "2", *command]
        result = subprocess.run(
            command,
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    line = [x for x in result.stdout.splitlines() if x.startswith("{")][-1]
    out = json.loads(line)
    hosts_seen = sorted(out.pop("hosts"))
    if two_hosts and sorted(hosts_seen.count(h) for h in set(hosts_seen)) != [per_host] * 2:
        raise RuntimeError(f"two-host run: ranks ran on {hosts_seen}")
    return {int(k): v for k, v in out.items()}


def min_runs(runs: list[dict | None], sizes: list[int]) -> dict | None:
    """Each size's best time over runs (None when the measurement was skipped)."""
    if any(run is None for run in runs):
        return None
    return {b: min(run[b] for run in runs) for b in sizes}


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _min_ratio(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return min(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="three sizes, for a smoke run")
    parser.add_argument("--raw-json", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--ours", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_json:  # the mpiexec -n 2 half of this benchmark
        from mpi4py import MPI

        measure = measure_ours_world if args.ours else measure_raw
        result = measure([int(s) for s in args.sizes.split(",")])
        hosts = MPI.COMM_WORLD.gather(socket.gethostname(), root=0)
        if MPI.COMM_WORLD.Get_rank() == 0:
            if args.raw_json == "-":  # on stdout: a simulated host's /tmp is its own
                print(json.dumps({**result, "hosts": hosts}), flush=True)
            else:
                with open(args.raw_json, "w") as f:
                    json.dump(result, f)
        return

    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    sizes = QUICK_SIZES if args.quick else SIZES
    n = 2
    # Alternate whole runs and keep each figure's best: this machine's load drifts by tens of
    # percent within a minute, and the minimum is the least disturbed measurement.
    raw_runs, our_runs = [], []
    for _ in range(SAME_HOST_ROUNDS):
        raw_runs.append(_run_raw(sizes))
        our_runs.append(launch_local(FunctionJob(measure_ours, (sizes,)), n)[0])
    raw = {b: min(run[b] for run in raw_runs) for b in sizes}
    ours = {
        key: {b: min(run[key][b] for run in our_runs) for b in sizes}
        for key in ("allreduce", "unchecked", "raw_merged", "mpi_path")
    }
    for key in ("fused_200", "single_25mb", "fusion_bytes"):
        ours[key] = min(run[key] for run in our_runs)
    gather_kinds = [f"{c}{s}" for c in ("allgather", "broadcast") for s in ("", "_mpi", "_raw")]
    gather_sizes = [b for b in sizes if b in GATHER_SIZES]
    for key in gather_kinds:
        ours[key] = {b: min(run[key][b] for run in our_runs) for b in gather_sizes}
    copy = measure_copy(sizes)
    gloo = measure_gloo(sizes)
    tcp_one = min_runs([_run_raw_tcp(sizes, two_hosts=False) for _ in range(ROUNDS)], sizes)
    tcp_two = min_runs([_run_raw_tcp(sizes, two_hosts=True) for _ in range(ROUNDS)], sizes)
    # Ours against raw on simulated hosts, 2 x 1 and 2 x 2 ranks, alternating.
    # With 2 ranks per host, ours reduces within each host in shared memory first; "flat" is
    # ours with that off (HOROVOD_HIERARCHICAL_ALLREDUCE=0: MPICH's own algorithm).
    hosts: dict[str, dict | None] = {}
    flat_env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}
    for per_host in (1, 2):
        sides = {"raw": (False, None), "ours": (True, None)}
        if per_host > 1:
            sides["flat"] = (True, flat_env)
        runs: dict[str, list] = {side: [] for side in sides}
        for _ in range(ROUNDS):
            for side, (ours_side, extra) in sides.items():
                runs[side].append(_run_raw_tcp(sizes, True, per_host, ours_side, extra))
        for side in sides:
            hosts[f"2x{per_host}_{side}"] = min_runs(runs[side], sizes)

    def bw(nbytes, seconds):
        return nbytes / seconds / 1e9

    bus = 2 * (n - 1) / n
    rows = []
    print(
        f"{'size':>8} {'ours busbw':>11} {'raw busbw':>10} {'ratio':>6} {'merged raw':>11} "
        f"{'copy GB/s':>10} {'gloo busbw':>11} {'ours us':>9} {'unchecked':>9} {'raw us':>9}"
    )
    for nbytes in sizes:
        o, r, m = ours["allreduce"][nbytes], raw[nbytes], ours["raw_merged"][nbytes]
        row = {
            "bytes": nbytes,
            "ours_algbw": round(bw(nbytes, o), 3),
            "ours_busbw": round(bw(nbytes, o) * bus, 3),
            "raw_busbw": round(bw(nbytes, r) * bus, 3),
            "ratio_vs_raw": round(r / o, 3),
            "raw_merged_busbw": round(bw(nbytes, m) * bus, 3),
            "ratio_vs_raw_merged": round(m / o, 3),
            "copy_gbps": round(bw(nbytes, copy[nbytes]), 3),
            "gloo_busbw": round(bw(nbytes, gloo[nbytes]) * bus, 3) if gloo else None,
            "raw_tcp_same_host_busbw": round(bw(nbytes, tcp_one[nbytes]) * bus, 3),
            "raw_tcp_two_hosts_busbw": (
                round(bw(nbytes, tcp_two[nbytes]) * bus, 3) if tcp_two else None
            ),
            "unchecked_ratio_vs_raw": round(r / ours["unchecked"][nbytes], 3),
            "mpi_path_busbw": round(bw(nbytes, ours["mpi_path"][nbytes]) * bus, 3),
            "mpi_path_ratio_vs_raw": round(r / ours["mpi_path"][nbytes], 3),
            "ours_us": round(o * 1e6, 1),
            "unchecked_us": round(ours["unchecked"][nbytes] * 1e6, 1),
            "raw_us": round(r * 1e6, 1),
        }
        for per_host in (1, 2):
            h_raw, h_ours = hosts[f"2x{per_host}_raw"], hosts[f"2x{per_host}_ours"]
            hbus = 2 * (2 * per_host - 1) / (2 * per_host)
            row[f"hosts_2x{per_host}_raw_busbw"] = (
                round(bw(nbytes, h_raw[nbytes]) * hbus, 3) if h_raw else None
            )
            row[f"hosts_2x{per_host}_ours_busbw"] = (
                round(bw(nbytes, h_ours[nbytes]) * hbus, 3) if h_ours else None
            )
            row[f"hosts_2x{per_host}_ratio"] = (
                round(h_raw[nbytes] / h_ours[nbytes], 3) if h_raw and h_ours else None
            )
        flat = hosts["2x2_flat"]
        row["hosts_2x2_flat_busbw"] = round(bw(nbytes, flat[nbytes]) * 1.5, 3) if flat else None
        row["hosts_2x2_hier_vs_flat"] = (
            round(flat[nbytes] / hosts["2x2_ours"][nbytes], 3) if flat else None
        )
        rows.append(row)
        gloo_txt = f"{row['gloo_busbw']:11.2f}" if gloo else f"{'-':>11}"
        print(
            f"{size_label(nbytes):>8} {row['ours_busbw']:11.2f} {row['raw_busbw']:10.2f} "
            f"{row['ratio_vs_raw']:6.2f} {row['raw_merged_busbw']:11.2f} {row['copy_gbps']:10.2f} "
            f"{gloo_txt} {row['ours_us']:9.1f} {row['unchecked_us']:9.1f} {row['raw_us']:9.1f}"
        )
    print(
        f"\n{'size':>8} {'MPI path':>9} {'raw busbw':>10} {'tcp 1 host':>11} {'tcp 2 hosts':>12}"
        f" {'2x1 ours':>9} {'2x1 raw':>8} {'2x2 ours':>9} {'2x2 flat':>9} {'2x2 raw':>8}"
        "  (busbw GB/s)"
    )

    def txt(value, width):
        return f"{value:{width}.2f}" if value is not None else f"{'skipped':>{width}}"

    for row in rows:
        print(
            f"{size_label(row['bytes']):>8} {row['mpi_path_busbw']:9.2f} {row['raw_busbw']:10.2f} "
            f"{row['raw_tcp_same_host_busbw']:11.2f} {txt(row['raw_tcp_two_hosts_busbw'], 12)} "
            f"{txt(row['hosts_2x1_ours_busbw'], 9)} {txt(row['hosts_2x1_raw_busbw'], 8)} "
            f"{txt(row['hosts_2x2_ours_busbw'], 9)} {txt(row['hosts_2x2_flat_busbw'], 9)} "
            f"{txt(row['hosts_2x2_raw_busbw'], 8)}"
        )
    print(
        f"\n{'size':>8} {'allgather: ours us':>19} {'MPI path':>9} {'raw':>9} "
        f"{'broadcast: ours us':>19} {'MPI path':>9} {'raw':>9}  (bytes per rank)"
    )
    gathers = []
    for nbytes in gather_sizes:
        g = {k: ours[k][nbytes] * 1e6 for k in gather_kinds}
        gathers.append(
            {
                "bytes": nbytes,
                **{f"{k}_us": round(v, 1) for k, v in g.items()},
                "allgather_ratio_vs_raw": round(g["allgather_raw"] / g["allgather"], 3),
                "broadcast_ratio_vs_raw": round(g["broadcast_raw"] / g["broadcast"], 3),
            }
        )
        print(
            f"{size_label(nbytes):>8} {g['allgather']:19.1f} {g['allgather_mpi']:9.1f} "
            f"{g['allgather_raw']:9.1f} {g['broadcast']:19.1f} {g['broadcast_mpi']:9.1f} "
            f"{g['broadcast_raw']:9.1f}"
        )
    fused_ratio = ours["fused_200"] / ours["single_25mb"]
    print(
        f"fusion: 200 arrays ({ours['fusion_bytes'] / 1e6:.1f} MB) "
        f"{ours['fused_200'] * 1e3:.2f} ms vs one buffer "
        f"{ours['single_25mb'] * 1e3:.2f} ms -> {fused_ratio:.2f}x"
    )
    large = [r["ratio_vs_raw"] for r in rows if r["bytes"] >= 1 << 20]
    small = rows[0]
    summary = {
        "benchmark": "allreduce",
        "ranks": n,
        "shm_path": all(run["shm"] for run in our_runs),
        "rows": rows,
        "min_busbw_ratio_ge_1mb": min(large) if large else None,
        "latency_4kb_ratio": round(small["ours_us"] / small["raw_us"], 3),
        "latency_4kb_ratio_unchecked": round(small["unchecked_us"] / small["raw_us"], 3),
        "min_busbw_ratio_ge_1mb_unchecked": min(
            r["unchecked_ratio_vs_raw"] for r in rows if r["bytes"] >= 1 << 20
        ),
        "min_busbw_ratio_ge_1mb_mpi_path": min(
            r["mpi_path_ratio_vs_raw"] for r in rows if r["bytes"] >= 1 << 20
        ),
        "ratio_64mb": next((r["ratio_vs_raw"] for r in rows if r["bytes"] == 64 << 20), None),
        "hosts_2x1_min_ratio": _min_ratio(rows, "hosts_2x1_ratio"),
        "hosts_2x2_min_ratio": _min_ratio(rows, "hosts_2x2_ratio"),
        "hosts_2x2_ratio_ge_1mb": _min_ratio(
            [r for r in rows if r["bytes"] >= 1 << 20], "hosts_2x2_ratio"
        ),
        "hosts_2x2_hier_vs_flat_min": _min_ratio(rows, "hosts_2x2_hier_vs_flat"),
        "hosts_2x2_hier_vs_flat_ge_1mb": _min_ratio(
            [r for r in rows if r["bytes"] >= 1 << 20], "hosts_2x2_hier_vs_flat"
        ),
        "gathers": gathers,
        "allgather_min_ratio_vs_raw": min(g["allgather_ratio_vs_raw"] for g in gathers),
        "broadcast_min_ratio_vs_raw": min(g["broadcast_ratio_vs_raw"] for g in gathers),
        "fused_200_ms": round(ours["fused_200"] * 1e3, 3),
        "single_25mb_ms": round(ours["single_25mb"] * 1e3, 3),
        "fused_vs_single_ratio": round(fused_ratio, 3),
        "gloo_measured": gloo is not None,
        "two_hosts_measured": tcp_two is not None,
        "two_hosts_vs_same_host_tcp_ge_1mb": (
            min(tcp_one[b] / tcp_two[b] for b in sizes if b >= 1 << 20) if tcp_two else None
        ),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
