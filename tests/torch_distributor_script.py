"""A training script as pyspark's TorchDistributor runs it (`python script args...` on every
process): it joins the process group from the environment, sums a tensor and, on every rank,
writes what it saw to `<--out>.<RANK>.json`."""

import argparse
import json
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--scale", type=float, default=1.0)
args = parser.parse_args()

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
seen = {
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "total": total.item() * args.scale,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
}
dist.destroy_process_group()
with open(f"{args.out}.{os.environ['RANK']}.json", "w") as f:
    json.dump(seen, f)
