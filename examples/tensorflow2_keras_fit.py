"""Keras ``fit`` on TensorFlow 2 written against Horovod's ``horovod.tensorflow.keras`` API;
only the import line differs (``import flyte_hvd.keras as hvd``).

    flyte-hvd-run -np 2 python examples/tensorflow2_keras_fit.py --epochs 3

MNIST-shaped synthetic data from a ``tf.data`` pipeline that repeats, ``DistributedOptimizer``
with Horovod's arguments, the broadcast / metric-average / warmup callbacks, and checkpoints
from rank 0 only.
"""

import argparse
import os
import tempfile

import numpy as np


def synthetic_digits(rank: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Images whose bright band gives the label (0-9), plus noise; MNIST's shapes."""
    rng = np.random.default_rng(rank)
    labels = rng.integers(0, 10, size=count)
    images = rng.uniform(0, 64, size=(count, 28, 28)).astype("uint8")
    for i, label in enumerate(labels):
        images[i, 2 * label + 4 : 2 * label + 8, :] = 255
    return images, labels


def main(epochs: int = 3, steps_per_epoch: int = 16) -> dict:
    import tensorflow as tf

    import flyte_hvd.keras as hvd

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)

    images, labels = synthetic_digits(hvd.rank(), 2048)
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(2048, seed=hvd.rank()).batch(64)

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    scaled_lr = 0.002 * hvd.size()
    opt = hvd.DistributedOptimizer(
        tf.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
        average_aggregated_gradients=True,
    )  # fmt: skip
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"])  # fmt: skip
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1),
    ]
    if hvd.rank() == 0:
        path = os.path.join(tempfile.mkdtemp(), "checkpoint-{epoch}.keras")
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(path))
    history = model.fit(dataset, steps_per_epoch=steps_per_epoch // hvd.size(),
                        callbacks=callbacks, epochs=epochs,
                        verbose=2 if hvd.rank() == 0 else 0)  # fmt: skip
    losses = [float(v) for v in history.history["loss"]]
    if hvd.rank() == 0:
        print("loss fell from", round(losses[0], 4), "to", round(losses[-1], 4))
    weights = sum(float(tf.reduce_sum(v)) for v in model.trainable_variables)
    return {"losses": losses, "size": hvd.size(), "weights_sum": weights}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    main(epochs=parser.parse_args().epochs)
