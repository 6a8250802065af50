"""``pyspark.ml`` Params of the estimators and models, with Horovod's names and defaults.

Each param gets ``setX``/``getX`` accessors generated from one table, so the names, defaults
and docs live in one place for the Keras, Torch and Lightning estimators.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from typing import Any

from pyspark.ml.param import Param, Params

from flyte_hvd.core.compression import Compression

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
    "materialize": (
        True,
        "True: write the DataFrame to Parquet in the store, and train from there; False: "
        "each rank trains on its partition of the DataFrame, received straight from Spark",
    ),
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
    "mlflow": (
        None,
        "True (MLflow's MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME) or an MlflowConfig: "
        "track the fit as an MLflow run (params, metrics per epoch, checkpoint, model)",
    ),
    # Horovod's parameters for its petastorm readers and process start: accepted, so code
    # written for Horovod runs; each warns once when set, since ours has no such knob.
    "backward_passes_per_step": (1, "backward passes accumulated locally per reduction"),
    "compress_sparse_cols": (False, "store sparse vector columns compressed (prepare_data)"),
    "mp_start_method": (None, "Horovod's multiprocessing start method (no effect here)"),
    "tensorflow_dataset_prefetch_buffer_size": (
        100,
        "Horovod's tf.data prefetch (no effect here: batches are prefetched per group)",
    ),
    "label_shapes": (None, "Horovod's label reshaping (no effect here)"),
    "reader_pool_type": ("thread", "Horovod's petastorm reader pool (no effect here)"),
    "train_reader_num_workers": (2, "Horovod's petastorm readers (no effect here)"),
    "val_reader_num_workers": (2, "Horovod's petastorm readers (no effect here)"),
    "transformation_edit_fields": (None, "Horovod's petastorm schema edit (no effect here)"),
    "transformation_removed_fields": (None, "Horovod's petastorm schema edit (no effect here)"),
}

# Every estimator's check of the loss after each epoch (Horovod's Lightning flag of this name was
# Lightning 1's Trainer flag; LightningEstimator checks the losses as Keras and Torch do).
NAN_PARAM: dict[str, tuple[Any, str]] = {
    "terminate_on_nan": (
        True,
        "end the fit with an error naming the epoch and rank when an epoch's loss is NaN or "
        "infinite; False keeps training",
    ),
}

# Params ``save`` leaves out of a saved estimator: they hold a live session or a store with its
# credentials, and are given again after ``load``.
UNSAVED_PARAMS = ("backend", "store")


def param_to_save(name: str, value: object) -> object:
    """What a saved estimator keeps of one param: None (nothing) for ``UNSAVED_PARAMS`` and
    unset values, otherwise the value (all kept values are pickled together, so an optimizer
    keeps pointing at its model's parameters)."""
    return None if name in UNSAVED_PARAMS else value


# TorchEstimator's and LightningEstimator's choice of how gradients are averaged.
DISTRIBUTED_CHOICES = ("horovod", "ddp")
DISTRIBUTED_PARAM: dict[str, tuple[Any, str]] = {
    "distributed": (
        "horovod",
        "'horovod': flyte_hvd's DistributedOptimizer (Lightning: HorovodStrategy); 'ddp': "
        "torch's DistributedDataParallel over a torch.distributed process group, NCCL when "
        "the rank has a GPU, else gloo (Lightning: its DDPStrategy)",
    ),
}


def check_distributed(value: object, compression: object) -> None:
    """``distributed`` is one of ``DISTRIBUTED_CHOICES``; with ``ddp``, no gradient
    compression (torch's DDP reduces gradients in their own dtype)."""
    if not isinstance(value, str) or value not in DISTRIBUTED_CHOICES:
        raise ValueError(
            f"`distributed` must be 'horovod' (flyte_hvd's DistributedOptimizer) or 'ddp' "
            f"(torch's DistributedDataParallel); found {value!r}."
        )
    if value == "ddp" and compression not in (None, Compression.none):
        name = getattr(compression, "__name__", repr(compression))
        raise ValueError(
            f"`gradient_compression`={name} applies to distributed='horovod'; "
            f"with distributed='ddp' torch reduces the gradients in their own dtype. Leave "
            f"`gradient_compression` unset, or use distributed='horovod'."
        )


# Params accepted for Horovod compatibility that change nothing here: name -> why.
INERT_PARAMS: dict[str, str] = {
    "mp_start_method": "ranks are processes of their own, started by flyte-hvd's launcher",
    "tensorflow_dataset_prefetch_buffer_size": "the loader prefetches groups of batches itself",
    "label_shapes": "labels keep their column's shape",
    "reader_pool_type": "the ArrowDataLoader reads with one thread of its own",
    "train_reader_num_workers": "the ArrowDataLoader reads with one thread of its own",
    "val_reader_num_workers": "the ArrowDataLoader reads with one thread of its own",
    "transformation_edit_fields": "`transformation_fn` may change values, not the schema",
    "transformation_removed_fields": "`transformation_fn` may change values, not the schema",
}

MODEL_PARAMS: dict[str, tuple[Any, str]] = {
    "history": (None, "metric name -> value per epoch"),
    "run_id": (None, "the run that produced the model"),
    "mlflow_run_id": (None, "the MLflow run of the fit, when it was tracked"),
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
    "transform_batch_rows": (
        40_000,
        "rows per model call in transform: Spark's Arrow batches (10,000 rows by default) are "
        "joined up to this many; a model call's memory grows with it; None: Spark's batches",
    ),
}


def column_names(value: Any) -> Any:
    """A column list param's value as ``_set`` stores it: one name (a str) is a list of that
    one column, not of its letters; a tuple is a list; other values are left for the checks
    of ``fit`` to name."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, tuple):
        return list(value)
    return value


def store_param(value: Any) -> Any:
    """The ``store`` param's value: a Store as given, or a path or URL as
    ``Store.create(path)`` makes it (checked writable now, as ``Store.create`` does)."""
    from flyte_hvd.data.store import Store

    if isinstance(value, str | os.PathLike):
        return Store.create(os.fspath(value))
    if not isinstance(value, Store):
        raise ValueError(
            f"`store` must be a Store, e.g. store=Store.create('/tmp/flyte-hvd'), or a path or "
            f"URL to create one from (store='/tmp/flyte-hvd'); found {type(value).__name__}."
        )
    return value


# How ``_set`` converts a param's value (pyspark's ``typeConverter``), where it does.
_CONVERTERS: dict[str, Any] = {
    "store": store_param,
    "feature_cols": column_names,
    "label_cols": column_names,
    "feature_columns": column_names,
    "label_columns": column_names,
    "output_cols": column_names,
}


def _with_args_section(doc: str, table: dict[str, tuple[Any, str]]) -> str:
    """``doc`` with an ``Args:`` section listing every param (replacing one made before)."""
    doc = doc.split("\n\n    Args:\n", 1)[0].rstrip()
    entries = [
        f"        {name}: {text} (default {default!r})." for name, (default, text) in table.items()
    ]
    return f"{doc}\n\n    Args:\n" + "\n".join(entries) + "\n"


def check_signature(cls: type, table: dict[str, tuple[Any, str]]) -> list[str]:
    """How ``cls.__init__``'s keyword-only parameters differ from ``table`` (names, order,
    defaults; None stands for a mutable default): empty when they agree."""
    import inspect

    init = cls.__dict__.get("__init__")
    if init is None:
        return [f"{cls.__name__}: no `__init__` of its own (its params are not in its signature)"]
    params = [p for p in inspect.signature(init).parameters.values() if p.name != "self"]
    problems = []
    names = [p.name for p in params]
    if names != list(table):
        problems.append(f"{cls.__name__}: parameters {names} != declared {list(table)}")
    for p in params:
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"{cls.__name__}: `{p.name}` is not keyword-only")
        if p.name in table:
            declared = table[p.name][0]
            expected = None if isinstance(declared, list | dict) else declared
            if p.default != expected or type(p.default) is not type(expected):
                problems.append(
                    f"{cls.__name__}: `{p.name}` defaults to {p.default!r}, declared {declared!r}"
                )
    return problems


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def with_params(table: dict[str, tuple[Any, str]]):
    """Class decorator: a ``Param`` plus ``setX``/``getX`` for each entry of ``table``, and
    an ``Args:`` entry per param in the class docstring (what ``help()`` shows). The table is
    the one declaration of a param's name, default and doc; a class's explicit keyword-only
    ``__init__`` must match it (``check_signature``, run by the tests)."""

    def decorate(cls):
        cls.__doc__ = _with_args_section(cls.__doc__ or "", table)
        for name, (_, doc) in table.items():
            convert = _CONVERTERS.get(name)
            param = Param(Params._dummy(), name, doc, typeConverter=convert)
            setattr(cls, name, param)
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


@with_params(ESTIMATOR_PARAMS)
class EstimatorParams(Params):
    """The params every estimator has (Horovod's class name), as ``pyspark.ml`` Params."""


# -- an estimator's arguments --------------------------------------------------------------


def passed_params(values: dict[str, Any]) -> dict[str, Any]:
    """The arguments an estimator's keyword-only ``__init__`` was given, from its
    ``locals()``: those left at their signature's default are not set, so the param keeps
    its declared default (``[]`` where the signature says None)."""
    defaults = inspect.signature(values["__class__"].__init__).parameters
    return {
        name: value
        for name, value in values.items()
        if name in defaults and name != "self" and value is not defaults[name].default
    }


_warned: set[tuple[str, str]] = set()


def warn_inert(estimator: str, inert: dict[str, str], given: dict[str, Any]) -> None:
    """One warning per process and param for Horovod params that change nothing here."""
    for name, value in given.items():
        why = inert.get(name)
        if why and (estimator, name) not in _warned:
            _warned.add((estimator, name))
            warnings.warn(
                f"{estimator}: `{name}`={value!r} is accepted for Horovod compatibility and "
                f"has no effect: {why}.",
                stacklevel=3,
            )


def check_learning_rate(rate: object, where: str) -> None:
    """A plain learning rate must be a finite number >= 0: a negative one trains without an
    error, climbing the loss (gradient ascent), and NaN or infinity fill the weights with NaN."""
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or not math.isfinite(rate)
        or rate < 0
    ):
        shown = f"{rate:.6g}" if isinstance(rate, float) else repr(rate)  # float32's digits
        raise ValueError(
            f"{where} has learning rate {shown}; it must be a finite number >= 0 (a negative "
            f"rate climbs the loss). Build the optimizer with the rate for one rank, e.g. 0.01: "
            f"the ranks scale it by their number."
        )


def fresh_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """Defaults with their own copies of mutable values (lists, dicts)."""
    return {k: (type(v)(v) if isinstance(v, list | dict) else v) for k, v in defaults.items()}
