"""What does gradient synchronization cost a PyTorch training step, against DDP on gloo?

    python -m benchmarks.torch_step [--steps N] [--rounds R]

Two ranks (one thread each) train an MLP of about 5 M parameters on a global batch of 256.
In the same run:
- sync: ``DistributedOptimizer``'s reduction of one step's gradients (fresh gradient tensors,
  as after ``zero_grad()``: copy into the fusion bucket, one reduction, results adopted as
  ``param.grad``), timed alone after a barrier, against the floor: one ``allreduce`` of a
  single tensor of the same bytes;
- step: zero_grad, forward, backward and step with ``DistributedOptimizer``, against the same
  step under ``torch.distributed`` DDP on gloo (same model, data and threads), and against a
  step with no synchronization at all; rounds alternate between them so load drift hits
  all alike.
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

GLOBAL_BATCH = 256
FEATURES, HIDDEN = 512, 2048


def mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def _seconds_per_step(model, opt, x, y, steps: int) -> float:
    import torch

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()  # warm
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def ranks_part(steps: int, rounds: int) -> dict:
    import socket

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import flyte_hvd.torch as hvd
    from flyte_hvd.torch.optimizer import _Reducer

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(GLOBAL_BATCH // size, FEATURES, generator=g)
    y = x[:, :1] * 0.5

    ours = mlp()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(ours.parameters(), lr=1e-3), named_parameters=ours.named_parameters()
    )
    params = [p for p in ours.parameters()]
    n_params = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)

    # Time the reduction inside real steps: wrap the optimizer's synchronize.
    in_step: list[float] = []
    synchronize = _Reducer.synchronize

    def timed(self):
        start = time.perf_counter()
        synchronize(self)
        in_step.append(time.perf_counter() - start)

    local = mlp()
    local_opt = torch.optim.SGD(local.parameters(), lr=1e-3)

    # DDP on gloo in the same processes; rank 0 picks the port.
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    port = hvd.broadcast_object(port, root_rank=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    ddp = DistributedDataParallel(mlp())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    ours_s, ddp_s, local_s = [], [], []
    for _ in range(rounds):
        hvd.barrier()
        _Reducer.synchronize = timed
        ours_s.append(_seconds_per_step(ours, opt, x, y, steps))
        _Reducer.synchronize = synchronize
        dist.barrier()
        ddp_s.append(_seconds_per_step(ddp, ddp_opt, x, y, steps))
        hvd.barrier()
        local_s.append(_seconds_per_step(local, local_opt, x, y, steps))

    # Sync alone: fresh gradient tensors each time (as zero_grad(set_to_none=True) leaves
    # them), reduced by the optimizer, against one allreduce of the same bytes.
    torch.nn.functional.mse_loss(ours(x), y).backward()
    grads = [p.grad.clone() for p in params]
    single = torch.ones(grad_bytes // 4)
    gloo_single = torch.ones(grad_bytes // 4)
    sync, floor, gloo = [], [], []
    for i in range(33):
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        hvd.barrier()
        start = time.perf_counter()
        opt.synchronize()
        sync.append(time.perf_counter() - start)
        hvd.barrier()
        start = time.perf_counter()
        hvd.allreduce(single)
        floor.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(gloo_single)
        gloo.append(time.perf_counter() - start)
        if i < 3:  # warm-up
            sync.pop(), floor.pop(), gloo.pop()
    dist.destroy_process_group()
    return {
        "params": n_params,
        "grad_bytes": grad_bytes,
        "tensors": len(params),
        "buckets": len(opt._hvd.buckets),
        "sync_alone_s": statistics.median(sync),
        "floor_s": statistics.median(floor),
        "gloo_allreduce_s": statistics.median(gloo),
        "sync_in_step_s": statistics.median(in_step),
        "step_s": statistics.median(ours_s),
        "ddp_step_s": statistics.median(ddp_s),
        "local_step_s": statistics.median(local_s),
        "rounds": {"ours": ours_s, "ddp": ddp_s, "local": local_s},
        "same_weights": bool(
            np.allclose(
                *hvd.allgather_object(ours[0].weight.detach().numpy()[:4].copy()), rtol=0, atol=0
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    results = launch_local(FunctionJob(ranks_part, (args.steps, args.rounds)), 2,
                           start_timeout=120)  # fmt: skip
    r = results[0]
    # A step is as slow as the slower rank.
    step = max(res["step_s"] for res in results)
    ddp_step = max(res["ddp_step_s"] for res in results)
    local_step = max(res["local_step_s"] for res in results)
    sync_ratio = r["sync_alone_s"] / r["floor_s"]
    mb = r["grad_bytes"] / 1e6
    print(f"MLP {r['params'] / 1e6:.2f} M parameters, {r['tensors']} gradient tensors in "
          f"{r['buckets']} bucket(s), {mb:.1f} MB per step, global batch {GLOBAL_BATCH}, "
          f"2 ranks x 1 thread")  # fmt: skip
    rows = [
        ("gradient sync, alone", f"{r['sync_alone_s'] * 1e3:8.2f} ms"),
        ("floor: one allreduce of the same bytes", f"{r['floor_s'] * 1e3:8.2f} ms"),
        ("sync / floor (target <= 1.3)", f"{sync_ratio:8.2f}"),
        ("gloo all_reduce of the same bytes", f"{r['gloo_allreduce_s'] * 1e3:8.2f} ms"),
        ("sync inside step() (with rank skew)", f"{r['sync_in_step_s'] * 1e3:8.2f} ms"),
        ("step, DistributedOptimizer", f"{step * 1e3:8.1f} ms"),
        ("step, DDP on gloo", f"{ddp_step * 1e3:8.1f} ms"),
        ("step / DDP-gloo (target <= 1.0)", f"{step / ddp_step:8.2f}"),
        ("step, no synchronization", f"{local_step * 1e3:8.1f} ms"),
    ]
    for label, value in rows:
        print(f"{label:<40} {value}")
    print(
        json.dumps(
            {
                "benchmark": "torch_step",
                "ranks": 2,
                "params": r["params"],
                "grad_mb": round(mb, 2),
                "buckets": r["buckets"],
                "sync_alone_ms": round(r["sync_alone_s"] * 1e3, 3),
                "floor_ms": round(r["floor_s"] * 1e3, 3),
                "sync_vs_floor": round(sync_ratio, 3),
                "gloo_allreduce_ms": round(r["gloo_allreduce_s"] * 1e3, 3),
                "sync_in_step_ms": round(r["sync_in_step_s"] * 1e3, 3),
                "step_ms": round(step * 1e3, 2),
                "ddp_gloo_step_ms": round(ddp_step * 1e3, 2),
                "step_vs_ddp_gloo": round(step / ddp_step, 3),
                "no_sync_step_ms": round(local_step * 1e3, 2),
                "samples_per_s": round(GLOBAL_BATCH / step, 1),
                "ranks_agree": all(res["same_weights"] for res in results),
            }
        )
    )


if __name__ == "__main__":
    main()
