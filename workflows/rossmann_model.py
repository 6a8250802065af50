"""The Rossmann model of Horovod's Keras example: an embedding per categorical column,
batch-normalized continuous columns, dense 1000-1000-1000-500 with L2 and dropout, and a
sigmoid output scaled to the range of log sales. Trained with ``mae`` on log sales, so the
metric ``exp_rmspe`` (Kaggle's RMSPE on sales) exponentiates first.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import cloudpickle

from workflows.rossmann_features import CATEGORICAL_COLS, CONTINUOUS_COLS

if TYPE_CHECKING:
    import keras

# Keras (and TensorFlow) is imported where a function needs it: the workflow's files import
# this module, and a registration or a task without a model should not pay for it.

# The ranks and Spark's Python workers unpickle the metric; send it by value so they need not
# import this module (on a cluster the workflow's code may not be on their path).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

EMBEDDING_DIM = 10


def exp_rmspe(y_true, y_pred):
    """RMSPE of sales when the model predicts log sales."""
    import keras

    ops = keras.ops
    # Labels may arrive as (batch,) beside predictions of (batch, 1): align them, or the
    # difference would broadcast to (batch, batch).
    y_true = ops.reshape(ops.cast(y_true, y_pred.dtype), ops.shape(y_pred))
    pct = (ops.exp(y_true) - ops.exp(y_pred)) / ops.exp(y_true)
    return ops.sqrt(ops.mean(ops.square(pct)))


CUSTOM_OBJECTS = {"exp_rmspe": exp_rmspe}


def build_model(vocab: dict[str, list[str]], max_sales: float, mean_sales: float | None = None,
                seed: int = 0) -> keras.Model:  # fmt: skip
    """One input per feature column, in ``CATEGORICAL_COLS + CONTINUOUS_COLS`` order.

    ``max_sales``/``mean_sales``: the largest and mean log sale of the training rows. The
    output starts at ``mean_sales`` rather than at the middle of its range, which spares the
    first epochs from only shifting the output."""
    import keras

    keras.utils.set_random_seed(seed)
    layers = keras.layers
    l2 = keras.regularizers.l2(5e-5)
    inputs = {col: keras.Input(shape=(1,), name=col) for col in CATEGORICAL_COLS + CONTINUOUS_COLS}
    embeddings = [
        layers.Embedding(len(vocab[col]), EMBEDDING_DIM, name=f"emb_{col}")(inputs[col])
        for col in CATEGORICAL_COLS
    ]
    continuous = layers.Concatenate(name="continuous")(
        [layers.Reshape((1, 1), name=f"reshape_{col}")(inputs[col]) for col in CONTINUOUS_COLS]
    )
    continuous = layers.BatchNormalization()(continuous)
    x = layers.Flatten()(layers.Concatenate()([*embeddings, continuous]))
    for width in (1000, 1000, 1000, 500):
        x = layers.Dense(width, activation="relu", kernel_regularizer=l2)(x)
    x = layers.Dropout(0.5)(x)
    # The tutorial's scaled sigmoid, from built-in layers so the saved model needs no code.
    scale = max_sales * 1.2
    start = min(max((mean_sales or scale / 2) / scale, 0.01), 0.99)
    bias = keras.initializers.Constant(math.log(start / (1 - start)))  # sigmoid(bias) = start
    x = layers.Dense(1, activation="sigmoid", bias_initializer=bias)(x)
    output = layers.Rescaling(scale, name="log_sales")(x)
    return keras.Model([inputs[c] for c in CATEGORICAL_COLS + CONTINUOUS_COLS], output)
