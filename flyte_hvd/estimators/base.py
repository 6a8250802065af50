"""What every framework's estimator shares: params checks, data preparation, the launch on
ranks (through a ``backend.Backend``), the trained model's creation, prediction on Arrow
batches, and save/load (as ``persistence.Archived``). ``KerasEstimator``, ``TorchEstimator``
and ``LightningEstimator`` supply only the framework parts: how to check the model, train on
a rank (with ``flyte_hvd.estimators.training``), load the model and predict."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias

import cloudpickle
from pyspark.ml import Estimator, Model

from flyte_hvd.core.checks import require_int
from flyte_hvd.data.loader import AUTO_CACHE_MAX_BYTES, BaseDataLoader
from flyte_hvd.estimators import prediction, report, tracking
from flyte_hvd.estimators.backend import Backend, SparkBackend
from flyte_hvd.estimators.params import (
    ESTIMATOR_PARAMS,
    INERT_PARAMS,
    MODEL_PARAMS,
    EstimatorParams,
    fresh_defaults,
    param_to_save,
    warn_inert,
    with_params,
)
from flyte_hvd.estimators.persistence import PARAMS_FILE, Archived
from flyte_hvd.stage.dispatch import default_parallelism, estimated_bytes, is_connect_session

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType

    from flyte_hvd.data.dataset import DatasetMetadata
    from flyte_hvd.data.prepare import Streamed
    from flyte_hvd.data.store import RemoteStore
    from flyte_hvd.estimators.training import TrainingSpec
    from flyte_hvd.stage.dispatch import AnySparkSession

# The prepared dataset's metadata: the train split's, and the validation split's (or None).
Metadata = tuple["DatasetMetadata", "DatasetMetadata | None"]

# The trained model as its framework holds it: a ``keras.Model``, the torch estimator's
# ``{"model": torch.nn.Module, "optimizer": ...}``, a ``LightningModule``.
FrameworkModel: TypeAlias = Any

# A prediction function on a Python worker: the feature columns of an Arrow batch in, one
# result column per label out.
BatchPredictor: TypeAlias = "Callable[[list[pa.Array]], list[pa.Array]]"


class Shipped(Protocol):
    """Model bytes on their way to the workers: a Spark ``Broadcast`` or ``_Inline``."""

    @property
    def value(self) -> bytes: ...


class Broadcaster(Protocol):
    """Ships model bytes to the workers: a ``SparkContext`` or ``_InlineBroadcast``."""

    def broadcast(self, value: bytes) -> Shipped: ...


@with_params(ESTIMATOR_PARAMS)
class HorovodEstimator(Estimator, EstimatorParams, Archived):
    """A ``pyspark.ml`` Estimator whose ``fit`` trains on ranks inside a Spark barrier stage.
    ``save``/``load`` keep its params but ``backend`` and ``store`` (so it can be a stage of
    a saved ``Pipeline``); set those again after loading."""

    _archive_name = "estimator.zip"  # what save() writes: the params

    if TYPE_CHECKING:  # ``with_params`` adds a ``getX``/``setX`` pair per param
        _param_defaults: ClassVar[dict[str, Any]]

        # The accessors are generated from the params table: each param's value is whatever
        # that param holds (a model, a Store, a list of column names...).
        def __getattr__(self, name: str) -> Any: ...

    def __new__(cls, *args: object, **kwargs: object) -> HorovodEstimator:
        # Before the keyword-only `__init__` refuses it with Python's bare TypeError: say
        # which names are unknown, the likely intended one, and where the list is.
        unknown = sorted(set(kwargs) - set(cls._param_defaults))
        if unknown:
            hints = [
                f"`{name}` (did you mean `{close[0]}`?)" if close else f"`{name}`"
                for name in unknown
                for close in [difflib.get_close_matches(name, cls._param_defaults, n=1)]
            ]
            raise ValueError(
                f"{cls.__name__} got unknown parameter(s) {', '.join(hints)}; "
                f"help({cls.__name__}) lists its parameters."
            )
        return super().__new__(cls)

    def __init__(self, **kwargs: object):  # the params' values, checked by `fit`
        super().__init__()
        self._setDefault(**fresh_defaults(self._param_defaults))
        self._set(**kwargs)
        given = {k: v for k, v in kwargs.items() if v != self._param_defaults[k]}
        warn_inert(type(self).__name__, {**INERT_PARAMS, **self._inert_params}, given)

    def _saved_files(self) -> dict[str, bytes]:
        params = {p.name: param_to_save(p.name, v) for p, v in self._paramMap.items()}
        kept = {name: v for name, v in params.items() if v is not None}
        return {PARAMS_FILE: cloudpickle.dumps(kept)}

    @classmethod
    def _from_saved(cls, files: dict[str, bytes]) -> HorovodEstimator:
        return cls(**cloudpickle.loads(files[PARAMS_FILE]))

    # -- checks that run before any rank starts ---------------------------------------------

    def _check_params(self, columns: list[str] | None) -> None:
        if self.getNumProc() is not None and self.getBackend() is not None:
            raise ValueError(
                "`num_proc` and `backend` are exclusive: set the number of ranks on the backend "
                "(e.g. SparkBackend(num_proc=2)) or pass only `num_proc`."
            )
        require_int("batch_size", self.getBatchSize(), minimum=1)
        require_int("epochs", self.getEpochs(), minimum=1)
        _check_materialize(self.getMaterialize(), self.getBackend())
        if self.getValBatchSize() is not None:
            require_int("val_batch_size", self.getValBatchSize(), minimum=1)
        if self.getInmemoryCacheAll() not in (None, True, False):
            raise ValueError(
                f"`inmemory_cache_all` must be True (keep each rank's shard in memory), False "
                f"(read it from the store every epoch) or None (keep it when it decodes to at "
                f"most {AUTO_CACHE_MAX_BYTES >> 20} MiB); found {self.getInmemoryCacheAll()!r}."
            )
        loader = self.getDataLoader()
        if loader is not None and not (
            isinstance(loader, type) and issubclass(loader, BaseDataLoader)
        ):
            raise ValueError(
                f"`data_loader` must be a BaseDataLoader subclass (the class: the estimator "
                f"builds one per rank), e.g. a subclass of ArrowDataLoader; found {loader!r}."
            )
        tracking.resolve_config(self.getMlflow())
        if self.getStore() is None:
            raise ValueError("`store` is required: e.g. store=Store.create('/tmp/flyte-hvd').")
        labels = self.getLabelCols()
        if not labels:
            raise ValueError("`label_cols` is required: the column(s) the model predicts.")
        if columns is not None:
            wanted = [*self._feature_cols(columns), *labels]
            if self.getSampleWeightCol():
                wanted.append(self.getSampleWeightCol())
            if isinstance(self.getValidation(), str):
                wanted.append(self.getValidation())
            missing = [c for c in wanted if c not in columns]
            if missing:
                raise ValueError(
                    f"column(s) {missing} are not in the DataFrame; it has {columns}. Check "
                    f"`feature_cols`, `label_cols`, `sample_weight_col` and `validation`."
                )
        features = self._feature_cols(columns) if columns is not None else self.getFeatureCols()
        weight = self.getSampleWeightCol()
        roles = {
            "feature_cols": list(features or []),
            "label_cols": list(labels),
            "sample_weight_col": [weight] if weight else [],
        }
        _check_roles(roles)
        self.getStore().check_writable()

    def _feature_cols(self, columns: list[str]) -> list[str]:
        features = self.getFeatureCols()
        if features:
            return list(features)
        skip = {*self.getLabelCols(), self.getSampleWeightCol(), self.getValidation()}
        return [c for c in columns if c not in skip]

    def _backend(self) -> Backend:
        backend = self.getBackend()
        # Spare ranks import MLflow too when rank 0 will log to it (seconds of imports).
        preload = (*self._preload, "mlflow") if self.getMlflow() else self._preload
        if backend is None:
            return SparkBackend(self.getNumProc(), verbose=self.getVerbose(), preload=preload)
        if isinstance(backend, SparkBackend) and not backend.preload:
            backend.preload = preload  # a user's backend gets spares too
        return backend

    def _check_slots(self, backend: Backend) -> None:
        """The cluster can hold the ranks: checked before the data is prepared and spare rank
        processes start (a backend of the user's is left to its own checks)."""
        if isinstance(backend, SparkBackend):
            backend.check_slots()

    @contextlib.contextmanager
    def _run(self) -> Iterator[tuple[str, bool]]:
        """The run this fit trains (``flyte_hvd.estimators.runs``): leased for the block, and
        checked for resuming, before any data is prepared. Yields its id, and whether it has
        trained ``epochs`` already (its model is then returned without training)."""
        from flyte_hvd.estimators.runs import check_resumable, leased_run
        from flyte_hvd.launch.failures import as_flyte_errors

        store = self.getStore()
        # In a Flyte task, a failure a retry can fix leaves as the kind its SDK retries.
        with as_flyte_errors(), leased_run(store, self.getRunId(), self._framework) as run_id:
            finished = check_resumable(
                store.to_remote(run_id), self.getEpochs(), self._extension, self._epoch_in_model
            )
            yield run_id, finished

    # -- fit ---------------------------------------------------------------------------------

    def _fit(self, df: DataFrame) -> Model:
        from flyte_hvd.data.columns import check_spark_dataframe

        check_spark_dataframe(df, f"the DataFrame given to {type(self).__name__}.fit")
        self._check_params(df.columns)
        features = self._feature_cols(df.columns)
        self._check_model(features, self.getLabelCols())
        backend = self._backend()
        self._check_slots(backend)
        with (
            self._run() as (run_id, finished),
            self._mlflow_run(backend, run_id) as mlflow_run,
            _training_data(self, backend, df, features, finished) as (dataset_idx, streamed),
        ):
            return self._fit_on_prepared(
                backend, dataset_idx, features, run_id, mlflow_run, finished, streamed
            )

    def fit_on_parquet(self, params: dict | None = None, dataset_idx: str | None = None) -> Model:
        """Train on data already in the store's train/val paths (written by ``prepare_data``
        or by anything else that writes Parquet there). ``params``, as in Horovod and
        ``fit``, overrides params for this call (on a copy of the estimator)."""
        if params:
            return self.copy(params).fit_on_parquet(dataset_idx=dataset_idx)
        self._check_params(None)
        features = self.getFeatureCols()
        if not features:
            raise ValueError("`fit_on_parquet` needs `feature_cols`: there is no DataFrame.")
        self._check_model(list(features), self.getLabelCols())
        backend = self._backend()
        self._check_slots(backend)
        with self._run() as (run_id, finished), self._mlflow_run(backend, run_id) as mlflow_run:
            return self._fit_on_prepared(
                backend, dataset_idx, list(features), run_id, mlflow_run, finished
            )

    @contextlib.contextmanager
    def _mlflow_run(self, backend: Backend, run_id: str) -> Iterator[tracking.MlflowRun | None]:
        """With ``mlflow``: the MLflow run, opened before the data is prepared or any rank
        starts, with the estimator's params; marked FAILED if the fit fails."""
        config = tracking.resolve_config(self.getMlflow())
        if config is None:
            yield None
            return
        skip = {"mlflow", "backend", *INERT_PARAMS, *self._inert_params}
        params = {k: self.getOrDefault(k) for k in self._param_defaults if k not in skip}
        params.update(
            num_proc=backend.num_processes(),
            run_id=run_id,
            framework=self._framework,
            store=getattr(self.getStore(), "prefix_path", None),
        )
        run = tracking.start_run(config, run_id, tracking.loggable_params(params))
        failed = True
        try:
            yield run
            failed = False
        finally:
            tracking.end_run(run, failed)

    def _fit_on_prepared(
        self,
        backend: Backend,
        dataset_idx: str | None,
        features: list[str],
        run_id: str,
        mlflow_run: tracking.MlflowRun | None = None,
        finished: bool = False,
        streamed: Streamed | None = None,
    ) -> Model:
        from flyte_hvd.data.prepare import get_dataset_metadata
        from flyte_hvd.data.store import bounded
        from flyte_hvd.estimators.training import read_run_state

        store = self.getStore()
        # (train, validation or None)
        metadata = streamed.metadata if streamed else get_dataset_metadata(store, dataset_idx)
        model_params = self._check_data(features, metadata)
        remote_store = store.to_remote(run_id, dataset_idx)
        if finished:  # no rank starts: the run's model, from its checkpoint in the store
            state = read_run_state(remote_store) or {}
            results = [
                {
                    "model": self._finished_model(run_id, features),
                    "history": state.get("history", {}),
                }
            ]
        else:
            spec = self._training_spec(remote_store, features, metadata, backend.num_processes())
            spec.mlflow_run = mlflow_run
            if streamed is not None:
                assert isinstance(backend, SparkBackend)  # checked by `_fit_streamed`
                results = backend.run(self._remote_trainer(), args=(spec,), data=streamed.df)
            else:
                results = backend.run(self._remote_trainer(), args=(spec,))
        result = results[0]
        report.add_fit_report(type(self).__name__, results, remote_store, run_id, mlflow_run)
        if not store.saving_runs:  # the trained model is in `result`; the run folder can go
            run_path = store.get_run_path(run_id)
            bounded(store, ("deleting", "from"), run_path, 0, store.delete, run_path)
        return self._model_class(
            model_bytes=result["model"],
            history=result["history"],
            run_id=run_id,
            mlflow_run_id=mlflow_run.run_id if mlflow_run else None,
            feature_columns=features,
            label_columns=list(self.getLabelCols()),
            metadata=metadata,
            **model_params,
        )

    def _spec_fields(
        self,
        remote_store: RemoteStore,
        features: list[str],
        metadata: Metadata,
    ) -> dict:
        """The fields of ``training.TrainingSpec`` that every framework fills the same way: a
        field named after a param takes the param's value."""
        from flyte_hvd.estimators.training import TrainingSpec

        values = {
            f.name: self.getOrDefault(f.name)
            for f in dataclasses.fields(TrainingSpec)
            if f.name in self._param_defaults
        }
        values.update(
            store=remote_store,
            features=features,
            labels=list(self.getLabelCols()),
            metadata=metadata,
            val_batch_size=self.getValBatchSize() or self.getBatchSize(),
        )
        return values

    # -- framework hooks ----------------------------------------------------------------------

    _framework = "model"
    # The framework's Horovod params that change nothing here (beyond ``INERT_PARAMS``).
    _inert_params: ClassVar[dict[str, str]] = {}
    _extension = ""  # of the run's model files: ".keras", ".pt", ".ckpt"
    _epoch_in_model = False  # resumes at the epoch its model file records (Lightning)
    # What the ranks import before they train: spare rank processes import it ahead of the
    # next fit (``flyte_hvd.launch.spare``), which then starts in a fraction of the time.
    _preload: tuple[str, ...] = ()
    _model_class: type[HorovodModel]

    def _check_model(self, features: list[str], labels: list[str]) -> None:
        """Checks that need only the params (before the data is prepared)."""
        raise NotImplementedError

    def _read_checkpoint(self, run_id: str) -> bytes:
        """The run's model file in the store, as bytes: the best model with a checkpoint
        callback, else the last (``training.checkpoint_path``)."""
        from flyte_hvd.estimators.training import checkpoint_path

        remote = self.getStore().to_remote(run_id)
        return remote.read(checkpoint_path(remote, self._extension))

    def _finished_model(self, run_id: str, features: list[str]) -> bytes:
        """The model bytes a fit returns for a run that trained its epochs already, as a
        fit's ranks would hand them back."""
        raise NotImplementedError

    def _check_data(self, features: list[str], metadata: Metadata) -> dict[str, Any]:
        """Checks against the prepared columns (still before any rank starts); returns extra
        params for the trained model."""
        return {}

    def _training_spec(
        self, remote_store: RemoteStore, features: list[str], metadata: Metadata, num_proc: int
    ) -> TrainingSpec:
        raise NotImplementedError

    def _remote_trainer(self) -> Callable[..., dict]:
        """The function every rank runs: ``fn(spec) -> dict``; rank 0 returns ``model``
        (bytes) and ``history``."""
        raise NotImplementedError


@with_params(MODEL_PARAMS)
class HorovodModel(Model, Archived):
    """A trained model as a ``pyspark.ml`` Transformer: ``transform`` appends one prediction
    column per label, computed on Arrow batches by an iterator Arrow UDF with the model loaded
    once per Python worker (never one row at a time; Spark's batches joined up to
    ``transform_batch_rows`` rows per model call), after merging small input partitions
    (``transform_partition_bytes``; rows may then come back in another order)."""

    if TYPE_CHECKING:  # ``with_params`` adds a ``getX``/``setX`` pair per param
        _param_defaults: ClassVar[dict[str, Any]]

        # The accessors are generated from the params table (see ``HorovodEstimator``).
        def __getattr__(self, name: str) -> Any: ...

    _archive_name = "model.zip"  # what save() writes: params and model bytes
    _model_file = "model.bin"

    def __init__(self, model_bytes: bytes | None = None, **kwargs: object):  # params
        """``model_bytes`` (what ``fit`` and ``load`` give), or ``model=``, a framework model
        to predict with as it is (Horovod's way to build a model by hand); ``_metadata`` is
        Horovod's name for ``metadata``."""
        super().__init__()
        self._setDefault(**fresh_defaults(self._param_defaults))
        if "_metadata" in kwargs:
            if "metadata" in kwargs:
                raise TypeError("give `metadata` or `_metadata`, not both.")
            kwargs["metadata"] = kwargs.pop("_metadata")
        model = kwargs.pop("model", None)
        if model is not None:
            if model_bytes is not None:
                raise TypeError("give `model` or `model_bytes`, not both.")
            model_bytes = self._model_to_bytes(model)
        self._set(**kwargs)
        self._model_bytes = model_bytes
        self._model: FrameworkModel | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The prediction UDF holds the session it was built for: a pickled or deep-copied
        # model builds its own.
        return {k: v for k, v in self.__dict__.items() if k != "_cached_prediction_udf"}

    def getModel(self) -> FrameworkModel:
        """The trained framework model, usable outside Spark."""
        if self._model is None:
            self._model = self._load_model(self._trained_bytes())
        return self._model

    def _trained_bytes(self) -> bytes:
        if self._model_bytes is None:
            raise ValueError(
                f"this {type(self).__name__} holds no trained model; get one from an "
                f"estimator's `fit` or `{type(self).__name__}.load(path)`."
            )
        return self._model_bytes

    def _output_cols(self) -> list[str]:
        return list(self.getOutputCols() or [f"{c}__output" for c in self.getLabelColumns()])

    def setOutputCols(self, value: list[str]) -> HorovodModel:
        labels = self.getLabelColumns()
        if not isinstance(value, list | tuple) or len(value) != len(labels):
            raise ValueError(
                f"`output_cols` must list one column per label ({len(labels)}: {labels}); "
                f"found {value!r}."
            )
        return self._set(output_cols=list(value))

    def setTransformPartitionBytes(self, value: int | None) -> HorovodModel:
        return self._set(transform_partition_bytes=_partition_bytes(value))

    def setTransformBatchRows(self, value: int | None) -> HorovodModel:
        return self._set(transform_batch_rows=_batch_rows(value))

    def _transform(self, df: DataFrame) -> DataFrame:
        from pyspark.ml.functions import vector_to_array
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql import functions as F

        outputs = self._output_cols()
        clash = [c for c in outputs if c in df.columns]
        if clash:
            raise ValueError(
                f"output column(s) {clash} already exist in the DataFrame; pick other names "
                f"with setOutputCols([...]) or drop them first."
            )
        features = self.getFeatureColumns()
        missing = [c for c in features if c not in df.columns]
        if missing:
            raise ValueError(
                f"feature column(s) {missing} are not in the DataFrame; it has {df.columns}."
            )
        partition_bytes = _partition_bytes(self.getTransformPartitionBytes())
        max_rows = _batch_rows(self.getTransformBatchRows()) or 1  # 1: each batch alone
        # Vectors enter the UDF as arrays (Arrow does not carry Spark's vector type), of
        # float32: what the models compute in, and half the bytes to move. Passing the vector
        # column itself (the UDF then gets its struct) measured 4x slower on Spark 4.3: the
        # JVM writes that struct to Arrow far slower than it runs vector_to_array.
        inputs = [
            vector_to_array(F.col(c), "float32")
            if isinstance(df.schema[c].dataType, VectorUDT)
            else F.col(c)
            for c in features
        ]
        names = [f"_{i}" for i in range(len(outputs))]
        widths = self._output_widths()
        target = prediction.output_schema(
            df.schema, self.getLabelColumns(), outputs, self.getMetadata(), widths
        ).fields[len(df.columns) :]
        predict_batches = self._prediction_udf(df.sparkSession, names, widths, max_rows)
        predicted = "__flyte_hvd_prediction"
        merged = _merge_small_partitions(df, partition_bytes)
        with_predictions = merged.withColumn(predicted, predict_batches(*inputs))  # type: ignore[arg-type]
        return with_predictions.select(
            *[F.col(f"`{c}`") for c in df.columns],
            *[
                _as_type(F.col(f"{predicted}.{n}"), field.dataType).alias(field.name)
                for n, field in zip(names, target, strict=True)
            ],
        )

    def _prediction_udf(
        self, spark: AnySparkSession, names: list[str], widths: list[int], max_rows: int
    ) -> Callable[..., Column]:
        """The iterator Arrow UDF that predicts, built once per session and param values.

        Building it ships the model (a broadcast, or the bytes in the pickled closure on
        Connect) and pickles the closure: measured on 2 cores, about half of the 80 ms a
        ``transform`` call spent before Spark ran anything, paid again at every call of a
        model that predicts many small DataFrames (a stream's micro-batches). Keyed by the
        identity of every param value it was built from (each held, so no identity is reused)
        and of the session: a changed param or a new session builds a new one."""
        import pyarrow as pa
        from pyspark.sql import functions as F
        from pyspark.sql.functions import ArrowUDFType
        from pyspark.sql.types import ArrayType, DoubleType, FloatType, StructField, StructType

        params = sorted(self.extractParamMap().items(), key=lambda item: item[0].name)
        values = [spark, self._model_bytes, *(value for _, value in params)]
        key = (tuple(names), tuple(widths), max_rows, tuple(map(id, values)))
        cached = self.__dict__.get("_cached_prediction_udf")
        if cached is not None and cached[0] == key:
            return cached[2]
        # The UDF returns doubles and float lists; ``_transform``'s select gives each
        # prediction its label's type (``prediction.output_schema``).
        result_type = StructType(
            [
                StructField(n, DoubleType() if width == 1 else ArrayType(FloatType()), True)
                for n, width in zip(names, widths, strict=True)
            ]
        )
        predict = self._batch_predictor(_broadcaster(spark))

        def predict_batches(batches: Iterator[Any]) -> Iterator[Any]:
            for columns in prediction.joined_batches(batches, max_rows):
                yield pa.StructArray.from_arrays(predict(columns), names=names)

        # An iterator Arrow UDF: the model loads once per worker, then predicts whole Arrow
        # batches, reading list columns without a copy (no pandas objects per row).
        with warnings.catch_warnings():  # the type is explicit: the arity varies with features
            warnings.filterwarnings("ignore", "It is preferred to specify type hints", UserWarning)
            udf = F.arrow_udf(  # type: ignore[call-overload]
                predict_batches, result_type, ArrowUDFType.SCALAR_ITER
            )
        # Assigned, not mutated: a ``copy()`` shares this attribute until it builds its own.
        self._cached_prediction_udf = (key, values, udf)
        return udf

    # -- framework hooks ----------------------------------------------------------------------

    def _load_model(self, data: bytes) -> FrameworkModel:
        raise NotImplementedError

    def _model_to_bytes(self, model: FrameworkModel) -> bytes:
        raise NotImplementedError

    def _output_widths(self) -> list[int]:
        """Values per row of each model output."""
        raise NotImplementedError

    def _batch_predictor(self, sc: Broadcaster) -> BatchPredictor:
        raise NotImplementedError

    # -- persistence --------------------------------------------------------------------------

    def _saved_files(self) -> dict[str, bytes]:
        params = {p.name: v for p, v in self._paramMap.items()}
        return {PARAMS_FILE: cloudpickle.dumps(params), self._model_file: self._trained_bytes()}

    @classmethod
    def _from_saved(cls, files: dict[str, bytes]) -> HorovodModel:
        params = cloudpickle.loads(files[PARAMS_FILE])
        return cls(model_bytes=files[cls._model_file], **params)


@contextlib.contextmanager
def _training_data(
    estimator: HorovodEstimator,
    backend: Backend,
    df: DataFrame,
    features: list[str],
    finished: bool,
) -> Iterator[tuple[str | None, Streamed | None]]:
    """What a fit trains on, checked: ``(dataset index, None)`` for Parquet that
    ``prepare_data`` wrote to the store, or with ``materialize=False`` ``(None, streamed)``,
    ``df``'s columns that the ranks receive straight from Spark (``prepare.stream_data``).
    Once the data passed its checks, spare rank processes start importing the framework."""
    from flyte_hvd.data.prepare import prepare_data, stream_data

    spark_backend = backend if isinstance(backend, SparkBackend) else None
    spares = spark_backend is not None and not finished
    options = {
        "label_columns": estimator.getLabelCols(),
        "feature_columns": features,
        "validation": estimator.getValidation(),
        "sample_weight_col": estimator.getSampleWeightCol(),
        "compress_sparse": bool(estimator.getCompressSparseCols()),
    }
    if not estimator.getMaterialize():
        assert spark_backend is not None  # `_check_params` refuses any other
        on_checked = (lambda: spark_backend.start_spares(data=True)) if spares else None
        yield None, stream_data(backend.num_processes(), df, **options, on_checked=on_checked)
        return
    with prepare_data(
        backend.num_processes(),
        estimator.getStore(),
        df,
        partitions_per_process=estimator.getPartitionsPerProcess(),
        verbose=estimator.getVerbose(),
        on_checked=spark_backend.start_spares if spark_backend and spares else None,
        **options,
    ) as dataset_idx:
        yield dataset_idx, None


def _as_type(column: Column, target: DataType) -> Column:
    """A prediction column (double, or array of float) as ``target``."""
    from pyspark.ml.functions import array_to_vector

    if type(target).__name__ == "VectorUDT":
        return array_to_vector(column)
    if target.typeName() == "float":
        return column.cast("float")
    return column


def _batch_rows(value: object) -> int | None:
    """A ``transform_batch_rows`` value: rows (an int >= 1), or None."""
    return None if value is None else require_int("transform_batch_rows", value, 1)


def _partition_bytes(value: object) -> int | None:
    """A ``transform_partition_bytes`` value: bytes (an int >= 1), or None."""
    return None if value is None else require_int("transform_partition_bytes", value, 1)


def _merge_small_partitions(df: DataFrame, partition_bytes: int | None) -> DataFrame:
    """``df`` coalesced into partitions of about ``partition_bytes`` (Spark's size estimate),
    and no fewer than the cluster's default parallelism, so that every core still predicts.

    Each Spark task that runs a Python UDF costs milliseconds of CPU however few its rows
    (measured on 2 cores: 12-23 ms in the JVM and 2 ms in the Python worker a task), so a
    DataFrame in many small partitions -- ``createDataFrame`` of pandas makes one per 10 k
    rows -- spends more on tasks than on predicting: 1 M such rows in 100 partitions were
    predicted at 0.54-0.68 M rows/s, in 4 at 1.36-1.81 M (``benchmarks.estimator``).
    Coalescing is narrow (no shuffle, the upstream work runs in the merged tasks), as adaptive
    execution merges small shuffle partitions. Spark's coalescer groups partitions by where
    their data lives, so rows can come back in another order than ``df``'s; each keeps all its
    columns."""
    if partition_bytes is None:
        return df
    size = estimated_bytes(df)
    if size is None:
        return df
    partitions = max(default_parallelism(df.sparkSession), -(-size // partition_bytes))
    return df.coalesce(partitions)


def _broadcaster(spark: AnySparkSession) -> Broadcaster:
    """What ``_batch_predictor`` ships the model bytes with: the SparkContext's broadcast on a
    classic session; on Spark Connect, which has no broadcast, the bytes travel inside the
    UDF's pickled closure, sent once with the query plan (mind Connect's message size limit,
    `spark.connect.grpc.maxInboundMessageSize`, for very large models)."""
    return _InlineBroadcast() if is_connect_session(spark) else spark.sparkContext


@dataclass(frozen=True)
class _Inline:
    value: bytes


class _InlineBroadcast:
    @staticmethod
    def broadcast(value: bytes) -> _Inline:
        return _Inline(value)


def _check_materialize(materialize: object, backend: object) -> None:
    if not isinstance(materialize, bool):
        raise ValueError(
            f"`materialize` must be True (write the DataFrame to the store, train from there) "
            f"or False (train on its partitions straight from Spark); found {materialize!r}."
        )
    if not materialize and backend is not None and not isinstance(backend, SparkBackend):
        raise ValueError(
            f"`materialize=False` trains on the DataFrame's partitions inside a Spark barrier "
            f"stage, which a SparkBackend runs; found the backend {type(backend).__name__}. "
            f"Use SparkBackend (or `num_proc`), or materialize=True."
        )


def _check_roles(roles: dict[str, list[str]]) -> None:
    """Each column has one role: the loader reads a column once (a column named twice fails
    there with pyarrow's "Field ... exists 2 times"), and a model fed its own label learns
    nothing."""
    seen: dict[str, str] = {}
    for role, names in roles.items():
        for name in names:
            if name in seen:
                where = (
                    f"twice in `{role}`"
                    if seen[name] == role
                    else f"in both `{seen[name]}` and `{role}`"
                )
                raise ValueError(
                    f"column `{name}` is listed {where}: each column is read once, as a "
                    f"feature, a label or the sample weight. Remove it from "
                    f"`{role}`{'' if seen[name] == role else f' or `{seen[name]}`'}."
                )
            seen[name] = role
