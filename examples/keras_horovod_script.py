"""A Horovod-style Keras training script; only the import line differs from Horovod's.

    flyte-hvd-run -np 2 python examples/keras_horovod_script.py --epochs 4

It follows Horovod's recipe: init, scale the learning rate by the number of ranks, wrap the
optimizer, broadcast the initial state from rank 0, average metrics, warm the learning rate
up, and let only rank 0 print and write checkpoints.
"""

import argparse
import os
import tempfile

import numpy as np


def main(epochs: int = 4, batch_size: int = 32) -> dict:
    import keras
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)

    # Each rank reads its own shard of the data.
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (np.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]).astype("float32")

    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    )
    scaled_lr = 0.01 * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model.compile(optimizer=optimizer, loss="mse")

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1),
    ]
    checkpoint_dir = tempfile.mkdtemp()
    if hvd.rank() == 0:
        callbacks.append(
            keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "ckpt.keras"))
        )

    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )  # fmt: skip
    losses = [round(v, 4) for v in history.history["loss"]]
    if hvd.rank() == 0:
        print("loss per epoch", losses[-1] if len(losses) == 1 else " ".join(map(str, losses)))
        if losses[-1] < losses[0]:
            print("loss fell from", losses[0], "to", losses[-1])
    return {"losses": losses, "size": hvd.size(), "rank": hvd.rank()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    main(epochs=parser.parse_args().epochs)
