"""What the ranks of tests/test_torch_distributed.py run: the torch.distributed variables they
see, and one tiny model trained with DistributedDataParallel (gloo) and with
flyte_hvd.torch's DistributedOptimizer on the same data.

Run as a script (``flyte-hvd-run -np 2 python tests/torch_distributed_cases.py OUT``), each
rank writes what ``main`` returns to ``OUT.<rank>.json``."""

from __future__ import annotations

import json
import os
import sys

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT")  # fmt: skip
STEPS = 4


def _data(rank: int, size: int):
    import torch

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(8 * size, 3, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1
    return x[rank::size], y[rank::size]  # this rank's shard


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _train(model, optimizer, x, y) -> list[float]:
    import torch

    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


def ddp_weights() -> list[float]:
    """DistributedDataParallel over a gloo process group found through the environment."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        x, y = _data(dist.get_rank(), dist.get_world_size())
        model = torch.nn.parallel.DistributedDataParallel(_model())
        return _train(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    finally:
        dist.destroy_process_group()


def hvd_weights() -> list[float]:
    """The same training with flyte_hvd.torch's DistributedOptimizer."""
    import torch

    import flyte_hvd.torch as hvd

    hvd.init()
    x, y = _data(hvd.rank(), hvd.size())
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    return _train(model, optimizer, x, y)


def main() -> dict:
    env = {k: os.environ.get(k) for k in VARS}
    return {"env": env, "ddp": ddp_weights(), "hvd": hvd_weights()}


if __name__ == "__main__":
    result = main()
    with open(f"{sys.argv[1]}.{os.environ['RANK']}.json", "w") as f:
        json.dump(result, f)
