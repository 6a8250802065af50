"""Code written for Horovod on Spark runs with `horovod` changed to `flyte_hvd` in its imports:
Horovod's module paths, `SparkBackend`'s and `run`'s arguments, every estimator parameter
(with its meaning, or accepted with a warning), the driver's environment on the ranks, a
flat feature vector shaped to a Keras model's input, and `pytorch_lightning` modules."""

from __future__ import annotations

import importlib
import inspect
import io
import json
import os
import sys
import warnings

import cloudpickle
import numpy as np
import pytest

from flyte_hvd.data.store import Store
from flyte_hvd.launch.environment import driver_env

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Horovod's public module paths and the names code imports from each.
HOROVOD_MODULES = {
    "flyte_hvd.spark": ["run", "HorovodRunner"],
    "flyte_hvd.spark.keras": ["KerasEstimator", "KerasModel"],
    "flyte_hvd.spark.keras.estimator": ["KerasEstimator", "KerasModel", "EstimatorParams"],
    "flyte_hvd.spark.torch": ["TorchEstimator", "TorchModel"],
    "flyte_hvd.spark.torch.estimator": ["TorchEstimator", "EstimatorParams"],
    "flyte_hvd.spark.lightning": ["TorchEstimator", "TorchModel", "MIN_PL_VERSION"],
    "flyte_hvd.spark.lightning.estimator": ["TorchEstimator", "MIN_PL_VERSION", "EstimatorParams"],
    "flyte_hvd.spark.common.store": [
        "Store", "AbstractFilesystemStore", "FilesystemStore", "LocalStore", "HDFSStore",
        "DBFSLocalStore",
    ],
    "flyte_hvd.spark.common.backend": ["SparkBackend"],
    "flyte_hvd.spark.common.constants": [
        "ARRAY", "DENSE_VECTOR", "SPARSE_VECTOR", "MIXED_SPARSE_DENSE_VECTOR",
        "TOTAL_BUFFER_MEMORY_CAP_GIB", "BYTES_PER_GIB",
    ],
    "flyte_hvd.spark.common.util": [
        "prepare_data", "get_simple_meta_from_parquet", "get_dataset_properties",
        "clear_training_cache", "to_list", "check_shape_compatibility",
        "get_spark_df_output_schema", "host_hash", "_get_metadata", "_train_val_split",
        "to_petastorm_fn", "_has_vector_column",
    ],
    "flyte_hvd.tensorflow.keras": ["DistributedOptimizer", "init", "rank", "callbacks"],
    "flyte_hvd.tensorflow.keras.callbacks": [
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
    ],
    "flyte_hvd.torch": ["DistributedOptimizer", "broadcast_parameters"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(HOROVOD_MODULES))
def test_horovod_module_paths_export_horovods_names(module):
    imported = importlib.import_module(module)
    missing = [n for n in HOROVOD_MODULES[module] if not hasattr(imported, n)]
    assert not missing, f"{module} lacks {missing}"


def test_horovods_column_kinds_are_the_prepared_datasets():
    """What code written for Horovod compares a column's kind with names the kinds that
    ``prepare_data`` records (a vector column with dense and sparse rows is ``vector``)."""
    from flyte_hvd.data.dataset import KINDS, VECTOR_KINDS
    from flyte_hvd.spark.common import constants

    assert constants.ARRAY in KINDS
    assert {
        constants.DENSE_VECTOR,
        constants.SPARSE_VECTOR,
        constants.MIXED_SPARSE_DENSE_VECTOR,
    } == (set(VECTOR_KINDS))
    assert constants.BYTES_PER_GIB == 2**30 and constants.TOTAL_BUFFER_MEMORY_CAP_GIB == 4


def test_horovod_names_are_ours_not_copies():
    from flyte_hvd.estimators.keras import KerasEstimator
    from flyte_hvd.estimators.lightning import LightningEstimator
    from flyte_hvd.spark.keras import KerasEstimator as HorovodKeras
    from flyte_hvd.spark.lightning import TorchEstimator as HorovodLightning

    assert HorovodKeras is KerasEstimator and HorovodLightning is LightningEstimator


# -- one declaration per param -----------------------------------------------------------------


def _estimators():
    from flyte_hvd.estimators.keras import KERAS_PARAMS, KerasEstimator
    from flyte_hvd.estimators.lightning import LIGHTNING_PARAMS, LightningEstimator
    from flyte_hvd.estimators.params import ESTIMATOR_PARAMS
    from flyte_hvd.estimators.torch import TORCH_PARAMS, TorchEstimator

    return [
        (KerasEstimator, KERAS_PARAMS),
        (TorchEstimator, {**ESTIMATOR_PARAMS, **TORCH_PARAMS}),
        (LightningEstimator, {**ESTIMATOR_PARAMS, **LIGHTNING_PARAMS}),
    ]


def test_each_estimator_signature_is_its_declared_params():
    from flyte_hvd.estimators.params import check_signature

    for cls, table in _estimators():
        assert check_signature(cls, table) == []
        assert list(inspect.signature(cls).parameters) == list(table)


def test_a_signature_that_drifts_from_the_declaration_is_caught():
    from flyte_hvd.estimators.params import check_signature

    class Drifted:
        def __init__(self, *, a: int = 1, b: int = 3, c=None):
            pass

    problems = check_signature(Drifted, {"a": (1, ""), "b": (2, ""), "d": ([], "")})
    assert any("parameters ['a', 'b', 'c'] != declared ['a', 'b', 'd']" in p for p in problems)
    assert any("`b` defaults to 3, declared 2" in p for p in problems)


def test_help_lists_every_param_with_its_doc():
    for cls, table in _estimators():
        text = inspect.getdoc(cls)
        for name, (_, doc) in table.items():
            assert f"{name}: {doc}" in text, f"{cls.__name__}: {name} missing from its docstring"


def test_arguments_left_at_their_default_stay_unset_and_mutable_defaults_are_fresh():
    from flyte_hvd.estimators.keras import KerasEstimator

    a, b = KerasEstimator(batch_size=8), KerasEstimator()
    assert a.getBatchSize() == 8 and a.isSet(a.batch_size) and not a.isSet(a.epochs)
    assert a.getMetrics() == [] and a.getMetrics() is not b.getMetrics()


def test_horovod_only_params_are_accepted_and_warn_once():
    from flyte_hvd.estimators.keras import KerasEstimator
    from flyte_hvd.estimators.lightning import LightningEstimator

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KerasEstimator(reader_pool_type="process", train_reader_num_workers=4,
                       backward_passes_per_step=2, label_shapes=[[1]])  # fmt: skip
        KerasEstimator(reader_pool_type="process")  # a second time: no second warning
        LightningEstimator(num_gpus=1, data_module=object)
    messages = [str(w.message) for w in caught]
    assert sum("`reader_pool_type`='process'" in m for m in messages) == 1
    assert any("`backward_passes_per_step`=2" in m and "Keras step" in m for m in messages)
    assert any("`num_gpus`=1" in m and "one device" in m for m in messages)
    # Set to their defaults, nothing is said.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KerasEstimator(val_reader_num_workers=2)
    assert not caught


def test_unknown_param_is_refused_naming_it():
    from flyte_hvd.estimators.keras import KerasEstimator

    with pytest.raises(
        ValueError, match=r"unknown parameter\(s\) `epoch` \(did you mean `epochs`\?\)"
    ):
        KerasEstimator(epoch=3)


def test_torch_model_loss_and_optimizer_accessors():
    from flyte_hvd.estimators.torch_model import TorchModel

    model = TorchModel()
    loss = object()
    assert model.setLoss(loss).getLoss() is loss
    assert model.setLossConstructors([list]).getLossConstructors() == [list]
    marker = object()
    assert model.setOptimizer(marker).getOptimizer() is marker


def test_fit_on_parquet_has_horovods_signature():
    from flyte_hvd.estimators.base import HorovodEstimator

    params = list(inspect.signature(HorovodEstimator.fit_on_parquet).parameters)
    assert params == ["self", "params", "dataset_idx"]


# -- SparkBackend and run: Horovod's arguments -------------------------------------------------


def test_spark_backend_takes_horovods_arguments_and_refuses_others():
    from flyte_hvd.spark.common.backend import SparkBackend

    backend = SparkBackend(num_proc=2, env={"A": "1"}, stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True, verbose=0, start_timeout=30,
                           nics={"lo"}, use_mpi=True)  # fmt: skip
    assert backend.num_processes() == 2
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['stdoutt'\]"):
        SparkBackend(num_proc=2, stdoutt=sys.stdout)


def test_driver_env_leaves_out_what_describes_the_driver(monkeypatch):
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/t.json")
    monkeypatch.setenv("SPARK_HOME", "/opt/spark")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = driver_env()
    assert env["HOROVOD_TIMELINE"] == "/tmp/t.json"
    assert "PYTEST_CURRENT_TEST" in os.environ  # pytest's, in the process that runs the test
    for name in ("SPARK_HOME", "CUDA_VISIBLE_DEVICES", "PATH", "HOME", "PYTHONPATH"):
        assert name not in env
    assert "PYTEST_CURRENT_TEST" not in env


def test_nics_must_be_interface_names():
    from flyte_hvd.stage.dispatch import horovod_run_args

    env = horovod_run_args({"A": "1"}, nics={"eth1", "eth0"})
    assert env == {"A": "1", "FI_TCP_IFACE": "eth0", "UCX_NET_DEVICES": "eth0,eth1"}
    with pytest.raises(ValueError, match="`nics` must be a set of interface names"):
        horovod_run_args(None, nics="eth0")


@pytest.mark.spark
@pytest.mark.mpi
def test_ranks_see_the_drivers_environment_as_it_is_at_the_call(spark_local2, monkeypatch):
    from flyte_hvd.spark import run

    monkeypatch.setenv("FLYTE_HVD_TEST_SET_LATE", "café")

    def read():
        import os

        return os.environ.get("FLYTE_HVD_TEST_SET_LATE"), os.environ.get("FI_TCP_IFACE")

    assert run(read, num_proc=2, verbose=0) == [("café", None)] * 2
    # An explicit `env` replaces the driver's environment, as in Horovod.
    assert run(read, num_proc=1, env={"X": "1"}, nics={"lo"}, verbose=0) == [(None, "lo")]


@pytest.mark.spark
@pytest.mark.mpi
def test_databricks_timeline_recipe_records_a_timeline(spark_local2, tmp_path, monkeypatch):
    """`os.environ['HOROVOD_TIMELINE'] = path` on the driver, then `HorovodRunner(np).run`."""
    from flyte_hvd.spark import HorovodRunner

    path = tmp_path / "timeline.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))

    def main():
        import numpy as np

        import flyte_hvd.core as hvd

        hvd.init()
        hvd.allreduce(np.ones(4, np.float32), name="grads")
        rank = hvd.rank()
        hvd.shutdown()  # rank 0 writes the timeline
        return rank

    assert HorovodRunner(np=2).run(main) == 0
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert {e.get("pid") for e in events if "grads" in json.dumps(e)} == {0, 1}


@pytest.mark.spark
@pytest.mark.mpi
def test_spark_backend_passes_output_arguments_to_the_ranks(spark_local2):
    from flyte_hvd.spark.common.backend import SparkBackend

    out = io.StringIO()
    backend = SparkBackend(num_proc=2, stdout=out, stderr=io.StringIO(),
                           prefix_output_with_timestamp=True, verbose=0)  # fmt: skip

    def hello():
        import flyte_hvd.core as hvd

        hvd.init()
        print(f"hello from {hvd.rank()}")
        return hvd.rank()

    assert backend.run(hello) == [0, 1]
    lines = [line for line in out.getvalue().splitlines() if "hello from" in line]
    assert len(lines) == 2 and all(line[:4].isdigit() for line in lines)


# -- util --------------------------------------------------------------------------------------


def test_to_list_repeats_one_value_and_checks_lengths():
    from flyte_hvd.spark.common.util import to_list

    assert to_list(None, 3) is None
    assert to_list("a", 3) == ["a", "a", "a"]
    assert to_list(["a"], 2) == ["a", "a"]
    assert to_list(["a", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="expected 3 item"):
        to_list(["a", "b"], 3)


@pytest.mark.spark
def test_simple_meta_from_parquet_describes_the_prepared_data(spark_local2, tmp_path):
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.spark.common import util
    from flyte_hvd.spark.common.util import get_simple_meta_from_parquet, prepare_data

    store = Store.create(str(tmp_path / "store"))
    rows = [(Vectors.dense([float(i), 1.0]), float(i), i % 4 == 0) for i in range(40)]
    df = spark_local2.createDataFrame(rows, ["features", "y", "is_val"])
    with prepare_data(2, store, df, label_columns=["y"], feature_columns=["features"],
                      validation="is_val") as idx:  # fmt: skip
        train_rows, val_rows, metadata, avg_row_size = get_simple_meta_from_parquet(
            store, ["y"], ["features"], dataset_idx=idx
        )
        with pytest.raises(ValueError, match=r"column\(s\) \['nope'\] are not in the Parquet"):
            get_simple_meta_from_parquet(store, ["nope"], ["features"], dataset_idx=idx)
    assert (train_rows, val_rows) == (30, 10)
    assert tuple(metadata["features"]["shape"]) == (2,) and avg_row_size > 0
    # Horovod's direct-Parquet helpers: the properties by index alone, the split itself.
    assert util.get_dataset_properties(idx) == (train_rows, val_rows, metadata, avg_row_size)
    util.clear_training_cache()
    with pytest.raises(ValueError, match=f"dataset '{idx}' was not prepared by this process"):
        util.get_dataset_properties(idx)
    assert util.get_dataset_properties(idx, store)[:2] == (30, 10)
    train, val, ratio = util._train_val_split(df, "is_val")
    assert (train.count(), val.count(), ratio) == (30, 10, 0.25)
    assert "is_val" not in train.columns + val.columns
    train, val, ratio = util._train_val_split(df, 0.25)
    assert ratio == 0.25 and train.count() + val.count() == 40 and val.count() > 0
    with pytest.raises(ValueError, match="`validation` column `nope` is not in the DataFrame"):
        util._train_val_split(df, "nope")
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        util._train_val_split(df, 1.5)


# -- the estimators on Horovod's inputs --------------------------------------------------------


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.e2e
def test_keras_flat_features_are_shaped_to_the_models_input(spark_local2, tmp_path):
    """A 4-vector column feeds a model whose input is 2 x 2 x 1, in `fit` and `transform`."""
    keras = pytest.importorskip("keras")
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.spark.keras import KerasEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4))
    y = x.sum(axis=1)
    df = spark_local2.createDataFrame(
        [(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y, strict=True)],
        ["features", "label"],
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2, 2, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(1)])  # fmt: skip
    fitted = KerasEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
        optimizer=keras.optimizers.Adam(0.05), loss="mse", feature_cols=["features"],
        label_cols=["label"], batch_size=16, epochs=3, verbose=0,
    ).fit(df)  # fmt: skip
    history = fitted.getHistory()["loss"]
    assert history[-1] < history[0]
    assert fitted.transform(df).count() == 200


def test_torch_input_shapes_without_the_batch_dimension_are_row_shapes():
    from flyte_hvd.data.dataset import ColumnInfo, DatasetMetadata
    from flyte_hvd.estimators.torch_model import resolve_input_shapes

    meta = DatasetMetadata(columns=(ColumnInfo("f", "vector", "float64", (4,)),), rows=1,
                           bytes=1, files=1, row_groups=1)  # fmt: skip
    assert resolve_input_shapes([[4]], ["f"], meta) == [[-1, 4]]
    assert resolve_input_shapes([[2, 2]], ["f"], meta) == [[-1, 2, 2]]
    assert resolve_input_shapes([[-1, 4]], ["f"], meta) == [[-1, 4]]
    with pytest.raises(ValueError, match="does not fit column `f`"):
        resolve_input_shapes([[3]], ["f"], meta)


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.e2e
def test_a_pytorch_lightning_module_trains_with_its_own_package(spark_local2, tmp_path):
    """Horovod's Lightning examples subclass `pytorch_lightning.LightningModule` (the same
    Lightning 2 under its older name), and pass `profiler`."""
    pl = pytest.importorskip("pytorch_lightning")
    import torch
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.spark.lightning import TorchEstimator

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch["features"], batch["label"]
            loss = torch.nn.functional.mse_loss(self(x), y.view(-1, 1))
            self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 3))
    df = spark_local2.createDataFrame(
        [(Vectors.dense(a.tolist()), float(a.sum())) for a in x], ["features", "label"]
    )
    fitted = TorchEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=Net(),
        input_shapes=[[3]], feature_cols=["features"], label_cols=["label"], batch_size=16,
        epochs=2, verbose=0, profiler="simple", log_every_n_steps=1,
    ).fit(df)  # fmt: skip
    losses = fitted.getHistory()["train_loss"]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert isinstance(fitted.getModel(), pl.LightningModule)
    assert os.environ.get("FLYTE_HVD_RANK") is None  # nothing of the ranks leaked here


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.e2e
def test_a_vector_label_gets_vector_predictions(spark_local2, tmp_path):
    """Horovod's MNIST examples train on a one-hot vector label and read the prediction
    column as a vector (`row.label_prob.toArray()`)."""
    keras = pytest.importorskip("keras")
    from pyspark.ml.linalg import DenseVector, Vectors

    from flyte_hvd.spark.keras import KerasEstimator

    rng = np.random.default_rng(1)
    x = rng.normal(size=(120, 2))
    hot = [[1.0, 0.0] if a[0] > 0 else [0.0, 1.0] for a in x]
    df = spark_local2.createDataFrame(
        [(Vectors.dense(a.tolist()), Vectors.dense(h)) for a, h in zip(x, hot, strict=True)],
        ["features", "label_vec"],
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, activation="softmax")])
    fitted = KerasEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
        optimizer=keras.optimizers.Adam(0.05), loss="categorical_crossentropy",
        feature_cols=["features"], label_cols=["label_vec"], batch_size=16, epochs=1, verbose=0,
    ).fit(df).setOutputCols(["label_prob"])  # fmt: skip
    out = fitted.transform(df)
    assert dict(out.dtypes)["label_prob"] == "vector"
    row = out.first()
    assert isinstance(row.label_prob, DenseVector) and len(row.label_prob.toArray()) == 2


def test_legacy_module_loss_is_the_weighted_sum_of_each_outputs_loss():
    torch = pytest.importorskip("torch")
    from flyte_hvd.spark.lightning.legacy import to_lightning_module

    def minus(output, label, reduction=None):
        losses = label - output
        return losses if reduction == "none" else losses.mean()

    def plus(output, label, reduction=None):
        losses = label + output
        return losses if reduction == "none" else losses.mean()

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    module = to_lightning_module(net, opt, [minus, plus], [0.25, 0.75], ["x"], ["a", "b"],
                                 "w", None)  # fmt: skip
    outputs = [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 2.0])]
    labels = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 2.0, 4.0])]
    # minus: (0, 2, 1) . (1, 6, 3) / 3 = 5; plus: (0, 2, 6) . (1, 6, 3) / 3 = 10
    weighted = module._calculate_loss(outputs, labels, torch.tensor([1.0, 6.0, 3.0]))
    assert float(weighted) == pytest.approx(0.25 * 5 + 0.75 * 10)
    # without weights: the means, (0 + 2 + 1) / 3 = 1 and (0 + 2 + 6) / 3 = 8/3
    assert float(module._calculate_loss(outputs, labels)) == pytest.approx(0.25 + 2.0)
    # the optimizer is rebuilt on the module's own parameters, with the settings given
    rebuilt = module.configure_optimizers()
    assert rebuilt.defaults["lr"] == 0.1
    assert {id(p) for g in rebuilt.param_groups for p in g["params"]} == {
        id(p) for p in module.parameters()
    }


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.e2e
def test_a_plain_module_with_optimizer_and_loss_trains_as_horovods_legacy_mode(
    spark_local2, tmp_path
):
    torch = pytest.importorskip("torch")
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.spark.lightning import TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 2))
    df = spark_local2.createDataFrame(
        [(Vectors.dense(a.tolist()), float(a.sum()), 1.0 + (i % 2)) for i, a in enumerate(x)],
        ["features", "y", "weight"],
    )
    fitted = TorchEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=torch.nn.functional.mse_loss,
        input_shapes=[[-1, 2]], feature_cols=["features"], label_cols=["y"], batch_size=8,
        epochs=2, verbose=0, sample_weight_col="weight", validation=0.25,
    ).fit(df)  # fmt: skip
    history = fitted.getHistory()
    assert history["train_loss"][1] < history["train_loss"][0] and len(history["val_loss"]) == 2
    prediction = fitted.getModel()(torch.ones([1, 2]))
    assert prediction.shape == (1, 1) and prediction.dtype == torch.float32
    assert fitted.transform(df).count() == 128


def test_a_plain_module_without_optimizer_or_loss_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    from flyte_hvd.spark.lightning import TorchEstimator

    estimator = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "s")),
                               model=torch.nn.Linear(2, 1), feature_cols=["f"],
                               label_cols=["y"])  # fmt: skip
    with pytest.raises(ValueError, match="give `optimizer` and `loss` \\(Horovod's legacy mode"):
        estimator._check_model(["f"], ["y"])


# -- metadata, shapes and prediction types -----------------------------------------------------


def _meta(*columns):
    from flyte_hvd.data.dataset import ColumnInfo, DatasetMetadata

    infos = tuple(ColumnInfo(name, kind, dtype, shape) for name, kind, dtype, shape in columns)
    return DatasetMetadata(columns=infos, rows=10, bytes=0, files=0, row_groups=0)


def test_check_shape_compatibility_checks_each_shape_against_its_column():
    from flyte_hvd.spark.common.util import check_shape_compatibility

    meta = _meta(("x", "scalar", "float64", ()), ("v", "dense_vector", "float64", (12,)),
                 ("y", "scalar", "float32", ()))  # fmt: skip
    ok = [
        ([[1], [-1, 3, 4]], [[1]], None),
        ([[1], [3, 2, 2]], [[1, 1]], None),
        ([[-1, 1], [-1, 12]], None, [[1]]),
    ]
    for inputs, outputs, labels in ok:
        check_shape_compatibility(meta, ["x", "v"], ["y"], inputs, outputs, labels)
    bad = [
        (
            {"input_shapes": [[1], [-1, 3, 5]]},
            r"`input_shapes`\[1\]=\[-1, 3, 5\] does not fit "
            r"column `v`, which holds 12 value",
        ),
        ({"input_shapes": [[2], [12]]}, r"`input_shapes`\[0\]=\[2\] does not fit column `x`"),
        ({"input_shapes": [[1]]}, r"`input_shapes` must give one shape per column \(2"),
        ({"output_shapes": [[7]]}, r"`output_shapes`\[0\]=\[7\] does not fit column `y`"),
        ({"label_shapes": [[1], [1]]}, r"`label_shapes` must give one shape per column \(1"),
        ({"input_shapes": [[1], [0, 12]]}, r"does not fit column `v`"),
    ]
    for given, match in bad:
        with pytest.raises(ValueError, match=match):
            check_shape_compatibility(meta, ["x", "v"], ["y"], **given)
    # What get_simple_meta_from_parquet gives (a shape per column) is read the same way.
    check_shape_compatibility({"v": {"shape": (12,)}}, ["v"], [], [[4, 3]])
    with pytest.raises(ValueError, match=r"column `w` is not in the metadata"):
        check_shape_compatibility({"v": {"shape": (12,)}}, ["w"], [], [[12]])
    with pytest.raises(ValueError, match=r"`metadata` must be a dataset's metadata .* found str"):
        check_shape_compatibility("v: 12", ["v"], [], [[12]])


def test_each_prediction_has_its_labels_type():
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    from flyte_hvd.spark.common.util import get_spark_df_output_schema

    schema = T.StructType([
        T.StructField("x", T.DoubleType()),
        T.StructField("f", T.FloatType(), nullable=False),
        T.StructField("d", T.DoubleType()),
        T.StructField("i", T.IntegerType()),
        T.StructField("v", VectorUDT()),
        T.StructField("a", T.ArrayType(T.DoubleType())),
    ])  # fmt: skip
    labels = ["f", "d", "i", "v", "a"]
    out = get_spark_df_output_schema(schema, labels, [f"{c}_pred" for c in labels])
    assert out.fieldNames() == [*schema.fieldNames(), *[f"{c}_pred" for c in labels]]
    added = {f.name: f for f in out.fields[len(schema.fields):]}  # fmt: skip
    assert isinstance(added["f_pred"].dataType, T.FloatType) and not added["f_pred"].nullable
    assert isinstance(added["d_pred"].dataType, T.DoubleType) and added["d_pred"].nullable
    assert isinstance(added["i_pred"].dataType, T.DoubleType)  # never rounded to the label's
    assert isinstance(added["v_pred"].dataType, VectorUDT)
    assert added["a_pred"].dataType == T.ArrayType(T.FloatType())

    from flyte_hvd.estimators.prediction import output_schema

    # Class scores for a scalar label are a vector, as Spark ML's `probability`; a DataFrame
    # without the label (new data) takes the label's type from the model's metadata.
    scores = output_schema(schema, ["i"], ["p"], None, [3]).fields[-1]
    assert isinstance(scores.dataType, VectorUDT)
    # One value per row is a scalar prediction, whatever the label (what the model returns).
    narrow = output_schema(schema, ["v", "a"], ["v1", "a1"], None, [1, 1]).fields[-2:]
    assert [type(f.dataType) for f in narrow] == [T.DoubleType, T.DoubleType]
    meta = _meta(("y", "scalar", "float32", ()), ("z", "dense_vector", "float64", (2,)))
    new_data = T.StructType([T.StructField("x", T.DoubleType())])
    added = output_schema(new_data, ["y", "z"], ["y1", "z1"], meta, [1, 2]).fields[1:]
    assert isinstance(added[0].dataType, T.FloatType) and isinstance(added[1].dataType, VectorUDT)
    with pytest.raises(ValueError, match=r"`output_cols` must list one column per label \(2"):
        output_schema(new_data, ["y", "z"], ["y1"], meta)


def test_host_hash_is_the_host_with_its_container_and_salt(monkeypatch):
    from flyte_hvd.core.state import Topology
    from flyte_hvd.spark.common.util import host_hash

    monkeypatch.delenv("CONTAINER_ID", raising=False)
    plain = host_hash()
    assert host_hash() == plain and host_hash("salt") not in (plain, host_hash())
    monkeypatch.setenv("CONTAINER_ID", "container_1")
    in_container = host_hash()
    assert in_container != plain and host_hash("salt") != in_container
    monkeypatch.setenv("CONTAINER_ID", "container_2")
    # Two containers that share a host name are two hosts to the ranks.
    hosts = [in_container, host_hash(), in_container]
    assert [Topology.from_hosts(hosts, r).local_rank for r in range(3)] == [0, 0, 1]
    assert Topology.from_hosts(hosts, 1).local_size == 1


@pytest.mark.spark
def test_dataframe_metadata_is_what_prepare_data_records(spark_local2):
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.spark.common.util import _get_metadata

    df = spark_local2.createDataFrame(
        [(1.0, 2, Vectors.dense([1.0] * 12), [1.0, 2.0], Vectors.sparse(4, {1: 1.0}))] * 3,
        ["x", "n", "v", "a", "s"],
    )
    meta = _get_metadata(df)
    assert meta.rows == 3
    kinds = {c.name: (c.kind, c.dtype, c.shape) for c in meta.columns}
    assert kinds == {
        "x": ("scalar", "float64", ()),
        "n": ("scalar", "int64", ()),
        "v": ("dense_vector", "float64", (12,)),
        "a": ("array", "float64", (2,)),
        "s": ("sparse_vector", "float64", (4,)),
    }
    assert [c.name for c in _get_metadata(df, ["v"]).columns] == ["v"]
    ragged = spark_local2.createDataFrame([(Vectors.dense([1.0, 1.0]),), (Vectors.dense([1.0]),)],
                                          ["v"])  # fmt: skip
    with pytest.raises(ValueError, match=r"column `v` has rows of different lengths \(1 to 2\)"):
        _get_metadata(ragged)
    with pytest.raises(ValueError, match=r"`columns` names `nope`, which the DataFrame does not"):
        _get_metadata(df, ["nope"])


@pytest.mark.spark
def test_to_petastorm_fn_writes_vectors_as_arrays_for_parquet(spark_local2, tmp_path):
    """Horovod's recipe for Parquet written outside prepare_data: vectors become float lists,
    the other columns stay, and the loader reads them as rows of that length."""
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.spark.common.constants import CUSTOM_SPARSE
    from flyte_hvd.spark.common.util import _has_vector_column, to_petastorm_fn

    df = spark_local2.createDataFrame(
        [(float(i), Vectors.dense([i, -i]), Vectors.sparse(3, {i % 3: 1.0})) for i in range(4)],
        ["y", "v", "s"],
    )
    assert _has_vector_column(df)
    converted = df.rdd.map(to_petastorm_fn(["v", "s", "y"], None)).toDF()
    assert not _has_vector_column(converted)
    assert dict(converted.dtypes) == {"y": "double", "v": "array<double>", "s": "array<double>"}
    rows = sorted(converted.collect(), key=lambda r: r.y)
    assert [r.v for r in rows] == [[float(i), float(-i)] for i in range(4)]
    assert rows[1].s == [0.0, 1.0, 0.0]
    converted.write.parquet(str(tmp_path / "train"))
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "train")
    assert table.num_rows == 4 and str(table.schema.field("v").type) == "list<element: double>"
    packed = {"s": {"intermediate_format": CUSTOM_SPARSE}}
    with pytest.raises(ValueError, match=r"column\(s\) \['s'\] ask for the intermediate format "
                                         r"\['custom_sparse_format'\]"):  # fmt: skip
        to_petastorm_fn(["s"], packed)


@pytest.mark.spark
def test_a_torch_module_given_as_it_is_predicts(spark_local2):
    """Horovod builds a model by hand: ``TorchModel(model=module, input_shapes=[[2]], ...,
    _metadata=util._get_metadata(df))``."""
    torch = pytest.importorskip("torch")
    from pyspark.ml.linalg import DenseVector, Vectors, VectorUDT
    from pyspark.sql import types as T

    from flyte_hvd.spark.common.util import _get_metadata
    from flyte_hvd.spark.torch import TorchModel

    schema = T.StructType(
        [T.StructField("features", VectorUDT()), T.StructField("y", T.FloatType())]
    )
    df = spark_local2.createDataFrame(
        [(Vectors.dense([float(i), 1.0]), float(i % 2)) for i in range(6)], schema
    )
    torch.manual_seed(0)
    two = torch.nn.Linear(2, 2)
    model = TorchModel(model=two, input_shapes=[[2]], feature_columns=["features"],
                       label_columns=["y"], _metadata=_get_metadata(df))  # fmt: skip
    rows = model.transform(df).collect()
    assert dict(model.transform(df).dtypes)["y__output"] == "vector"
    expected = two(torch.tensor([list(r.features) for r in rows], dtype=torch.float32))
    expected = expected.detach().numpy()
    got = np.array([r.y__output.toArray() for r in rows])
    assert isinstance(rows[0].y__output, DenseVector)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    one = TorchModel(model=torch.nn.Linear(2, 1), input_shapes=[[-1, 2]],
                     feature_columns=["features"], label_columns=["y"])  # fmt: skip
    assert dict(one.transform(df).dtypes)["y__output"] == "float"
    with pytest.raises(TypeError, match="give `metadata` or `_metadata`, not both"):
        TorchModel(model=two, metadata=None, _metadata=None)
    with pytest.raises(TypeError, match="give `model` or `model_bytes`, not both"):
        TorchModel(model=two, model_bytes=b"x")


def test_an_estimator_saves_and_loads_its_params_but_backend_and_store(tmp_path):
    """A saved ``Pipeline`` saves its estimator stages: every param but the ones that hold a
    live session or credentials; the model and its optimizer stay linked."""
    torch = pytest.importorskip("torch")
    from flyte_hvd.estimators.base import SparkBackend
    from flyte_hvd.spark.torch import TorchEstimator
    from flyte_hvd.spark.torch.estimator import EstimatorParams, _torch_param_serialize

    assert _torch_param_serialize(EstimatorParams.backend.name, "x") is None
    assert _torch_param_serialize(EstimatorParams.store.name, "x") is None
    assert _torch_param_serialize("epochs", 3) == 3
    model = torch.nn.Linear(2, 1)
    estimator = TorchEstimator(
        backend=SparkBackend(num_proc=2), store=Store.create(str(tmp_path / "store")),
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.functional.mse_loss, feature_cols=["x"], label_cols=["y"], epochs=3,
    )  # fmt: skip
    assert isinstance(estimator, EstimatorParams)
    path = str(tmp_path / "saved")
    estimator.save(path)
    with pytest.raises(ValueError, match=r"already exists; use .write\(\).overwrite\(\)"):
        estimator.save(path)
    loaded = TorchEstimator.load(path)
    assert loaded.getEpochs() == 3 and loaded.getFeatureCols() == ["x"]
    assert loaded.getBackend() is None and loaded.getStore() is None
    weights = dict(loaded.getModel().named_parameters())["weight"]
    assert weights.data_ptr() in [
        p.data_ptr() for p in loaded.getOptimizer().param_groups[0]["params"]
    ]
    with pytest.raises(ValueError, match="holds no saved TorchEstimator"):
        TorchEstimator.load(str(tmp_path))
