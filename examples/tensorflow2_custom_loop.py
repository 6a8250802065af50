"""A TensorFlow 2 custom training loop written against Horovod's ``horovod.tensorflow`` API;
only the import line differs (``import flyte_hvd.tensorflow as hvd``).

    flyte-hvd-run -np 2 python examples/tensorflow2_custom_loop.py --steps 20

MNIST-shaped synthetic data (28x28x1 images, 10 classes), a small convnet, the gradient tape
wrapped by ``hvd.DistributedGradientTape`` inside ``tf.function``, the model and optimizer
state broadcast from rank 0 after the first step, and a checkpoint written by rank 0 only.
"""

import argparse
import os
import tempfile

import numpy as np


def synthetic_digits(rank: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Images whose mean brightness in one of ten bands gives the label, plus noise."""
    rng = np.random.default_rng(rank)
    labels = rng.integers(0, 10, size=count)
    images = rng.uniform(0, 64, size=(count, 28, 28)).astype("uint8")
    for i, label in enumerate(labels):
        images[i, 2 * label + 4 : 2 * label + 8, :] = 255
    return images, labels


def main(steps: int = 20, batch_size: int = 64) -> dict:
    import tensorflow as tf

    import flyte_hvd.tensorflow as hvd

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    images, labels = synthetic_digits(hvd.rank(), 2048)
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(2048, seed=hvd.rank()).batch(batch_size)

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dropout(0.25),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    loss_fn = tf.losses.SparseCategoricalCrossentropy()
    opt = tf.optimizers.Adam(0.002 * hvd.size())  # learning rate scaled by the ranks
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

    @tf.function
    def training_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first_batch:  # after the first step, so the optimizer's slots exist
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    losses = []
    for batch, (x, y) in enumerate(dataset.take(steps)):
        loss = training_step(x, y, batch == 0)
        losses.append(float(hvd.allreduce(loss)))  # the mean over ranks, for the log
        if batch % 5 == 0 and hvd.rank() == 0:
            print(f"step {batch} loss {losses[-1]:.4f}")
    if hvd.rank() == 0:
        checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
        print("loss fell from", round(losses[0], 4), "to", round(losses[-1], 4))
    weights = sum(float(tf.reduce_sum(v)) for v in model.trainable_variables)
    return {"losses": losses, "size": hvd.size(), "weights_sum": weights}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    main(steps=parser.parse_args().steps)
