"""The data-parallel regression of ``data_parallel_regression.py`` as a Flyte task.

``HorovodSpark(num_proc=2)`` runs the task body on two ranks in one Spark barrier stage; each
rank fits its own shard, ``allreduce`` averages the gradients, and the task returns rank 0's
weights. Locally flytekit starts a SparkSession with a task slot per rank:

    pyflyte run examples/flyte_horovod_task.py regression --steps 50
"""

import numpy as np
from flytekit import task, workflow

from flyte_hvd.flyte import HorovodSpark

TRUE_W = [2.0, -3.0, 0.5]


@task(task_config=HorovodSpark(num_proc=2))
def train(steps: int, lr: float) -> list[float]:
    """Runs on every rank; flyte_hvd.core is already initialized for this rank."""
    import flyte_hvd.core as hvd

    rng = np.random.default_rng(seed=hvd.rank())  # each rank draws its own shard
    x = rng.normal(size=(1000, 3))
    y = x @ np.array(TRUE_W) + 0.01 * rng.normal(size=1000)
    # Start from rank 0's random weights so every rank holds the same model.
    w = hvd.broadcast(np.random.default_rng().normal(size=3), root_rank=0)
    for step in range(steps):
        grad = 2 * x.T @ (x @ w - y) / len(x)
        w -= lr * hvd.allreduce(grad, op=hvd.Average, name="grad")
        if step % 10 == 0 or step == steps - 1:
            loss = hvd.allreduce(np.mean((x @ w - y) ** 2), name="loss")
            if hvd.rank() == 0:
                print(f"step {step:2d}  loss {float(loss):.6f}")
    weights = hvd.allgather(w[None, :])
    if not np.allclose(weights, weights[0]):
        raise RuntimeError(f"ranks diverged: {weights.tolist()}")
    return [round(float(v), 4) for v in w]


@workflow
def regression(steps: int = 50, lr: float = 0.1) -> list[float]:
    return train(steps=steps, lr=lr)
