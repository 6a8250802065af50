"""The Rossmann pipeline: dataset loading and checks, Spark features, each task, the workflow
end to end (the main job, run once and asserted by several tests; its S3 work_dir shape is the
simulated-host cluster's, tests/test_cluster.py), serialization and the retraining launch plan."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pandas as pd
import pytest
from flytekit.types.structured import StructuredDataset

pytest.importorskip("keras")

from pipelines import MainJob

from workflows import rossmann
from workflows import rossmann_steps as steps
from workflows.rossmann_data import (
    SCHEMA,
    DatasetError,
    check_dataset,
    check_values,
    fetch_dataset,
    write_synthetic,
)
from workflows.rossmann_formats import FORMATS, parse_number, unreadable

SMALL = dict(stores=6, seed=1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    """A six-store synthetic dataset (about 5 k training rows)."""
    return write_synthetic(str(tmp_path_factory.mktemp("rossmann")), **SMALL)


# -- the dataset ---------------------------------------------------------------------------


def test_synthetic_dataset_has_the_real_files_columns_and_formats(small_dataset):
    for name, columns in SCHEMA.items():
        frame = pd.read_csv(os.path.join(small_dataset, name), dtype=str, keep_default_na=False)
        assert list(frame.columns) == columns, name
    train = pd.read_csv(os.path.join(small_dataset, "train.csv"), dtype=str)
    assert set(train.StateHoliday) <= {"0", "a", "b", "c"}
    assert train.Date.min() == "2013-01-01" and train.Date.max() == "2015-07-31"
    test = pd.read_csv(os.path.join(small_dataset, "test.csv"), dtype=str)
    assert test.Date.min() == "2015-08-01" and test.Date.max() == "2015-09-17"
    assert test.Id.astype(int).is_unique
    trend = pd.read_csv(os.path.join(small_dataset, "googletrend.csv"), dtype=str)
    assert trend.week.str.fullmatch(r"\d{4}-\d\d-\d\d - \d{4}-\d\d-\d\d").all()
    assert {"Rossmann_DE", "Rossmann_DE_NI"} <= set(trend.file)
    states = pd.read_csv(os.path.join(small_dataset, "state_names.csv"), dtype=str)
    assert "HB,NI" in set(states.State)
    # Learnable: promotions raise sales.
    sales = train[train.Open.map(parse_number) == 1].assign(Sales=lambda f: f.Sales.astype(float))
    by_promo = sales.groupby("Promo").Sales.mean()
    assert by_promo["1"] > 1.15 * by_promo["0"]


def _lines(dataset: str, name: str) -> list[str]:
    with open(os.path.join(dataset, name)) as f:
        return f.read().splitlines()


def test_synthetic_files_are_written_as_the_real_ones(small_dataset):
    """The default run meets every spelling of the real files: quoted headers and values,
    test.csv's Open as 1.0, 0.0 or blank (on 11 open days of one store), StateHoliday quoted
    in train.csv and bare in test.csv, floats and gaps in weather.csv."""
    train, test, store = (_lines(small_dataset, f) for f in ("train.csv", "test.csv", "store.csv"))
    assert train[0].startswith('"Store","DayOfWeek"') and test[0].startswith('"Id","Store"')
    assert {line.split(",")[7] for line in train[1:]} == {'"0"', '"a"', '"b"', '"c"'}
    cells = [line.split(",") for line in test[1:]]
    assert {c[4] for c in cells} == {"1.0", "0.0", ""}
    assert {c[6] for c in cells} >= {"0", "a"}
    blank = [c for c in cells if c[4] == ""]
    assert len(blank) == 11 and len({c[1] for c in blank}) == 1
    assert any(line.endswith(',""') for line in store[1:])  # a blank, quoted PromoInterval
    assert any(',"Jan,Apr,Jul,Oct"' in line for line in store[1:])
    weather = pd.read_csv(
        os.path.join(small_dataset, "weather.csv"), dtype=str, keep_default_na=False
    )
    assert weather.CloudCover.str.fullmatch(r"\d\.0|").all() and (weather.CloudCover == "").any()
    assert weather.Max_Gust_SpeedKm_h.str.fullmatch(r"\d+\.0|").all()
    assert weather.Mean_TemperatureC.str.fullmatch(r"-?\d+").all()
    assert 'Niedersachsen,"HB,NI"' in _lines(small_dataset, "state_names.csv")


NUMBERS = [
    ("1", 1.0), ("1.0", 1.0), ("0.0", 0.0), ("0", 0.0), ("", None), ("  ", None), (" 1.0 ", 1.0),
    ("-3", -3.0), ("5.08", 5.08), ("2008.0", 2008.0), (".5", 0.5), ("7.", 7.0),
]  # fmt: skip
NOT_NUMBERS = ["yes", "1,0", "1.0.0", "nan", "NaN", "inf", "1e3", "0x10", "--1", "1 0"]


@pytest.mark.parametrize(("text", "value"), NUMBERS)
def test_parse_number_reads_every_spelling(text, value):
    assert parse_number(text) == value
    assert parse_number(None) is None


@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_parse_number_refuses_what_is_not_a_number(text):
    with pytest.raises(ValueError, match=r"is not a number written like 7, 7\.0 or 5\.08"):
        parse_number(text)


def test_each_format_reads_its_spellings_and_refuses_the_rest():
    cases = {
        ("test.csv", "Open"): (["1", "1.0", "0", "0.0", "", " 1.0 "], ["2", "yes", "0.5", "-1"]),
        ("train.csv", "Open"): (["1", "0.0"], ["", "true"]),  # blank only in test.csv
        ("train.csv", "StateHoliday"): (["0", "0.0", "a", "b", "c"], ["d", "A", "1", ""]),
        ("store.csv", "CompetitionOpenSinceYear"): (["2008", "2008.0", ""], ["2008.5", "x"]),
        ("store.csv", "Store"): (["1", "1.0"], ["1.5", "", "one"]),
        ("store.csv", "CompetitionDistance"): (["1270", "1270.0", "5.5", ""], ["1,270"]),
        ("train.csv", "Date"): (["2015-07-31", "2016-02-29"], ["2015-02-30", "31.07.2015", ""]),
        ("googletrend.csv", "week"): (["2012-12-02 - 2012-12-08"], ["2012-12-02", ""]),
        ("weather.csv", "Events"): (["", "Rain-Thunderstorm"], []),
    }
    for (name, column), (good, bad) in cases.items():
        fmt = FORMATS[name][column]
        found = unreadable(pd.Series(good + bad, dtype=str), fmt).tolist()
        assert found == [False] * len(good) + [True] * len(bad), (name, column, found)


@pytest.mark.parametrize(
    ("name", "column", "row", "value", "expected"),
    [
        ("test.csv", "Open", 3, "yes", r"0 or 1 \(also written 0.0 or 1.0\) or blank"),
        ("train.csv", "StateHoliday", 10, "d", r"0 \(none\), a \(public\)"),
        ("train.csv", "Sales", 2, "", "a whole number"),
        ("store.csv", "Store", 4, "4.5", "a whole number written like 7 or 7.0"),
        ("weather.csv", "Date", 7, "2013-02-30", "a date written YYYY-MM-DD"),
    ],
)
def test_a_value_that_cannot_be_read_names_file_column_row_and_value(
    small_dataset, tmp_path, name, column, row, value, expected
):
    frame = pd.read_csv(os.path.join(small_dataset, name), dtype=str, keep_default_na=False)
    frame.loc[row - 1, column] = value
    frame.to_csv(tmp_path / name, index=False)
    pattern = (
        rf"{re.escape(name)}, column `{column}`, row {row} .*: "
        rf"cannot read {re.escape(repr(value))}; expected {expected}"
    )
    with pytest.raises(DatasetError, match=pattern):
        check_values(str(tmp_path), name)


def test_the_check_counts_the_other_unreadable_values_of_the_column(small_dataset, tmp_path):
    frame = pd.read_csv(os.path.join(small_dataset, "test.csv"), dtype=str, keep_default_na=False)
    frame.loc[[2, 5, 9], "Promo"] = ["yes", "no", "2"]
    frame.to_csv(tmp_path / "test.csv", index=False)
    with pytest.raises(
        DatasetError,
        match=r"column `Promo`, row 3 .*cannot read 'yes'.*\(2 more value\(s\) in this column",
    ):
        check_values(str(tmp_path), "test.csv")


def test_download_data_refuses_an_unreadable_value_before_spark(small_dataset, tmp_path):
    """What a user meets: download_data (no Spark yet) fails naming file, column, row, value."""
    broken = tmp_path / "broken"
    shutil.copytree(small_dataset, broken)
    lines = _lines(str(broken), "test.csv")
    cells = lines[5].split(",")
    cells[4] = "open"
    lines[5] = ",".join(cells)
    (broken / "test.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(Exception, match=r"test\.csv, column `Open`, row 5 .*cannot read 'open'"):
        rossmann.download_data(dataset=str(broken))
    check_dataset(small_dataset)  # the untouched files pass


@pytest.mark.parametrize("kind", ["tgz", "zip", "dir"])
def test_fetch_dataset_from_archives_and_directories(small_dataset, tmp_path, kind):
    if kind == "tgz":
        source = str(tmp_path / "rossmann.tgz")
        with tarfile.open(source, "w:gz") as tf:
            tf.add(small_dataset, arcname="rossmann")  # files under a folder, as usual
        source = f"file://{source}"
    elif kind == "zip":
        source = str(tmp_path / "rossmann.zip")
        with zipfile.ZipFile(source, "w") as zf:
            for name in SCHEMA:
                zf.write(os.path.join(small_dataset, name), arcname=name)
    else:
        source = small_dataset
    dest = fetch_dataset(source, str(tmp_path / "out"))
    assert sorted(os.listdir(dest)) == sorted(SCHEMA)


def test_fetch_dataset_errors_name_what_is_wrong(small_dataset, tmp_path):
    with pytest.raises(DatasetError, match="cannot read dataset archive"):
        fetch_dataset(f"file://{tmp_path}/nope.tgz", str(tmp_path / "a"))
    with pytest.raises(DatasetError, match="neither a local directory nor"):
        fetch_dataset("https://example.invalid/rossmann.csv", str(tmp_path / "b"))
    not_archive = tmp_path / "fake.tgz"
    not_archive.write_text("not gzip")
    with pytest.raises(DatasetError, match="not a readable archive"):
        fetch_dataset(str(not_archive), str(tmp_path / "c"))

    partial = tmp_path / "partial"
    shutil.copytree(small_dataset, partial)
    os.remove(partial / "weather.csv")
    os.remove(partial / "store_states.csv")
    with pytest.raises(DatasetError, match=r"lacks store_states\.csv, weather\.csv"):
        fetch_dataset(str(partial), str(tmp_path / "d"))

    renamed = tmp_path / "renamed"
    shutil.copytree(small_dataset, renamed)
    store = pd.read_csv(renamed / "store.csv", dtype=str, keep_default_na=False)
    store.rename(columns={"Assortment": "Range"}).to_csv(renamed / "store.csv", index=False)
    with pytest.raises(DatasetError, match=r"store\.csv lacks the column\(s\) \['Assortment'\]"):
        fetch_dataset(str(renamed), str(tmp_path / "e"))


def test_hyperparameters_refuse_bad_values():
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\] .*; found 0\."):
        rossmann.Hyperparameters(sample_rate=0)
    with pytest.raises(ValueError, match="sample_rate"):
        rossmann.Hyperparameters(sample_rate=1.5)
    with pytest.raises(ValueError, match="num_proc must be an int >= 1; found 0"):
        rossmann.Hyperparameters(num_proc=0)
    with pytest.raises(ValueError, match="learning_rate"):
        rossmann.Hyperparameters(learning_rate=-1.0)
    with pytest.raises(ValueError, match=r"verbose must be 0 .*, 1 .* or 2 .*; found 3\."):
        rossmann.Hyperparameters(verbose=3)
    with pytest.raises(ValueError, match=r"verbose .*; found True"):
        rossmann.Hyperparameters(verbose=True)


def test_unwritable_work_dir_fails_first(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    with pytest.raises(Exception, match="cannot write to the store") as raised:
        rossmann.check_work_dir(work_dir=str(blocker / "rossmann"))
    assert str(blocker) in str(raised.value)


def test_remote_execution_refuses_a_pod_local_work_dir(tmp_path, monkeypatch):
    """On a cluster a local work_dir would vanish with the pod (and `latest` would never find
    a checkpoint): the first task says so and what to pass instead."""
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_ID", "f3a9c2")
    with pytest.raises(Exception, match=r"is a local path, .* --work_dir s3://"):
        rossmann.check_work_dir(work_dir=str(tmp_path / "work"))
    monkeypatch.delenv("FLYTE_INTERNAL_EXECUTION_ID")
    assert rossmann.check_work_dir(work_dir=str(tmp_path / "work")) == str(tmp_path / "work")


def test_registration_time_work_dir_becomes_the_default(tmp_path):
    """FLYTE_HVD_WORK_DIR at import (what `pyflyte register` and `flyte deploy` see) is the
    default work_dir of the workflow, of the scheduled launch plan and of the Flyte 2 task
    that the weekly trigger runs."""
    code = (
        "from workflows import rossmann as r, rossmann_flyte2 as r2\n"
        "plan = r.rossmann_weekly_retrain.parameters.parameters['work_dir']\n"
        "wf = r.horovod_spark_wf.python_interface.default_inputs_as_kwargs['work_dir']\n"
        "task = r2.rossmann.native_interface.inputs['work_dir'][1]\n"
        "print(plan.default.scalar.primitive.string_value, wf, task)\n"
    )
    env = {**os.environ, "FLYTE_HVD_WORK_DIR": "s3://bucket/rossmann"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["s3://bucket/rossmann"] * 3


# -- Spark features and the tasks on their own ---------------------------------------------


@pytest.mark.spark
def test_features_keep_every_row_and_flag_validation(spark_local2, small_dataset):
    from workflows.rossmann_features import FEATURE_COLS, baseline_rmspe, prepare_frames

    train, test, vocab, max_sales, mean_sales = prepare_frames(spark_local2, small_dataset)
    raw_train = pd.read_csv(os.path.join(small_dataset, "train.csv"), dtype=str)
    assert train.count() == int((raw_train.Sales.astype(int) > 0).sum())
    assert test.count() == len(pd.read_csv(os.path.join(small_dataset, "test.csv")))
    assert set(FEATURE_COLS) <= set(train.columns)
    row = train.filter("Validation").agg({"Date": "min"}).first()[0]
    assert str(row) == "2014-08-02"  # after test start minus one year, as in the tutorial
    assert len(vocab["Store"]) == SMALL["stores"] and 7 < mean_sales < max_sales < 11
    limits = train.agg({"CompetitionMonthsOpen": "max", "Promo2Weeks": "max"}).first()
    assert vocab["CompetitionMonthsOpen"][-1] == "24" and vocab["Promo2Weeks"][-1] == "25"
    assert limits is not None
    assert 0.02 < baseline_rmspe(train) < 0.5
    assert vocab["StateHoliday"] == ["false", "true"] and vocab["Store"][:2] == ["1", "2"]
    assert all(re.fullmatch(r"\d{4}", y) for y in vocab["CompetitionOpenSinceYear"])

    # Open per test row: 0.0 closed, 1.0 and blank open.
    raw = pd.read_csv(os.path.join(small_dataset, "test.csv"), dtype=str, keep_default_na=False)
    expected = dict(zip(raw.Id.astype(int), raw.Open.map(parse_number) != 0, strict=True))
    found = dict(test.select("Id", "Open").collect())
    assert found == expected and not all(found.values()) and raw.Open.eq("").sum() == 11


MIXED_TEST_CSV = """\
"Id","Store","DayOfWeek","Date","Open","Promo","StateHoliday","SchoolHoliday"
1,1,4,2015-09-17,1.0,1,"0","0"
2,"2",4,2015-09-17,0.0,0,0,1
3,3.0,4,2015-09-17,,1,a,"1"
4,4,4,"2015-09-17",1,0,"b",0.0
5,5,4,2015-09-17,0,0,c,1.0
6,6,4,2015-09-17, 1.0 ,0,0.0,0
"""


@pytest.mark.spark
def test_spark_reads_every_spelling_by_its_meaning(spark_local2, tmp_path):
    """Quoted or not, 1 or 1.0 or blank, StateHoliday 0/"0"/0.0/a/b/c: the check accepts the
    file and Spark reads each column as what it means."""
    import datetime

    from workflows.rossmann_features import number, read_csv

    (tmp_path / "test.csv").write_text(MIXED_TEST_CSV)
    check_values(str(tmp_path), "test.csv")
    rows = read_csv(spark_local2, str(tmp_path), "test.csv").orderBy("Id").collect()
    assert [r.Store for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.Open for r in rows] == [True, False, None, True, False, True]  # None: blank
    assert [r.Promo for r in rows] == [True, False, True, False, False, False]
    assert [r.StateHoliday for r in rows] == [False, False, True, True, True, False]
    assert [r.SchoolHoliday for r in rows] == [False, True, True, False, True, False]
    assert {r.Date for r in rows} == {datetime.date(2015, 9, 17)}

    # number() is parse_number in Spark: the same answer for every spelling.
    texts = spark_local2.createDataFrame([(t,) for t, _ in NUMBERS] + [(None,)], "t string")
    found = [r[0] for r in texts.select(number("t")).collect()]
    assert found == [parse_number(t) for t, _ in NUMBERS] + [None]


@pytest.mark.spark
def test_submission_sales_are_exactly_zero_where_closed(spark_local2):
    import math

    from workflows.rossmann_features import submission_sales

    df = spark_local2.createDataFrame(
        [(1, True, 8.5), (2, False, 8.5), (3, None, 8.0)], "Id int, Open boolean, Predicted float"
    )
    rows = df.select("Id", submission_sales().alias("Sales")).orderBy("Id").collect()
    sales = [r.Sales for r in rows]
    assert sales[1] == 0.0 and math.isclose(sales[0], math.exp(8.5), rel_tol=1e-6)
    assert math.isclose(sales[2], math.exp(8.0), rel_tol=1e-6)  # blank Open: open


def test_summarize_reports_the_closed_test_rows(tmp_path, capsys):
    from flytekit.types.file import FlyteFile

    model = tmp_path / "model.keras"
    model.write_bytes(b"model")
    submission = tmp_path / "submission.csv"
    submission.write_text("Id,Sales\n1,0.0\n2,5263.2\n3,0.0\n4,0.5\n")
    result = rossmann.TrainResult(
        model=FlyteFile(str(model)), history={"val_loss": [1.0]}, best_epoch=1,
        best_val_rmspe=0.1, val_rmspe=0.1, validation_rows=10, run_id="r1",
        checkpoint_uri=str(tmp_path / "runs" / "r1" / "checkpoint.keras"),
    )  # fmt: skip
    report = rossmann.summarize(
        result=result, baseline_rmspe=0.2, submission=FlyteFile(str(submission)),
        work_dir=str(tmp_path),
    )  # fmt: skip
    assert (report.test_rows, report.closed_test_rows) == (4, 2)
    out = capsys.readouterr().out
    assert "test rows:  4 predicted, 2 of them closed (Sales 0), 2 open" in out
    assert " beats " in out


@pytest.mark.spark
def test_a_join_that_loses_rows_is_an_error(spark_local2, small_dataset, tmp_path):
    from workflows.rossmann_features import LostRowsError, prepare_frames

    broken = tmp_path / "broken"
    shutil.copytree(small_dataset, broken)
    states = pd.read_csv(broken / "store_states.csv", dtype=str)
    states[states.Store != "3"].to_csv(broken / "store_states.csv", index=False)
    with pytest.raises(LostRowsError, match=r"store\.csv / store_states\.csv onto train\.csv"):
        prepare_frames(spark_local2, str(broken))


def _train(prepared, **inputs):
    return rossmann.train(
        train=prepared.train, vocab=prepared.vocab, max_sales=prepared.max_sales,
        mean_sales=prepared.mean_sales, **{"warm_start": "", **inputs},
    )  # fmt: skip


@pytest.mark.spark
@pytest.mark.flyte
def test_tasks_on_their_own(spark_local2, small_dataset, tmp_path):
    """download_data and prepare called as tasks; train called as a task refuses what it
    cannot run before any rank starts. (Training and predicting, and their outputs, are
    asserted on the main job's run below.)"""
    data = rossmann.download_data(dataset=small_dataset)
    hp = rossmann.Hyperparameters(sample_rate=0.5, epochs=1, batch_size=128)
    prepared = rossmann.prepare(data=data, hp=hp)
    assert 0 < prepared.baseline_rmspe < 1 and set(prepared.vocab) >= {"Store", "Events"}
    work_dir = str(tmp_path / "work")

    # num_proc beyond the session's task slots: the launcher's preflight refuses it.
    with pytest.raises(Exception, match="slots"):
        _train(prepared, hp=rossmann.Hyperparameters(num_proc=3, epochs=1), work_dir=work_dir)
    # A warm start from a checkpoint that does not exist says so.
    with pytest.raises(Exception, match=r"warm_start checkpoint .* does not exist"):
        _train(prepared, hp=hp, work_dir=work_dir, warm_start=str(tmp_path / "missing.keras"))


# -- the workflow --------------------------------------------------------------------------


def check_closed_and_open_rows(submission: pd.DataFrame, dataset: str) -> int:
    """Every test row in the submission: Sales exactly 0 where test.csv says closed (0, 0.0),
    positive where it says open (1, 1.0) or leaves Open blank. Returns the closed count."""
    raw = pd.read_csv(os.path.join(dataset, "test.csv"), dtype=str, keep_default_na=False)
    assert submission.Id.tolist() == sorted(raw.Id.astype(int).tolist())
    is_open = raw.Open.map(parse_number)
    sales = submission.set_index("Id").Sales.loc[raw.Id.astype(int)].to_numpy()
    closed, blank = (is_open == 0).to_numpy(), is_open.isna().to_numpy()
    assert closed.any() and blank.any(), "the test set lacks closed or blank-Open rows"
    wrong = raw.Id[closed & (sales != 0)].tolist()
    assert not wrong, f"closed test rows with Sales other than 0: Ids {wrong[:20]}"
    wrong = raw.Id[~closed & ~(sales > 0)].tolist()
    assert not wrong, f"open or blank-Open test rows without a positive Sales: Ids {wrong[:20]}"
    return int(closed.sum())


def test_train_gets_an_executor_per_rank_from_the_hyperparameters(monkeypatch):
    """train_on_ranks compiles (as it does on a cluster, at run time) into a train node whose
    SparkApplication has hp.num_proc executors, each a task slot."""
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.core.context_manager import FlyteContextManager

    # with_overrides replaces the task's config in place: give it back afterwards.
    monkeypatch.setattr(rossmann.train, "_task_config", rossmann.train.task_config)
    settings = SerializationSettings(
        image_config=ImageConfig(default_image=Image(name="d", fqn="flyte-hvd", tag="t"))
    )
    ctx = FlyteContextManager.current_context().with_serialization_settings(settings)
    with FlyteContextManager.with_context(ctx) as ctx:
        spec = rossmann.train_on_ranks.compile_into_workflow(
            ctx, rossmann.train_on_ranks.task_function,
            train_data=StructuredDataset(uri="s3://bucket/train"), vocab={"Store": ["1"]},
            max_sales=1.0, mean_sales=1.0, hp=rossmann.Hyperparameters(num_proc=4),
            work_dir="s3://bucket/rossmann", warm_start="",
        )  # fmt: skip
    (template,) = spec.tasks
    assert template.id.name.endswith("train")
    conf = template.custom["sparkConf"]
    assert conf["spark.executor.instances"] == "4" and conf["spark.task.cpus"] == "1"
    assert conf["spark.dynamicAllocation.enabled"] == "false"
    assert rossmann.train_spark_conf(4)["spark.sql.shuffle.partitions"] == "8"  # SPARK_CONF kept
    # Memory is the deployment's (the propeller defaults), which a task's setting would override.
    assert not [key for key in conf if "memory" in key]


def check_main_job(job: MainJob, tmp_path) -> tuple[float, float]:
    """The trained model beats the naive baseline on the same validation rows, in at most 10
    minutes, and the submission has every closed and blank-Open test row right. Returns (model
    RMSPE, baseline RMSPE)."""
    line = job.line("validation RMSPE")
    model, baseline = (float(v) for v in re.findall(r"RMSPE (\S+) .* baseline's (\S+) ", line)[0])
    assert model < baseline and " beats " in line, line
    assert job.seconds <= 600, f"the main job took {job.seconds:.0f} s"
    submission = job.path("submission")
    assert submission.startswith(job.work_dir) and os.path.exists(submission)
    # Every closed and every blank-Open test row of the synthetic default (seeded, so written
    # again here as download_data wrote it), and the count that summarize reports.
    default = write_synthetic(str(tmp_path / "default"))
    frame = pd.read_csv(submission)
    closed = check_closed_and_open_rows(frame, default)
    assert re.search(rf"^test rows: +{len(frame)} predicted, {closed} of them closed", job.stdout,
                     re.M), job.stdout  # fmt: skip
    # What the user reads on success: the epochs and the result, not pages around them (the
    # sessions and processes the pipeline starts are quiet; the SDK prints a short Report).
    printed = job.stdout.splitlines() + job.stderr.splitlines()
    assert len(printed) <= 40, "\n".join(printed)
    return model, baseline


@pytest.fixture(scope="module")
def main_job(pipeline_runs) -> MainJob:
    """What `make run` runs (pyflyte run, the synthetic default, 2 ranks), once for the
    tests below, which each assert on its output and its Store (run beside the Flyte 2
    pipeline when the session has its test too: tests/pipelines.py)."""
    return pipeline_runs["main_job"].result()


@pytest.mark.flyte
@pytest.mark.e2e
@pytest.mark.timeout(720)
def test_the_main_job_beats_the_baseline_within_ten_minutes(main_job, tmp_path):
    check_main_job(main_job, tmp_path)


@pytest.mark.flyte
@pytest.mark.e2e
def test_the_main_job_leaves_its_run_in_the_store(main_job):
    """The run's checkpoint, state, submission and TensorBoard logs under
    ``<work_dir>/runs/<run_id>/``, every epoch recorded."""
    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.history import read_history

    model = main_job.path("model")
    run = os.path.dirname(model)
    assert run.startswith(os.path.join(main_job.work_dir, "runs"))
    assert os.path.exists(model) and os.path.exists(os.path.join(run, "submission.csv"))
    assert os.listdir(os.path.join(run, "logs"))
    history = read_history(Store.create(main_job.work_dir), os.path.basename(run))
    assert history and {len(v) for v in history.values()} == {rossmann.DEFAULT_HP.epochs}


@pytest.mark.flyte
@pytest.mark.e2e
def test_the_weekly_warm_start_resolves_latest_to_the_main_jobs_checkpoint(main_job, tmp_path):
    """The scheduled launch plan's warm start: 'latest' is the newest run's checkpoint; a
    Store without runs starts from fresh weights."""
    import keras

    from flyte_hvd.data.store import Store

    warm = steps.initial_model(Store.create(main_job.work_dir), steps.LATEST)
    best = keras.models.load_model(main_job.path("model"), compile=False)
    assert all((a == b).all() for a, b in zip(warm.get_weights(), best.get_weights(), strict=True))
    assert steps.initial_model(Store.create(str(tmp_path / "empty")), steps.LATEST) is None


def test_launch_plan_and_serialization():
    from flytekit.configuration import Image, ImageConfig, SerializationSettings

    plan = rossmann.rossmann_weekly_retrain
    assert plan.schedule.cron_schedule.schedule == "0 3 * * 1"
    assert plan.parameters.parameters["warm_start"].default.scalar.primitive.string_value == (
        steps.LATEST
    )
    settings = SerializationSettings(
        image_config=ImageConfig(default_image=Image(name="d", fqn="flyte-hvd", tag="t"))
    )
    custom = rossmann.train.get_custom(settings)
    assert custom["sparkConf"]["spark.executor.instances"] == "2"
    assert custom["sparkConf"]["spark.dynamicAllocation.enabled"] == "false"
