"""Data-parallel linear regression with the collective core: each rank computes gradients on
its own shard, ``allreduce`` averages them, and every rank applies the same update.

    flyte-hvd-run -np 2 python examples/data_parallel_regression.py
"""

import numpy as np

import flyte_hvd.core as hvd

hvd.init()
rng = np.random.default_rng(seed=hvd.rank())
true_w = np.array([2.0, -3.0, 0.5])
x = rng.normal(size=(1000, 3))
y = x @ true_w + 0.01 * rng.normal(size=1000)

# Start from rank 0's random weights so every rank holds the same model.
w = hvd.broadcast(np.random.default_rng().normal(size=3), root_rank=0)
lr = 0.1
for step in range(50):
    grad = 2 * x.T @ (x @ w - y) / len(x)
    w -= lr * hvd.allreduce(grad, op=hvd.Average, name="grad")
    if step % 10 == 0 or step == 49:
        loss = hvd.allreduce(np.mean((x @ w - y) ** 2), name="loss")
        if hvd.rank() == 0:
            print(f"step {step:2d}  loss {float(loss):.6f}")

weights = hvd.allgather(w[None, :])
assert np.allclose(weights, weights[0]), "ranks diverged"
if hvd.rank() == 0:
    print(f"{hvd.size()} ranks agree on w = {np.round(w, 3)} (true {true_w})")
