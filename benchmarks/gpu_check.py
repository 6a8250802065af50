"""The GPU check: what the CPU machines cannot measure, in one call on a CUDA machine.

    scripts/gpu_check.sh [OUT_DIR]      # on the GPU machine: installs what is missing, runs this
    python -m benchmarks.gpu_check [--sizes-mb 1,4,16,64,256] [--rounds 5] [--steps 20]
        [--device cuda|cpu] [--ranks N] [--no-estimator] [--out FILE]

One rank per GPU (NCCL refuses two ranks on one GPU). In the same run, rounds alternating:
- collectives: ``hvd.allreduce`` (sum) of float32 tensors on the ranks' GPUs through our
  default route (the ``torch.distributed`` process group, NCCL, with our argument check over
  MPI), the same call forced onto the MPI route (``FLYTE_HVD_TORCH_COLLECTIVES=mpi``: through
  host memory), and ``torch.distributed``'s own ``all_reduce`` on the same NCCL group; time
  per call after ``torch.cuda.synchronize``, each side's result checked against the expected
  sum first;
- a training step: an MLP of about 5 M parameters, ``hvd.DistributedOptimizer`` against
  ``DistributedDataParallel``, same model, data and device;
- a ``TorchEstimator`` fit with ``distributed="ddp"`` on ``local[N]`` (N the ranks), whose
  model refuses a batch that is not on the device under test: its time and losses; skipped,
  with the reason in the JSON line, where pyspark or Java is missing.

On one GPU the collectives run on one rank: the figures are then our per-call cost over
NCCL's, not a link's bandwidth. ``--device cpu`` runs the same parts on gloo with CPU tensors
(our process-group route forced with ``FLYTE_HVD_TORCH_COLLECTIVES=process_group``): how the
suite checks this script on machines without GPUs. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.torch_step import FEATURES, GLOBAL_BATCH, mlp

# Calls per timed batch: enough to see past one launch, few where one call moves much.
CALLS_BYTES = 256 << 20


def _calls(nbytes: int) -> int:
    return max(3, min(50, CALLS_BYTES // max(nbytes, 1)))


def _rank_device(kind: str, hvd):
    """This rank's device, the process-group backend for it, and the route that sends our
    collectives through that process group."""
    import torch

    if kind == "cuda":
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)  # NCCL builds its communicator on the current GPU
        return device, "nccl", "auto"
    torch.set_num_threads(1)
    return torch.device("cpu"), "gloo", "process_group"


def ranks_part(kind: str, sizes: list[int], rounds: int, steps: int) -> dict:
    """Every rank: the collectives and the training step (module docstring)."""
    import torch
    import torch.distributed as dist

    import flyte_hvd.torch as hvd
    from flyte_hvd.torch.process_group import ROUTE_ENV

    hvd.init()
    device, backend, group_route = _rank_device(kind, hvd)
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE: set by the rank bootstrap.
    dist.init_process_group(backend)
    size = hvd.size()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def ours(route: str):
        def call(t):
            os.environ[ROUTE_ENV] = route
            return hvd.allreduce(t, op=hvd.Sum, name="gpu_check")

        return call

    def nccl(t):
        dist.all_reduce(t)
        return t

    sides = {"ours": ours(group_route), "ours_mpi": ours("mpi"), "torch_distributed": nccl}
    expected = size * (size + 1) / 2
    checked: dict[str, bool] = {}
    collectives = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        for name, call in sides.items():
            probe = torch.full((n,), float(hvd.rank() + 1), device=device)
            out = call(probe)
            sync()
            ok = bool(torch.all(out == expected).item()) and out.device == device
            checked[name] = checked.get(name, True) and ok
        # Zeros for the timing: a sum of zeros stays zero, so in-place calls repeat alike.
        t = torch.zeros(n, device=device)
        calls = _calls(nbytes)
        times: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                call = sides[name]
                call(t)  # warm: the first call of a size sets up buffers
                sync()
                hvd.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call(t)
                sync()
                times[name].append((time.perf_counter() - start) / calls)
        collectives.append({"bytes": nbytes, "calls": calls, "rounds_s": times})
    os.environ.pop(ROUTE_ENV, None)
    return {
        "rank": hvd.rank(),
        "size": size,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": backend,
        "results_correct": checked,
        "collectives": collectives,
        "step": _training_step(device, steps, rounds, hvd, dist),
    }


def _training_step(device, steps: int, rounds: int, hvd, dist) -> dict:
    """``DistributedOptimizer`` against DDP: seconds per step (median of the rounds), and
    whether the ranks' weights agree after it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    size = hvd.size()
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(GLOBAL_BATCH // size, FEATURES, generator=g).to(device)
    y = x[:, :1] * 0.5

    ours = mlp().to(device)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=1e-3), named_parameters=ours.named_parameters()
    )
    ddp = DistributedDataParallel(
        mlp().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def seconds_per_step(model, optimizer) -> float:
        def step():
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / steps

    ours_s, ddp_s = [], []
    for r in range(rounds):
        pair = [("ours", ours, opt), ("ddp", ddp, ddp_opt)]
        for name, model, optimizer in pair if r % 2 == 0 else pair[::-1]:
            (ours_s if name == "ours" else ddp_s).append(seconds_per_step(model, optimizer))
    first = ours[0].weight.detach()[:2, :4].cpu().numpy().copy()
    same = all((w == first).all() for w in hvd.allgather_object(first))
    dist.destroy_process_group()
    return {
        "params": sum(p.numel() for p in ours.parameters()),
        "ours_s": statistics.median(ours_s),
        "ddp_s": statistics.median(ddp_s),
        "rounds_s": {"ours": ours_s, "ddp": ddp_s},
        "same_weights_on_ranks": bool(same),
    }


def estimator_part(spark, kind: str, num_proc: int, work_dir: str) -> dict:
    """A ``TorchEstimator`` fit with ``distributed="ddp"`` whose model raises on a batch that
    is not on ``kind``'s device: its seconds and losses."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.data import Store
    from flyte_hvd.estimators.torch import TorchEstimator

    class OnDevice(torch.nn.Module):  # defined here: pickled by value to the ranks
        def __init__(self, expected: str):
            super().__init__()
            self.expected = expected
            self.net = torch.nn.Sequential(
                torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
            )

        def forward(self, x):
            if x.device.type != self.expected:
                raise RuntimeError(f"a batch on {x.device}; this check expects {self.expected}")
            return self.net(x)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    rows = [(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y, strict=True)]
    df = spark.createDataFrame(rows, ["features", "label"])
    torch.manual_seed(0)
    model = OnDevice(kind)
    estimator = TorchEstimator(
        num_proc=num_proc, store=Store.create(work_dir), model=model, loss=F.mse_loss,
        optimizer=torch.optim.Adam(model.parameters(), 0.02), feature_cols=["features"],
        label_cols=["label"], batch_size=32, epochs=4, verbose=0, random_seed=1,
        distributed="ddp", use_gpu=kind == "cuda",
    )  # fmt: skip
    start = time.perf_counter()
    fitted = estimator.fit(df)
    seconds = time.perf_counter() - start
    losses = fitted.getHistory()["loss"]
    return {
        "fit_s": round(seconds, 2),
        "losses": [round(v, 5) for v in losses],
        "loss_fell": losses[-1] < losses[0],
        "device": kind,
    }


def _estimator_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed here"
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        return "no Java here (Spark's driver is a JVM)"
    return None


def _run_estimator(kind: str, num_proc: int) -> dict:
    if missing := _estimator_missing():
        return {"skipped": missing}
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(f"local[{max(num_proc, 2)}]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    work_dir = tempfile.mkdtemp(prefix="gpu-check-")
    try:
        return estimator_part(spark, kind, num_proc, work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        spark.stop()


def summarize(results: list[dict], sizes: list[int]) -> dict:
    """The figures of the slowest rank per side (a collective is as slow as its slowest
    rank), and ours against ``torch.distributed``'s."""
    size = results[0]["size"]
    bus = 2 * (size - 1) / size if size > 1 else 1.0
    rows = []
    for i, nbytes in enumerate(sizes):
        per_side = {}
        for side in results[0]["collectives"][i]["rounds_s"]:
            per_side[side] = max(
                statistics.median(r["collectives"][i]["rounds_s"][side]) for r in results
            )
        rows.append(
            {
                "bytes": nbytes,
                **{f"{side}_ms": round(s * 1e3, 4) for side, s in per_side.items()},
                "ours_busbw_gbs": round(nbytes / per_side["ours"] * bus / 1e9, 2),
                "torch_distributed_busbw_gbs": round(
                    nbytes / per_side["torch_distributed"] * bus / 1e9, 2
                ),
                "ours_vs_torch_distributed": round(
                    per_side["torch_distributed"] / per_side["ours"], 3
                ),
                "mpi_route_vs_torch_distributed": round(
                    per_side["torch_distributed"] / per_side["ours_mpi"], 3
                ),
            }
        )
    step_ours = max(r["step"]["ours_s"] for r in results)
    step_ddp = max(r["step"]["ddp_s"] for r in results)
    sides = results[0]["results_correct"]
    correct = {side: all(r["results_correct"][side] for r in results) for side in sides}
    return {
        "ranks": size,
        "devices": [r["device"] for r in results],
        "device_name": results[0]["device_name"],
        "backend": results[0]["backend"],
        "results_correct": correct,
        "allreduce": rows,
        "allreduce_min_ratio_vs_torch_distributed": min(
            r["ours_vs_torch_distributed"] for r in rows
        ),
        "step": {
            "params": results[0]["step"]["params"],
            "ours_ms": round(step_ours * 1e3, 3),
            "ddp_ms": round(step_ddp * 1e3, 3),
            "ours_vs_ddp": round(step_ddp / step_ours, 3),
            "same_weights_on_ranks": all(r["step"]["same_weights_on_ranks"] for r in results),
        },
    }


def _parse_sizes(raw: str) -> list[int]:
    try:
        sizes = [int(float(v) * (1 << 20)) for v in raw.split(",") if v.strip()]
    except ValueError:
        sys.exit(f"--sizes-mb: expected numbers of MiB separated by commas; found {raw!r}")
    if not sizes or min(sizes) < 4:
        sys.exit(f"--sizes-mb: expected at least one size of 4 bytes or more; found {raw!r}")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    parser.add_argument("--sizes-mb", default="1,4,16,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--ranks", type=int, default=None, help="default: the GPUs (cuda), 2 (cpu)")
    parser.add_argument("--no-estimator", action="store_true")
    parser.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    sizes = _parse_sizes(args.sizes_mb)

    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit(
                f"gpu_check: torch {torch.__version__} sees no CUDA GPU here (CUDA build: "
                f"{torch.version.cuda or 'none'}). Run it on a machine with GPUs, or with "
                f"--device cpu to check the script itself."
            )
        gpus = torch.cuda.device_count()
        ranks = args.ranks or gpus
        if ranks > gpus:
            sys.exit(f"gpu_check: --ranks {ranks}, but this machine has {gpus} GPU(s); NCCL "
                     f"needs a GPU per rank.")  # fmt: skip
    else:
        ranks = args.ranks or 2

    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    started = time.perf_counter()
    results = launch_local(FunctionJob(ranks_part, (args.device, sizes, args.rounds, args.steps)),
                           ranks, start_timeout=300)  # fmt: skip
    report = {"benchmark": "gpu_check", "torch": torch.__version__, **summarize(results, sizes)}
    report["ranks_s"] = round(time.perf_counter() - started, 1)
    report["estimator"] = (
        {"skipped": "--no-estimator"} if args.no_estimator else _run_estimator(args.device, ranks)
    )
    for row in report["allreduce"]:
        print(f"allreduce {row['bytes'] / (1 << 20):8.3f} MiB: ours {row['ours_ms']:9.3f} ms, "
              f"MPI route {row['ours_mpi_ms']:9.3f} ms, torch.distributed "
              f"{row['torch_distributed_ms']:9.3f} ms, ours/theirs speed "
              f"{row['ours_vs_torch_distributed']:.2f}")  # fmt: skip
    step = report["step"]
    print(f"step ({step['params'] / 1e6:.1f} M parameters): DistributedOptimizer "
          f"{step['ours_ms']:.2f} ms, DDP {step['ddp_ms']:.2f} ms")  # fmt: skip
    line = json.dumps(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
