"""MLflow tracking of estimator fits (a real MLflow file store in tmp_path), the checks the
driver makes before any rank starts, rank 0's progress lines and the fit's Flyte Deck."""

from __future__ import annotations

import glob
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from flyte_hvd.estimators import report
from flyte_hvd.estimators.tracking import MlflowConfig, resolve_config
from flyte_hvd.launch import progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- without ranks -------------------------------------------------------------------------------


def test_progress_line_has_metrics_pace_and_time_left():
    epoch = progress.Epoch(3, 10, {"val_loss": 0.4412, "loss": 0.41}, 12.5)
    # The first epoch (tracing, warm-up) is left out of the pace once there are others.
    line = progress.progress_line(epoch, [30.0, 12.0, 12.2])
    assert line == "epoch 3/10 · loss 0.41 · val_loss 0.4412 · 12.1 s/epoch · ~85 s left"
    last = progress.Epoch(10, 10, {"loss": 0.2}, 12.0)
    assert progress.progress_line(last, [12.0]) == "epoch 10/10 · loss 0.2 · 12.0 s/epoch"


def test_recorded_epochs_reach_listeners_until_reset():
    progress.reset()
    seen = []
    progress.add_listener(seen.append)
    progress.record_epoch(1, 2, {"loss": 1.0}, 0.5, verbose=0)
    assert [e.number for e in progress.epochs()] == [1] and seen == progress.epochs()
    progress.reset()
    progress.record_epoch(1, 2, {"loss": 1.0}, 0.5, verbose=0)
    assert len(seen) == 1 and len(progress.epochs()) == 1


def test_report_html_has_the_facts_the_epoch_table_and_curves():
    page = report.run_report_html(
        {"ranks": 2, "hosts": ["a", "b"], "MLflow run id": None},
        {"loss": [1.0, 0.5], "val_loss": [1.2, 0.7]},
        [3.0, 2.0],
    )
    assert "<td>a, b</td>" in page and "MLflow run id" not in page  # None facts are left out
    assert "<td>2.5 s</td>" in page  # time per epoch
    rows = re.findall(r"<tr><td>(\d)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>", page)
    assert rows == [("1", "1", "1.2", "3.0"), ("2", "0.5", "0.7", "2.0")]
    assert page.count("<svg") == 1 and "(best 2)" in page


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("yes", r"`mlflow` must be True .* found 'yes'"),
        (MlflowConfig, r"`mlflow` must be True"),
    ],
)
def test_mlflow_setting_must_be_true_or_a_config(value, match):
    with pytest.raises(ValueError, match=match):
        resolve_config(value)
    assert resolve_config(True) == MlflowConfig() and resolve_config(False) is None


def test_mlflow_config_says_which_field_is_wrong():
    with pytest.raises(ValueError, match=r"MlflowConfig `experiment` must be a non-empty str"):
        MlflowConfig(experiment="")
    with pytest.raises(ValueError, match=r"MlflowConfig `tags` must map str"):
        MlflowConfig(tags=["a"])  # type: ignore[arg-type]
    assert MlflowConfig(tags={"n": 1}).tags == {"n": "1"}


def test_nothing_imports_mlflow_unless_asked():
    code = (
        "import sys, flyte_hvd.estimators.base, flyte_hvd.estimators.training, "
        "flyte_hvd.estimators.lightning, flyte_hvd.flyte; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_mlflow_missing_is_a_clear_error_naming_the_extra():
    code = textwrap.dedent("""
        import sys

        class HideMlflow:
            def find_spec(self, name, path=None, target=None):
                if name == "mlflow" or name.startswith("mlflow."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, HideMlflow())
        from flyte_hvd.estimators.tracking import MlflowConfig, start_run
        try:
            start_run(MlflowConfig(), "run", {})
        except RuntimeError as error:
            print(error)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    assert "pip install 'flyte-hvd[mlflow]'" in out.stdout, out.stdout + out.stderr
    assert "not installed" in out.stdout


# -- estimators on ranks ---------------------------------------------------------------------------

keras = pytest.importorskip("keras")
mlflow = pytest.importorskip("mlflow")

import cloudpickle  # noqa: E402
import numpy as np  # noqa: E402
from flytekit import FlyteContextManager, task  # noqa: E402
from flytekit.core.data_persistence import FileAccessProvider  # noqa: E402

from flyte_hvd.data.store import Store  # noqa: E402
from flyte_hvd.estimators.keras import KerasEstimator  # noqa: E402
from flyte_hvd.keras.callbacks import BestModelCheckpoint  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _df(spark, rows=64):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    return spark.createDataFrame(
        [(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y, strict=True)],
        ["features", "label"],
    )


def _estimator(store, **overrides):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    params = dict(
        num_proc=2, store=store, model=model, optimizer=keras.optimizers.Adam(0.05), loss="mse",
        feature_cols=["features"], label_cols=["label"], batch_size=8, epochs=2, verbose=0,
    )  # fmt: skip
    params.update(overrides)
    return KerasEstimator(**params)


@pytest.fixture
def file_store_uri(tmp_path, monkeypatch):
    """A real MLflow file store (MLflow 3 asks for this opt-in; its sqlite store needs
    SQLAlchemy, which mlflow-skinny does not bring)."""
    uri = f"file://{tmp_path}/mlruns"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # for `models:/` URIs in this process
    return uri


@pytest.fixture
def sandbox(tmp_path):
    """Flyte's local files (Decks included) under tmp_path."""
    access = FileAccessProvider(
        local_sandbox_dir=str(tmp_path / "flyte"), raw_output_prefix=str(tmp_path / "raw")
    )
    ctx = FlyteContextManager.current_context().with_file_access(access)
    with FlyteContextManager.with_context(ctx):
        yield tmp_path / "flyte"


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.flyte
@pytest.mark.e2e
def test_keras_fit_in_a_flyte_task_is_an_mlflow_run_with_progress_and_a_deck(
    spark_local2, tmp_path, file_store_uri, sandbox, capfd, no_leftover_ranks
):
    df = _df(spark_local2)
    store = Store.create(str(tmp_path / "store"))
    estimator = _estimator(  # verbose=1: the per-epoch progress line (verbose=0 has none)
        store, validation=0.25, run_id="tracked", verbose=1,
        checkpoint_callback=BestModelCheckpoint(monitor="val_loss"),
        mlflow=MlflowConfig(experiment="flyte-hvd-tests", tracking_uri=file_store_uri,
                            registered_model_name="tiny-regressor", tags={"team": "ml"}),
    )  # fmt: skip

    @task(enable_deck=True)
    def fit_in_a_task() -> str:
        return estimator.fit(df).getMlflowRunId()

    run_id = fit_in_a_task()

    # Rank 0's progress lines reached the driver, one per epoch, with the time left.
    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "flyte-hvd: epoch " in line]
    assert len(lines) == 2, lines
    assert re.search(r"\[0\]<stderr>:flyte-hvd: epoch 1/2 · loss \S+ · val_loss \S+ · "
                     r"\d+\.\d s/epoch · ~\d+ s left$", lines[0]), lines  # fmt: skip
    assert re.search(r"epoch 2/2 · loss \S+ · val_loss \S+ · \d+\.\d s/epoch$", lines[1])

    client = mlflow.MlflowClient(tracking_uri=file_store_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.tags["team"] == "ml"
    params = run.data.params
    assert (params["num_proc"], params["batch_size"], params["epochs"]) == ("2", "8", "2")
    assert params["loss"] == "mse" and params["optimizer"] == "Adam"
    for key in ("loss", "val_loss", "epoch_seconds"):  # MLflow may list a metric twice
        steps = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert sorted(steps) == [0, 1], key
    assert [a.path for a in client.list_artifacts(run_id, "checkpoint")] == [
        "checkpoint/best.keras"
    ]
    versions = client.search_model_versions("name='tiny-regressor'")
    assert [v.run_id for v in versions] == [run_id]
    loaded = mlflow.keras.load_model("models:/tiny-regressor/1")
    assert loaded.predict(np.zeros((2, 3), np.float32), verbose=0).shape == (2, 1)

    # The task's Deck holds the fit's facts and a row per epoch.
    (deck,) = glob.glob(str(sandbox / "**" / "deck.html"), recursive=True)
    with open(deck, encoding="utf-8") as f:
        page = f.read()
    assert run_id in page and store.get_run_path("tracked") in page
    assert len(re.findall(r"<tr><td>\d</td>", page)) == 2 and "val_loss" in page


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: connections are refused


def _nothing_prepared(store) -> bool:
    return not glob.glob(os.path.join(store.prefix_path, "intermediate_*"))


@pytest.mark.spark
@pytest.mark.mpi
def test_an_unreachable_tracking_server_fails_before_any_rank_starts(
    spark_local2, tmp_path, no_leftover_ranks
):
    df = _df(spark_local2, rows=16)
    store = Store.create(str(tmp_path / "store"))
    uri = f"http://127.0.0.1:{_closed_port()}"
    estimator = _estimator(store, mlflow=MlflowConfig(tracking_uri=uri))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"tracking server at `{uri}` is not reachable"):
        estimator.fit(df)
    assert time.monotonic() - started < 5
    assert _nothing_prepared(store)


class _Forbidding(http.server.BaseHTTPRequestHandler):
    """A tracking server that refuses this account everything, as MLflow's auth does."""

    def _refuse(self):
        body = json.dumps({"error_code": "PERMISSION_DENIED",
                           "message": "Permission denied for experiment"}).encode()  # fmt: skip
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _refuse

    def log_message(self, *args):
        pass


@pytest.mark.spark
@pytest.mark.mpi
def test_a_refused_experiment_fails_before_any_rank_starts(
    spark_local2, tmp_path, no_leftover_ranks
):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        df = _df(spark_local2, rows=16)
        store = Store.create(str(tmp_path / "store"))
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        estimator = _estimator(store, mlflow=MlflowConfig(experiment="team-x", tracking_uri=uri))
        started = time.monotonic()
        with pytest.raises(RuntimeError) as raised:
            estimator.fit(df)
        took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    message = str(raised.value)
    assert f"MLflow at `{uri}` did not open a run in experiment `team-x`" in message
    assert "Permission denied" in message and "no rank was started" in message
    assert took < 5
    assert _nothing_prepared(store)


@pytest.mark.spark
def test_a_bad_mlflow_value_fails_before_any_rank_starts(spark_local2, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    with pytest.raises(ValueError, match=r"`mlflow` must be True"):
        _estimator(store, mlflow="http://mlflow:5000").fit(_df(spark_local2, rows=16))
    assert _nothing_prepared(store)
