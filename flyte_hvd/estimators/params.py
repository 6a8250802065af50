"""``pyspark.ml`` Params of the estimators and models, with Horovod's names and defaults.

Each param gets ``setX``/``getX`` accessors generated from one table, so the names, defaults
and docs live in one place for the Keras, Torch and Lightning estimators.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params

# name -> (default, doc). Order is the order of Horovod's EstimatorParams.
ESTIMATOR_PARAMS: dict[str, tuple[Any, str]] = {
    "num_proc": (None, "number of ranks; defaults to spark.default.parallelism"),
    "backend": (None, "object with run(fn, args, kwargs, env) and num_processes()"),
    "store": (None, "Store for intermediate data, checkpoints and logs"),
    "model": (None, "the model to train"),
    "optimizer": (None, "optimizer; defaults to the compiled model's"),
    "loss": (None, "loss; defaults to the compiled model's"),
    "loss_weights": (None, "weights of the losses of a multi-output model"),
    "metrics": ([], "metrics to compute"),
    "custom_objects": ({}, "custom objects needed to load the model (functions, layers)"),
    "feature_cols": (None, "feature columns, mapped in order to the model's inputs"),
    "label_cols": (None, "label columns, mapped in order to the model's outputs"),
    "validation": (None, "fraction in (0, 1) of rows for validation, or a column name"),
    "sample_weight_col": (None, "column of per-row weights"),
    "callbacks": ([], "framework callbacks"),
    "batch_size": (32, "rows per batch on each rank"),
    "val_batch_size": (None, "validation rows per batch on each rank (default batch_size)"),
    "epochs": (1, "epochs to train"),
    "verbose": (1, "0: silent; 1 or 2: rank 0's progress reaches the driver"),
    "shuffle": (True, "shuffle rows between epochs"),
    "shuffle_buffer_size": (None, "rows kept in the in-memory shuffle buffer"),
    "random_seed": (None, "seed for the framework and the data shuffle"),
    "train_steps_per_epoch": (None, "steps per epoch (default: rows / (batch_size * ranks))"),
    "validation_steps_per_epoch": (None, "validation steps per epoch"),
    "partitions_per_process": (10, "Parquet files per rank and split"),
    "run_id": (None, "name of the run in the store; an existing one resumes"),
    "checkpoint_callback": (None, "e.g. BestModelCheckpoint; the file path is set for you"),
    "gradient_compression": (None, "e.g. hvd.Compression.fp16"),
    "transformation_fn": (None, "function applied to each batch dict before training"),
    "inmemory_cache_all": (
        None,
        "keep the rank's decoded shard in memory (None: when it is at most 256 MiB)",
    ),
    "data_loader": (None, "a BaseDataLoader class to read batches (default ArrowDataLoader)"),
    "use_gpu": (True, "pin each rank to its GPU when one is present"),
}

MODEL_PARAMS: dict[str, tuple[Any, str]] = {
    "history": (None, "metric name -> value per epoch"),
    "run_id": (None, "the run that produced the model"),
    "feature_columns": (None, "feature columns, in model input order"),
    "label_columns": (None, "label columns, in model output order"),
    "output_cols": (None, "prediction columns (default <label>__output)"),
    "custom_objects": ({}, "custom objects needed to load the model"),
    "metadata": (None, "per-column dtype and shape recorded by prepare_data"),
    "transform_partition_bytes": (
        64 << 20,
        "transform merges the input's partitions into ones of about this many bytes (Spark's "
        "size estimate), no fewer than the cluster's default parallelism; None keeps them",
    ),
}


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def with_params(table: dict[str, tuple[Any, str]]):
    """Class decorator: a ``Param`` plus ``setX``/``getX`` for each entry of ``table``."""

    def decorate(cls):
        for name, (_, doc) in table.items():
            setattr(cls, name, Param(Params._dummy(), name, doc))
            for accessor, make in (
                (f"set{_camel(name)}", _setter),
                (f"get{_camel(name)}", _getter),
            ):
                if accessor not in cls.__dict__:  # the class body may define its own
                    setattr(cls, accessor, make(name))
        cls._param_defaults = {name: default for name, (default, _) in table.items()}
        return cls

    return decorate


def _setter(name: str):
    def set_value(self, value):
        return self._set(**{name: value})

    set_value.__name__ = f"set{_camel(name)}"
    return set_value


def _getter(name: str):
    def get_value(self):
        return self.getOrDefault(getattr(self, name))

    get_value.__name__ = f"get{_camel(name)}"
    return get_value
