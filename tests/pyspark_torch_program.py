"""A driver program written for pyspark's TorchDistributor, as its documentation shows one: a
training function and a training script, each on two processes. The tests run it with its one
import line changed to flyte_hvd.spark."""

from pyspark.ml.torch.distributor import TorchDistributor


def train(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    result = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
              "total": total.item() * scale}  # fmt: skip
    dist.destroy_process_group()
    return result


def main(script, out):
    on_driver = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(train, 10)
    on_cluster = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        script, "--out", out, "--scale", 3
    )
    return on_driver, on_cluster
