"""What every estimator's training function shares on the ranks, whatever the framework: the
spec's common fields, the data loaders, and the run's record in the store (read to resume,
written by rank 0 after each epoch). Imports no deep-learning framework and no pyspark.

A run in the store::

    runs/<run_id>/checkpoint<ext>   the best model (with a checkpoint callback) or the last
    runs/<run_id>/last<ext>         the last completed epoch, for resuming
    runs/<run_id>/state.json        epochs completed, metric history, epoch seconds, and the
                                    checkpoint's monitored value (``best``) when it has one
    runs/<run_id>/logs/             TensorBoard (or other) logs
    runs/<run_id>/lease.json        while a fit runs: which fit (``flyte_hvd.estimators.runs``)

Every file is replaced atomically, and ``state.json`` last, so it never names an epoch whose
model is not saved.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

from flyte_hvd.core.errors import ExplainedError
from flyte_hvd.core.log import get_logger
from flyte_hvd.estimators import tracking
from flyte_hvd.launch import progress, spare

if TYPE_CHECKING:
    import pyarrow as pa

    from flyte_hvd.data.dataset import DatasetMetadata
    from flyte_hvd.data.loader import BaseDataLoader, Batch
    from flyte_hvd.data.store import RemoteStore

logger = get_logger(__name__)


@dataclass(kw_only=True)
class TrainingSpec:
    """Everything a rank needs to train, as plain values (no driver objects); each framework
    adds its own fields in a subclass."""

    store: RemoteStore
    model_bytes: bytes
    features: list[str]
    labels: list[str]
    sample_weight_col: str | None
    metadata: tuple[DatasetMetadata, DatasetMetadata | None]  # train, validation
    batch_size: int
    val_batch_size: int
    epochs: int
    verbose: int
    shuffle: bool
    shuffle_buffer_size: int | None
    random_seed: int | None
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    transformation_fn: Callable[[Batch], Batch] | None = None
    inmemory_cache_all: bool | None = None
    data_loader: type[BaseDataLoader] | None = None
    use_gpu: bool = True
    distributed: str = "horovod"  # the PyTorch estimators' `distributed` ("horovod" or "ddp")
    terminate_on_nan: bool = True  # a NaN or infinite epoch loss ends the fit
    # False: the rank's rows come from its partition of the DataFrame (``run(fn, data=df)``),
    # not from Parquet in the store.
    materialize: bool = True
    mlflow_run: tracking.MlflowRun | None = None  # opened by the driver; rank 0 logs to it


class NonFiniteLossError(ExplainedError):
    """An epoch's loss was NaN or infinite (``terminate_on_nan``, on by default)."""


def check_loss(spec: TrainingSpec, logs: dict[str, Any], epoch: int, rank: int) -> None:
    """With ``terminate_on_nan``: an epoch whose losses (the metrics named ``*loss``, averaged
    over the ranks) are not all finite ends the fit, naming the epoch (from 1) and the rank,
    before the epoch is recorded."""
    if not spec.terminate_on_nan:
        return
    bad = {}
    for key, value in logs.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if key.endswith("loss") and not math.isfinite(number):
            bad[key] = number
    if bad:
        found = ", ".join(f"{key} {value}" for key, value in bad.items())
        raise NonFiniteLossError(
            f"the loss became {next(iter(bad.values()))} at epoch {epoch + 1} on rank {rank} "
            f"({found}): training diverged, and the model would predict NaN. Lower the "
            f"learning rate (the ranks scale it by their number), check the data for extreme "
            f"values, or pass terminate_on_nan=False to keep training."
        )


# -- the run in the store ----------------------------------------------------------------------


def run_file(store: RemoteStore, name: str) -> str:
    """``runs/<run_id>/<name>`` of the store's run."""
    return store.run_path.rstrip("/") + "/" + name


def checkpoint_path(store: RemoteStore, extension: str) -> str:
    """Where the run's model goes: the store's ``checkpoint_filename`` when one was chosen,
    else ``checkpoint<extension>`` (``.keras``, ``.pt``, ``.ckpt``)."""
    return store.checkpoint_path(extension)


def read_run_state(store: RemoteStore) -> dict | None:
    """The run's ``state.json``, or None for a new run.

    Raises:
        ValueError: the file is not JSON, or a field has the wrong type (naming the file,
            the field and what to do), rather than a resume that fails somewhere later.
    """
    path = store.state_path
    if not store.exists(path):
        return None
    problem: str | None
    try:
        state = json.loads(store.read(path))
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        problem = f"it is not JSON ({error})"
    else:
        problem = state_problem(state)
    if problem is not None:
        raise ValueError(
            f"run `{store.run_id}` cannot resume: its record `{path}` is damaged: {problem}. "
            f"Restore that file, or delete the run's folder `{store.run_path}` to train it "
            f"from the start, or give a new `run_id`."
        )
    return state


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# state.json's fields: name -> (required, check, what the check wants).
_STATE_FIELDS: dict[str, tuple[bool, Callable[[Any], bool], str]] = {
    "epoch": (True, _count, "an int >= 0 (epochs completed)"),
    "epochs": (False, _count, "an int >= 0"),
    "history": (
        False,
        lambda v: (
            isinstance(v, dict)
            and all(
                isinstance(k, str) and isinstance(x, list) and all(map(_number, x))
                for k, x in v.items()
            )
        ),
        "an object of metric name -> list of numbers",
    ),
    "epoch_seconds": (
        False,
        lambda v: isinstance(v, list) and all(map(_number, v)),
        "a list of numbers",
    ),
    "first_step_at": (False, lambda v: v is None or _number(v), "a number or null"),
    "best": (False, _number, "a number"),
}


def state_problem(state: object) -> str | None:
    """What is wrong with a parsed ``state.json`` (None: nothing)."""
    if not isinstance(state, dict):
        return f"expected a JSON object, found {type(state).__name__}"
    for name, (required, check, wanted) in _STATE_FIELDS.items():
        if name not in state:
            if required:
                return f"`{name}` is missing (expected {wanted})"
        elif not check(state[name]):
            return f"`{name}` must be {wanted}; found {state[name]!r}"
    return None


def archive_problem(file: IO[bytes]) -> str | None:
    """What makes a saved model unreadable (None: nothing): every model file the estimators
    write is a zip archive (Keras' ``.keras``; ``torch.save``'s format, so ``.pt`` and
    Lightning's ``.ckpt``), so an empty or truncated file, or a member whose checksum fails,
    is found without the framework."""
    try:
        with zipfile.ZipFile(file) as archive:
            if not archive.namelist():
                return "it is an empty archive"
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
        return f"it is not a complete model archive ({type(error).__name__}: {error})"
    return None if damaged is None else f"its member `{damaged}` fails its checksum"


def merge_history(state: dict | None, new: dict[str, list[float]]) -> dict[str, list[float]]:
    """The history of earlier attempts of the run followed by this attempt's epochs."""
    past = (state or {}).get("history", {})
    keys = list(past) + [k for k in new if k not in past]
    return {k: list(past.get(k, [])) + [float(v) for v in new.get(k, [])] for k in keys}


@dataclass
class RankRun:
    """One rank's part of a run: who it is, the run's state (None for a new run), a private
    temporary folder, and the files downloaded there to resume from."""

    rank: int
    size: int
    state: dict | None
    work: str
    resume_file: str | None = None  # the run's last model, when resuming
    best_file: str | None = None  # rank 0: the run's best model so far, when state has one
    mlflow_run: tracking.MlflowRun | None = None
    mlflow: ModuleType | None = None  # rank 0 of a tracked run: ``mlflow``, its run active

    @property
    def initial_epoch(self) -> int:
        """The first epoch to train: the one after the last completed epoch."""
        return self.state["epoch"] if self.state else 0

    @property
    def best_value(self) -> float | None:
        """The checkpoint callback's best monitored value so far (None: no such record)."""
        return (self.state or {}).get("best")

    def result(self, model_bytes: Callable[[], bytes], history: dict) -> dict:
        """What the training function returns: rank 0 the model and the run's whole history
        (earlier attempts included); every rank its rank and host."""
        mine = {"rank": self.rank, "host": socket.gethostname()}
        if self.rank != 0:
            return mine
        return {**mine, "model": model_bytes(), "history": merge_history(self.state, history)}

    def log_model(self, record: RunRecord | None, log_model: tracking.ModelLogger) -> None:
        """Rank 0 of a tracked run: log the run's checkpoint and, with ``log_model(mlflow,
        registered_model_name)``, the model in its framework's flavour."""
        if self.mlflow is not None and self.mlflow_run is not None:
            checkpoint = record.checkpoint_file if record is not None else None
            tracking.log_outcome(self.mlflow, self.mlflow_run, checkpoint, log_model)


@contextmanager
def rank_run(
    spec: TrainingSpec,
    hvd: ModuleType,
    extension: str,
    seed: Callable[[int], Any] | None = None,
    resume_on_every_rank: bool = False,
) -> Iterator[RankRun]:
    """Start this rank's part of the run: initialize the collective core, seed with
    ``random_seed + rank``, share rank 0's reading of ``state.json``, and download the files
    to resume from into a temporary folder (rank 0's, or every rank's when the framework
    restores on each rank). The folder is removed when the block ends."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if spec.random_seed is not None and seed is not None:
        seed(spec.random_seed + rank)
    store = spec.store
    state = hvd.broadcast_object(read_run_state(store) if rank == 0 else None, root_rank=0)
    progress.reset()
    with tempfile.TemporaryDirectory(prefix="flyte-hvd-train-") as work:
        run = RankRun(rank=rank, size=size, state=state, work=work, mlflow_run=spec.mlflow_run)
        if spec.mlflow_run is not None:
            run.mlflow = tracking.enter_rank(spec.mlflow_run, rank)
        if state and (rank == 0 or resume_on_every_rank):
            run.resume_file = os.path.join(work, f"resume{extension}")
            store.download_file(run_file(store, f"last{extension}"), run.resume_file)
        if rank == 0 and run.best_value is not None:
            run.best_file = os.path.join(work, f"best{extension}")
            store.download_file(checkpoint_path(store, extension), run.best_file)
        # The framework is imported: the next fit's rank process may start importing now, while
        # this rank loads the model and traces its step, mostly on one core. Started after
        # the first step instead, its imports competed with training on both cores
        # (benchmarks.estimator: the Keras steady epoch 0.91x -> 1.20x plain on 2 cores).
        spare.rank_is_warm()
        failed = True
        try:
            yield run
            failed = False
        finally:
            tracking.leave_rank(run.mlflow, failed)


class RunRecord:
    """Rank 0's record of the run: after each epoch it publishes the checkpoint (the best
    model when there is one, else the last), the last model, the logs and then
    ``state.json``, and prints one summary line."""

    def __init__(
        self, store: RemoteStore, state: dict | None, epochs: int, extension: str, verbose: int = 1
    ):
        self.store, self.epochs, self.verbose = store, epochs, verbose
        self.checkpoint_path = checkpoint_path(store, extension)
        self.last_path = run_file(store, f"last{extension}")
        self.history = {k: list(v) for k, v in (state or {}).get("history", {}).items()}
        self.epoch_seconds = list((state or {}).get("epoch_seconds", []))
        self.best: float | None = (state or {}).get("best")
        self.first_step_at: float | None = None
        self.checkpoint_file: str | None = None  # the local file last published as checkpoint
        self.attempt_seconds: list[float] = []  # this attempt's epochs, for the time left
        self.started = time.monotonic()

    def epoch_begin(self) -> None:
        self.started = time.monotonic()

    def step_begin(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def epoch_end(
        self,
        epoch: int,
        logs: dict[str, float],
        last_file: str,
        best_file: str | None = None,
        logs_dir: str | None = None,
        best_value: float | None = None,
    ) -> None:
        """Publish the epoch. ``best_file`` is the best model so far by the checkpoint
        callback's monitor and ``best_value`` its monitored value, which a resumed run starts
        from (so it keeps the best model of earlier attempts)."""
        if best_value is not None:
            self.best = float(best_value)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))
        store = self.store
        best = best_file if best_file and os.path.exists(best_file) else last_file
        store.upload_file(best, self.checkpoint_path)
        self.checkpoint_file = best
        store.upload_file(last_file, self.last_path)
        if logs_dir and os.path.isdir(logs_dir):
            store.upload_dir(logs_dir, store.logs_path)
        seconds = time.monotonic() - self.started
        self.epoch_seconds.append(seconds)
        self.attempt_seconds.append(seconds)
        state = {
            "epoch": epoch + 1,
            "epochs": self.epochs,
            "history": self.history,
            "epoch_seconds": self.epoch_seconds,
            "first_step_at": self.first_step_at,  # wall clock of this attempt's first step
        }
        if self.best is not None:
            state["best"] = self.best
        store.write_text(store.state_path, json.dumps(state))
        progress.record_epoch(
            epoch + 1, self.epochs, logs, seconds, self.attempt_seconds, self.verbose
        )


# -- data --------------------------------------------------------------------------------------


def make_loaders(
    spec: TrainingSpec, rank: int, size: int
) -> tuple[BaseDataLoader, BaseDataLoader | None]:
    """This rank's train loader and validation loader (None without validation data), with
    ``transformation_fn`` applied to each batch."""
    from flyte_hvd.data.loader import ArrowDataLoader, TransformedLoader

    loader_cls = spec.data_loader or ArrowDataLoader
    # The models compute in float32 (the ranks convert every float batch): Spark's doubles are
    # decoded as float32 once, not converted step after step.
    options = {"float64_as": "float32"} if issubclass(loader_cls, ArrowDataLoader) else {}
    # A `data_loader` class is built with ArrowDataLoader's arguments (as Horovod's are).
    build: Callable[..., BaseDataLoader] = loader_cls
    train_meta, val_meta = spec.metadata
    columns = [*spec.features, *spec.labels]
    if spec.sample_weight_col:
        columns.append(spec.sample_weight_col)

    tables: tuple[pa.Table | None, pa.Table | None] = (None, None)
    if not spec.materialize:
        tables = _partition_tables(spec, rank, size)

    def make(
        path: str,
        metadata: DatasetMetadata,
        batch_size: int,
        shuffle: bool,
        steps: int | None,
        table: pa.Table | None,
    ) -> BaseDataLoader:
        source: dict[str, Any] = {}
        if table is not None:  # ranks of unequal partitions take the same steps
            steps = steps or math.ceil(metadata.rows / (size * batch_size))
            source["table"] = table
        loader = build(
            path,
            batch_size,
            rank=rank,
            size=size,
            store=spec.store,
            columns=columns,
            metadata=metadata,
            shuffle=shuffle,
            shuffle_buffer_size=spec.shuffle_buffer_size or 10_000,
            seed=spec.random_seed or 0,
            inmemory_cache_all=spec.inmemory_cache_all,
            steps_per_epoch=steps,
            **options,
            **source,
        )
        if spec.transformation_fn is not None:
            loader = TransformedLoader(loader, spec.transformation_fn)
        return loader

    streamed = "this rank's partition of the DataFrame ({} rows)"
    train = make(
        spec.store.train_data_path if spec.materialize else streamed.format("training"),
        train_meta,
        batch_size=spec.batch_size,
        shuffle=spec.shuffle,
        steps=spec.train_steps_per_epoch,
        table=tables[0],
    )
    val = None
    if val_meta is not None:
        val = make(
            spec.store.val_data_path if spec.materialize else streamed.format("validation"),
            val_meta,
            batch_size=spec.val_batch_size,
            shuffle=False,
            steps=spec.validation_steps_per_epoch,
            table=tables[1],
        )
    return train, val


def _partition_tables(spec: TrainingSpec, rank: int, size: int) -> tuple[pa.Table, pa.Table | None]:
    """A streamed fit's rows of this rank: its partition of the DataFrame, split into
    training and validation rows in the stored layout.

    Raises:
        ValueError: the rank's partition holds no row of a split (before the first step).
    """
    from flyte_hvd.data.dataset import partition_splits
    from flyte_hvd.stage.partition import get_partition, partition_folder

    train_meta, val_meta = spec.metadata
    # Each split goes to a file beside the partition's, which its task removes with it.
    train, val = partition_splits(
        get_partition(), train_meta.columns, val_meta is not None, partition_folder()
    )
    for split, table, meta in (("training", train, train_meta), ("validation", val, val_meta)):
        if table is not None and meta is not None and table.num_rows == 0:
            raise ValueError(
                f"rank {rank} received no {split} rows: Spark's repartition of the DataFrame "
                f"into {size} partitions left this rank's without any ({meta.rows} {split} "
                f"rows in all). Use fewer ranks, more data, or materialize=True (which "
                f"spreads each split evenly)."
            )
    return train, val
