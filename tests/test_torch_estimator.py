"""TorchEstimator / LightningEstimator / TorchModel on local[2] with 2 ranks; small data so
each fit takes seconds."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.mpi, pytest.mark.e2e]

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import cloudpickle  # noqa: E402
from conftest import partition_leftovers, rank_processes  # noqa: E402

from flyte_hvd.data.store import Store  # noqa: E402
from flyte_hvd.estimators.lightning import LightningEstimator  # noqa: E402
from flyte_hvd.estimators.torch import TorchEstimator, TorchModel  # noqa: E402

# Models and functions of this module travel to the ranks by value (tests/ is not a package
# the rank processes can import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])
F = torch.nn.functional


def _regression_df(spark, rows=400, seed=0):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    return spark.createDataFrame(
        [
            (Vectors.dense(a.tolist()), float(b), i % 5 == 0)
            for i, (a, b) in enumerate(zip(x, y, strict=True))
        ],
        ["features", "label", "is_val"],
    )


def _mlp(inputs=3, outputs=1, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, 16), torch.nn.ReLU(), torch.nn.Linear(16, outputs)
    )


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


def _torch_estimator(store, model=None, lr=0.02, **overrides):
    model = model if model is not None else _mlp()
    params = dict(
        num_proc=2, store=store, model=model, loss=F.mse_loss, feature_cols=["features"],
        label_cols=["label"], batch_size=16, epochs=4, verbose=0, random_seed=1,
        partitions_per_process=2,
    )  # fmt: skip
    params.update(overrides)
    if "optimizer" not in params:
        params["optimizer"] = torch.optim.Adam(model.parameters(), lr)
    return TorchEstimator(**params)


def test_regression_fit_transform_save_load(spark_local2, store, tmp_path, no_leftover_ranks):
    df = _regression_df(spark_local2)
    fitted = _torch_estimator(store, validation=0.2, metrics=[F.l1_loss]).fit(df)
    history = fitted.getHistory()
    assert sorted(history) == ["l1_loss", "loss", "val_l1_loss", "val_loss"]
    assert len(history["loss"]) == 4 and history["loss"][-1] < history["loss"][0] / 3
    # The optimizer handed back holds the learning rate given, not the one the ranks scaled.
    assert fitted.getOptimizer().param_groups[0]["lr"] == pytest.approx(0.02)
    assert not fitted.getModel().training

    predicted = fitted.transform(df)
    assert predicted.columns == [*df.columns, "label__output"]
    assert dict(predicted.dtypes)["label__output"] == "double"
    rows = predicted.select("label", "label__output").collect()
    truth, guess = np.array([(r[0], r[1]) for r in rows]).T
    assert len(rows) == 400 and np.corrcoef(truth, guess)[0, 1] > 0.95
    with torch.no_grad():
        assert fitted.getModel()(torch.ones(2, 3)).shape == (2, 1)

    # Rank 0 recorded the run: model and optimizer state, last epoch, state.json.
    run = fitted.getRunId()
    checkpoint = torch.load(
        store.fs_path(store.get_run_path(run)) + "/checkpoint.pt", weights_only=True
    )
    assert set(checkpoint) == {"model", "optimizer"}
    assert checkpoint["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.02)
    # and its epochs' TensorBoard logs (the writer a spare imports ahead, rank_tensorboard)
    logs = os.listdir(store.fs_path(store.get_run_path(run)) + "/logs")
    assert any(name.startswith("events.out.tfevents") for name in logs), logs
    state = json.loads(store.read(store.get_state_path(run)))
    assert state["epoch"] == 4 and state["history"]["loss"] == history["loss"]

    path = str(tmp_path / "saved")
    fitted.setOutputCols(["prediction"]).save(path)
    loaded = TorchModel.load(path)
    assert loaded.getOutputCols() == ["prediction"] and loaded.getRunId() == run
    sample = df.limit(20)
    before = [r.prediction for r in fitted.transform(sample).collect()]
    after = [r.prediction for r in loaded.transform(sample).collect()]
    np.testing.assert_allclose(before, after, rtol=1e-6)
    with pytest.raises(ValueError, match="already exists"):
        fitted.save(path)


def test_multiclass_transform_with_integer_labels_and_weights(spark_local2, store):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(3)
    centers = np.array([[3.0, 0.0], [-3.0, 0.0], [0.0, 3.0]])
    labels = rng.integers(0, 3, size=300)
    points = centers[labels] + rng.normal(scale=0.5, size=(300, 2))
    df = spark_local2.createDataFrame(
        [(Vectors.dense(p.tolist()), int(c), 1.0 + (i % 2)) for i, (p, c) in
         enumerate(zip(points, labels, strict=True))],
        ["xy", "cls", "weight"],
    )  # fmt: skip
    model = _mlp(inputs=2, outputs=3)
    fitted = _torch_estimator(
        store, model=model, lr=0.05, loss=F.cross_entropy, feature_cols=["xy"],
        label_cols=["cls"], sample_weight_col="weight", input_shapes=[[-1, 2]], epochs=3,
    ).fit(df)  # fmt: skip
    out = fitted.transform(df)
    # Class scores for an integer label are a vector, as Spark ML's `probability`.
    assert dict(out.dtypes)["cls__output"] == "vector"
    rows = out.select("cls", "cls__output").collect()
    assert np.mean([r[0] == np.argmax(r[1].toArray()) for r in rows]) > 0.95


def test_resume_continues_after_the_last_epoch(spark_local2, store):
    df = _regression_df(spark_local2, rows=200)
    first = _torch_estimator(store, lr=0.01, epochs=2, run_id="resumed").fit(df)
    again = _torch_estimator(store, lr=0.01, epochs=3, run_id="resumed").fit(df)
    history = again.getHistory()
    assert len(history["loss"]) == 3 and history["loss"][:2] == first.getHistory()["loss"]
    # The second fit started from the first fit's weights, not from the fresh model it got.
    assert history["loss"][2] < first.getHistory()["loss"][0]
    assert json.loads(store.read(store.get_state_path("resumed")))["epoch"] == 3
    assert again.getOptimizer().param_groups[0]["lr"] == pytest.approx(0.01)

    # A refit of the finished run (a retried task) starts no rank: the run's model and
    # optimizer come back from its checkpoint, still linked, with the learning rate given.
    estimator = _torch_estimator(store, lr=0.01, epochs=3, run_id="resumed")
    loaded = []
    load = estimator._load_checkpoint
    estimator._load_checkpoint = lambda run_id: loaded.append(run_id) or load(run_id)
    same = estimator.fit(df)
    assert loaded == ["resumed"] and rank_processes() == []
    assert same.getHistory() == history
    for name, value in same.getModel().state_dict().items():
        torch.testing.assert_close(value, again.getModel().state_dict()[name])
    optimizer = same.getOptimizer()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    assert {id(p) for p in same.getModel().parameters()} == {
        id(p) for p in optimizer.param_groups[0]["params"]
    }


def test_streamed_fits_train_as_materialized_ones_and_resume(spark_connect, store):
    """``materialize=False`` for TorchEstimator and LightningEstimator, on a Spark Connect
    session (the Keras estimator's streamed test runs on a classic one): each rank trains on
    its partition of the DataFrame, with validation rows split out by the `validation`
    column; nothing but the runs is written to the store, and no partition file stays on the
    executors' disks; a second streamed fit of the torch run resumes it from its checkpoint,
    to the loss of the same fit materialized within the noise of a different shard
    composition. (The fits of one framework run in a row: each reuses the spare rank
    processes of the one before.)"""
    df = _regression_df(spark_connect, rows=400)
    first = _torch_estimator(store, epochs=2, run_id="streamed", materialize=False).fit(df)
    assert os.listdir(store.prefix_path) == ["runs"]
    resumed = _torch_estimator(store, epochs=4, run_id="streamed", materialize=False).fit(df)
    history = resumed.getHistory()["loss"]
    assert len(history) == 4 and history[:2] == first.getHistory()["loss"]
    assert history[-1] < 0.5 * history[0]
    reference = _torch_estimator(store, epochs=4).fit(df).getHistory()["loss"]
    np.testing.assert_allclose(history[-1], reference[-1], rtol=0.5)

    fitted = LightningEstimator(
        num_proc=2, store=store, model=Regressor(), feature_cols=["features"],
        label_cols=["label"], validation="is_val", batch_size=16, epochs=3, verbose=0,
        random_seed=2, materialize=False,
    ).fit(df)  # fmt: skip
    val_loss = fitted.getHistory()["val_loss"]
    assert len(val_loss) == 3 and val_loss[-1] < val_loss[0]
    assert partition_leftovers() == []  # on the executors' disks


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch["features"]), batch["label"].view(-1, 1))
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch["features"]), batch["label"].view(-1, 1))
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)


def test_lightning_fit_transform_with_early_stopping(spark_local2, store, no_leftover_ranks):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    df = _regression_df(spark_local2)
    fitted = LightningEstimator(
        num_proc=2, store=store, model=Regressor(), feature_cols=["features"],
        label_cols=["label"], validation="is_val", batch_size=16, epochs=10, verbose=0,
        random_seed=2, run_id="lightning", partitions_per_process=2,
        # No epoch improves val_loss by 1e6: every rank stops after `patience` more epochs.
        callbacks=[EarlyStopping(monitor="val_loss", patience=1, min_delta=1e6)],
        checkpoint_callback=ModelCheckpoint(monitor="val_loss"),
    ).fit(df)  # fmt: skip
    history = fitted.getHistory()
    assert len(history["val_loss"]) == 2 and len(history["train_loss"]) == 2
    assert history["val_loss"][1] < history["val_loss"][0]
    assert isinstance(fitted.getModel(), pl.LightningModule) and not fitted.getModel().training
    assert fitted.getOptimizer() is None
    state = json.loads(store.read(store.get_state_path("lightning")))
    assert state["epoch"] == 2
    assert store.exists(store.get_run_path("lightning") + "/checkpoint.ckpt")
    out = fitted.transform(df)
    assert dict(out.dtypes)["label__output"] == "double"
    rows = out.select("label", "label__output").collect()
    truth, guess = np.array([(r[0], r[1]) for r in rows]).T
    assert np.corrcoef(truth, guess)[0, 1] > 0.8

    # Resumed with worse validation epochs: Lightning's own restore continues at epoch 3, and
    # the best model of the first attempt stays the run's checkpoint and the returned model.
    resumed = LightningEstimator(
        num_proc=2, store=store, model=WorseOnValidation(), feature_cols=["features"],
        label_cols=["label"], validation="is_val", batch_size=16, epochs=4, verbose=0,
        random_seed=2, run_id="lightning", partitions_per_process=2,
        checkpoint_callback=ModelCheckpoint(monitor="val_loss"),
    ).fit(df)  # fmt: skip
    again = resumed.getHistory()
    assert len(again["val_loss"]) == 4 and again["val_loss"][:2] == history["val_loss"]
    assert min(again["val_loss"][2:]) > 1000
    state = json.loads(store.read(store.get_state_path("lightning")))
    assert state["epoch"] == 4 and state["best"] == pytest.approx(history["val_loss"][1])
    best = fitted.getModel().state_dict()
    for name, value in resumed.getModel().state_dict().items():
        torch.testing.assert_close(value, best[name])

    # The run has trained its 4 epochs: a refit returns its best model, with no rank started.
    refit = LightningEstimator(
        num_proc=2, store=store, model=WorseOnValidation(), feature_cols=["features"],
        label_cols=["label"], validation="is_val", batch_size=16, epochs=4, verbose=0,
        run_id="lightning", partitions_per_process=2,
    ).fit(df)  # fmt: skip
    assert rank_processes() == [] and refit.getHistory() == again
    for name, value in refit.getModel().state_dict().items():
        torch.testing.assert_close(value, best[name])


class WorseOnValidation(Regressor):
    """The same network, with a validation loss no later epoch can improve on."""

    def validation_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch["features"]), batch["label"].view(-1, 1))
        self.log("val_loss", loss + 1000.0, sync_dist=True)


# -- distributed="ddp": torch's DistributedDataParallel instead of DistributedOptimizer -------


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ddp_fit_and_resume_give_the_default_fits_weights(spark_local2, store, no_leftover_ranks):
    df = _regression_df(spark_local2, rows=200)
    default = _torch_estimator(store, epochs=2, run_id="default").fit(df)
    # DDP for 1 epoch, then resumed to 2 from its checkpoint (model and Adam's state).
    first = _torch_estimator(store, epochs=1, run_id="ddp", distributed="ddp").fit(df)
    ddp = _torch_estimator(store, epochs=2, run_id="ddp", distributed="ddp").fit(df)
    assert ddp.getHistory()["loss"][:1] == first.getHistory()["loss"]
    # Exactly the same weights: on 2 ranks both average a gradient as g0 / 2 + g1 / 2 (or
    # (g0 + g1) / 2), where halving is exact and a sum of two terms has one order. (On more
    # ranks the two reductions may add in different orders: equal up to float rounding.)
    expected, trained = _weights(default.getModel()), _weights(ddp.getModel())
    assert trained.keys() == expected.keys()  # the plain module came back, not DDP's wrapper
    for name, value in trained.items():
        assert torch.equal(value, expected[name]), name
    assert ddp.getHistory() == default.getHistory()  # the metrics, averaged over the ranks
    assert ddp.getHistory()["loss"][-1] < ddp.getHistory()["loss"][0]
    assert ddp.getOptimizer().param_groups[0]["lr"] == pytest.approx(0.02)
    assert json.loads(store.read(store.get_state_path("ddp")))["epoch"] == 2


def test_lightning_ddp_fit_trains_and_transforms(spark_local2, store, no_leftover_ranks):
    df = _regression_df(spark_local2, rows=200)
    fitted = LightningEstimator(
        num_proc=2, store=store, model=Regressor(), feature_cols=["features"],
        label_cols=["label"], validation="is_val", batch_size=16, epochs=3, verbose=0,
        random_seed=2, run_id="lightning_ddp", partitions_per_process=2, distributed="ddp",
    ).fit(df)  # fmt: skip
    history = fitted.getHistory()
    assert len(history["train_loss"]) == 3 and len(history["val_loss"]) == 3
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert json.loads(store.read(store.get_state_path("lightning_ddp")))["epoch"] == 3
    out = fitted.transform(df)
    rows = out.select("label", "label__output").collect()
    truth, guess = np.array([(r[0], r[1]) for r in rows]).T
    assert len(rows) == 200 and np.corrcoef(truth, guess)[0, 1] > 0.8


# -- a step that shapes its label itself, as Horovod's batches need ----------------------------


class UnsqueezesItsLabel(Regressor):
    """Horovod's convention (its own Lightning tests' XOR): a scalar label arrives as (B,),
    and the steps make it (B, 1) for a binary cross-entropy against a (B, 1) output."""

    def forward(self, x):
        return torch.sigmoid(self.net(x))

    def training_step(self, batch, batch_idx):
        x, y = batch["features"], batch["label"].unsqueeze(1)
        loss = F.binary_cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        y = batch["label"]
        loss = F.binary_cross_entropy(self(batch["features"]), y[:, None])
        self.log("val_loss", loss, sync_dist=True)


class ShapesByAlias(Regressor):
    def training_step(self, batch, batch_idx):
        target = batch["label"].float()
        y = target
        return F.mse_loss(self(batch["features"]), torch.unsqueeze(y, 1))


class LeavesItsLabel(Regressor):
    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch["features"]), batch["label"])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch["features"]), batch["label"]))


def test_labels_a_step_shapes_itself_are_found_in_its_source():
    from flyte_hvd.estimators.lightning import labels_the_steps_shape

    assert labels_the_steps_shape(UnsqueezesItsLabel(), ["label"]) == {"label"}
    assert labels_the_steps_shape(ShapesByAlias(), ["label"]) == {"label"}
    assert labels_the_steps_shape(Regressor(), ["label"]) == {"label"}  # .view(-1, 1)
    assert labels_the_steps_shape(LeavesItsLabel(), ["label"]) == set()
    assert labels_the_steps_shape(UnsqueezesItsLabel(), ["other"]) == set()


class ExpectsWeightAveraging(pl.Callback):
    """Fails the fit unless Lightning's SWA callback averaged the last epoch at the
    optimizer's own learning rate (what Lightning 1.x's `stochastic_weight_avg=True` did)."""

    def on_train_end(self, trainer, pl_module):
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        (swa,) = [c for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]
        if not swa._initialized or swa._swa_lrs != [0.02]:
            raise RuntimeError(f"no weight averaging at the optimizer's rate: {swa._swa_lrs}")


def test_horovods_lightning_habits_train_as_under_horovod(spark_local2, store):
    """A step that unsqueezes its label: given (B, 1), `batch["label"].unsqueeze(1)` would be
    (B, 1, 1), which torch's binary cross-entropy refuses against a (B, 1) output (and MSE
    would broadcast to (B, B, 1)); the label comes as Horovod gives it, (B,), and the model
    learns the classes. And Lightning 1.x's `stochastic_weight_avg=True` averages weights."""
    from pyspark.sql import functions as sf

    df = _regression_df(spark_local2, rows=200)
    df = df.withColumn("label", (sf.col("label") > 0.3).cast("double"))
    fitted = LightningEstimator(
        num_proc=2, store=store, model=UnsqueezesItsLabel(), feature_cols=["features"],
        label_cols=["label"], validation="is_val", batch_size=16, epochs=3, verbose=0,
        random_seed=2, run_id="unsqueezed", callbacks=[ExpectsWeightAveraging()],
        trainer_args={"stochastic_weight_avg": True},
    ).fit(df)  # fmt: skip
    history = fitted.getHistory()
    assert history["val_loss"][-1] < history["val_loss"][0]
    rows = fitted.transform(df).select("label", "label__output").collect()
    truth, guess = np.array([(r[0], r[1]) for r in rows]).T
    assert np.mean((guess > 0.5) == (truth > 0.5)) > 0.8


# -- bad input: each fails before any rank starts --------------------------------------------


class Wide(torch.nn.Module):
    """Wants 4 values per row."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.linear(x)


def _bad(store, case):
    model = _mlp()
    if case == "input_shapes":
        return _torch_estimator(store, input_shapes=[[-1, 4]])
    if case == "model_input":
        wide = Wide()
        return _torch_estimator(store, model=wide, optimizer=torch.optim.SGD(wide.parameters()))
    if case == "missing_column":
        return _torch_estimator(store, feature_cols=["nope"])
    if case == "foreign_optimizer":
        return _torch_estimator(store, optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1))
    if case == "no_loss":
        return _torch_estimator(store, loss=None)
    if case == "not_a_module":
        return _torch_estimator(store, model="model", optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1))  # fmt: skip
    if case in ("negative_lr", "nan_lr"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.param_groups[0]["lr"] = -0.1 if case == "negative_lr" else float("nan")
        return _torch_estimator(store, model=model, optimizer=optimizer)
    if case == "label_width":
        return _torch_estimator(store, label_cols=["target"])
    if case == "label_in_features":
        return _torch_estimator(store, feature_cols=["features", "label"])
    if case == "two_labels":
        return _torch_estimator(store, label_cols=["label", "is_val"])
    if case == "lightning_optimizer":
        return LightningEstimator(num_proc=2, store=store, model=Regressor(),
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  feature_cols=["features"], label_cols=["label"])  # fmt: skip
    if case == "lightning_trainer_args":
        return LightningEstimator(num_proc=2, store=store, model=Regressor(),
                                  trainer_args={"max_epochs": 3}, feature_cols=["features"],
                                  label_cols=["label"])  # fmt: skip
    if case in ("lightning_unknown_trainer_arg", "lightning_swa_not_bool"):
        args = {"gradient_clip_vall": 1.0} if case == "lightning_unknown_trainer_arg" else {
            "stochastic_weight_avg": "yes"}  # fmt: skip
        return LightningEstimator(num_proc=2, store=store, model=Regressor(), trainer_args=args,
                                  feature_cols=["features"], label_cols=["label"])  # fmt: skip
    if case == "distributed":
        return _torch_estimator(store, distributed="nccl")
    if case == "ddp_compression":
        from flyte_hvd.core.compression import Compression

        return _torch_estimator(store, distributed="ddp", gradient_compression=Compression.fp16)
    if case == "lightning_distributed":
        return LightningEstimator(num_proc=2, store=store, model=Regressor(), distributed=None,
                                  feature_cols=["features"], label_cols=["label"])  # fmt: skip
    if case == "lightning_not_a_module":
        return LightningEstimator(num_proc=2, store=store, model=model,
                                  feature_cols=["features"], label_cols=["label"])  # fmt: skip
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("input_shapes", r"`input_shapes`\[0\]=\[-1, 4\] does not fit column `features`, "
                         r"which holds 3 value"),
        ("model_input", r"the model cannot run on inputs shaped by `input_shapes`=\[\[-1, 3\]\]"),
        ("missing_column", r"column\(s\) \['nope'\] are not in the DataFrame"),
        ("foreign_optimizer", "holds parameters that are not the model's"),
        ("no_loss", r"`loss` \(or `loss_constructors`\) is required"),
        ("not_a_module", "must be a torch.nn.Module"),
        ("two_labels", r"returns 1 output\(s\) but `label_cols` names 2"),
        ("negative_lr", r"`optimizer` \(SGD\) has learning rate -0.1; it must be a finite "
                        r"number >= 0"),
        ("nan_lr", r"`optimizer` \(SGD\) has learning rate nan"),
        ("label_width", r"the model's output for label `target` gives 1 value\(s\) per row "
                        r"\(shape \[1\]\) but the column holds 3"),
        ("label_in_features", r"column `label` is listed in both `feature_cols` and `label_cols`"),
        ("lightning_optimizer", "leave `optimizer` and `loss` unset"),
        ("lightning_trainer_args", r"`max_epochs`: set `epochs`"),
        ("lightning_unknown_trainer_arg", r"^`trainer_args` has \['gradient_clip_vall'\], which "
                                          r"lightning.pytorch.Trainer does not take \("
                                          r"`gradient_clip_vall`: did you mean "
                                          r"`gradient_clip_val`\?\)"),
        ("lightning_swa_not_bool", r"`trainer_args\['stochastic_weight_avg'\]` must be a bool; "
                                   r"found 'yes'"),
        ("lightning_not_a_module", "must be a LightningModule"),
        ("distributed", r"^`distributed` must be 'horovod' \(flyte_hvd's DistributedOptimizer\) "
                        r"or 'ddp' \(torch's DistributedDataParallel\); found 'nccl'\.$"),
        ("ddp_compression", r"^`gradient_compression`=FP16Compressor applies to "
                            r"distributed='horovod'; with distributed='ddp' torch reduces"),
        ("lightning_distributed", r"^`distributed` must be .*; found None\.$"),
    ],
)  # fmt: skip
def test_bad_input_fails_before_ranks_start(spark_local2, store, case, match, monkeypatch):
    import flyte_hvd.estimators.backend as estimator_module

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(estimator_module, "launch", no_ranks)
    from pyspark.sql import functions as sf

    df = _regression_df(spark_local2, rows=20).withColumn("target", sf.col("features"))
    with pytest.raises(ValueError, match=match):
        _bad(store, case).fit(df)


def test_batch_tensors_share_ready_arrays_and_convert_the_others():
    """A step's batch as tensors: float32 C arrays (the in-memory shard's) are used as they
    are; read-only views of Arrow memory and other dtypes are copied into what torch takes."""
    from types import SimpleNamespace

    from flyte_hvd.estimators.torch_model import batch_tensors

    spec = SimpleNamespace(features=["x"], labels=["y", "k"], sample_weight_col="w")
    ready = np.arange(12, dtype=np.float32).reshape(4, 3)
    read_only = np.linspace(0, 1, 4)  # float64
    read_only.flags.writeable = False
    batch = {"x": ready, "y": read_only, "k": np.arange(4, dtype=np.int32), "w": read_only}
    for device in ("cpu", torch.device("cpu")):  # Lightning passes the name
        (x,), (y, k), w = batch_tensors(batch, spec, [[-1, 3]], device)
        assert x.data_ptr() == ready.ctypes.data  # no copy
        assert (y.dtype, k.dtype, w.dtype) == (torch.float32, torch.int64, torch.float32)
        np.testing.assert_allclose(y.numpy(), read_only)
        y += 1  # writable: a copy, the loader's memory is untouched
        assert read_only[0] == 0


# -- the defaults users run ----------------------------------------------------------------


class Celsius(torch.nn.Module):
    """Model code that prints non-ASCII text on its first call, on every rank."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()
        self.printed = False

    def forward(self, x):
        if not self.printed:
            self.printed = True
            print("first batch at 21 °C → ok 🙂")
        return self.net(x)


def test_a_model_without_trained_bytes_refuses_transform_on_the_driver(spark_local2):
    # No Spark job starts: the model bytes are checked when the prediction UDF is built.
    df = _regression_df(spark_local2, rows=4)
    model = TorchModel(
        feature_columns=["features"], label_columns=["label"], input_shapes=[[-1, 3]],
        output_shapes=[[1]],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"holds no trained model; get one from an estimator"):
        model.transform(df)


def test_torch_default_verbose_with_non_ascii_model_output(spark_local2, store, capfd):
    df = _regression_df(spark_local2, rows=200)
    model = Celsius()
    params = dict(
        num_proc=2, store=store, model=model, loss=F.mse_loss, feature_cols=["features"],
        label_cols=["label"], batch_size=16, epochs=2,
        optimizer=torch.optim.Adam(model.parameters(), 0.02),
    )  # fmt: skip
    TorchEstimator(**params).fit(df)
    out = capfd.readouterr().out
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:first batch at 21 °C → ok 🙂" in out


class SummarizedRegressor(Regressor):
    def on_train_start(self):
        from lightning.pytorch.utilities.model_summary import ModelSummary

        print(ModelSummary(self))


def test_lightning_default_verbose_shows_rank_0s_bar_and_summary(spark_local2, store, capfd):
    df = _regression_df(spark_local2, rows=200)
    LightningEstimator(
        num_proc=2, store=store, model=SummarizedRegressor(), feature_cols=["features"],
        label_cols=["label"], batch_size=16, epochs=2,
    ).fit(df)  # fmt: skip
    captured = capfd.readouterr()
    lines = (captured.out + captured.err).splitlines()
    # Lightning's rich progress bar (stdout) or its tqdm one (stderr), at rank 0 only
    bars = [line for line in lines if "Epoch 1" in line and "it/s" in line]
    assert bars and all(line.startswith("[0]<") for line in bars), bars
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}]<stdout>:") and "Trainable params" in line
                   for line in lines)  # fmt: skip
