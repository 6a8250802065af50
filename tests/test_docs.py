"""The documentation: the README is a landing page, the API reference lists every public name,
nothing points outside the repository, and the docstring examples run."""

from __future__ import annotations

import doctest
import importlib
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import api_reference  # noqa: E402


def test_readme_is_a_landing_page_under_15_kb_that_links_the_docs():
    with open(os.path.join(REPO, "README.md"), "rb") as f:
        text = f.read()
    assert len(text) < 15 * 1024
    for page in ("docs/getting-started.md", "docs/migration.md", "docs/reliability.md",
                 "docs/performance.md", "docs/design.md", "CHANGELOG.md"):  # fmt: skip
        assert page.encode() in text
        assert os.path.exists(os.path.join(REPO, page))


def test_nothing_in_the_repository_points_outside_it():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    outside = "../" + "shared"
    hits = []
    for name in files:
        path = os.path.join(REPO, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                if outside.encode() in f.read():
                    hits.append(name)
    assert not hits


def test_api_reference_pages_are_current_and_list_every_public_name():
    assert api_reference.main(["--check"]) == 0
    for short in api_reference.PACKAGES:
        package = importlib.import_module(f"flyte_hvd.{short}")
        with open(os.path.join(REPO, "docs", "reference", f"{short}.md")) as f:
            page = f.read()
        missing = [n for n in package.__all__ if f"`{n}`" not in page]
        assert not missing, f"flyte_hvd.{short}: {missing} missing from its reference page"


def _run_examples(obj, globs):
    """Runs ``obj``'s docstring examples for real: those marked +SKIP for a reader without
    Spark included."""
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(obj, globs=dict(globs))
    assert tests and any(t.examples for t in tests), f"{obj!r} has no example"
    for test in tests:
        for example in test.examples:
            example.options.pop(doctest.SKIP, None)
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} example(s) of {obj!r} failed (see above)"


@pytest.mark.spark
@pytest.mark.mpi
def test_launch_examples_run(spark_local2):
    from flyte_hvd.spark import HorovodRunner, TorchDistributor
    from flyte_hvd.stage.dispatch import run

    _run_examples(run, {})
    _run_examples(HorovodRunner, {})
    _run_examples(TorchDistributor, {})


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.e2e
def test_data_and_estimator_examples_run(spark_local2, tmp_path, monkeypatch):
    import numpy as np
    from pyspark.ml.linalg import Vectors

    from flyte_hvd.data.prepare import prepare_data
    from flyte_hvd.data.store import Store

    keras = pytest.importorskip("keras")
    from flyte_hvd.estimators.keras import KerasEstimator

    # The ranks take the driver's environment: TensorFlow's start-up lines would be output.
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    df = spark_local2.createDataFrame(
        [(Vectors.dense(a.tolist()), float(a.sum())) for a in x], ["features", "y"]
    )
    _run_examples(prepare_data, {"df": df, "work_dir": str(tmp_path / "prepared")})
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    globs = {"store": Store.create(str(tmp_path / "store")), "model": model, "train_df": df,
             "test_df": df}  # fmt: skip
    _run_examples(KerasEstimator, globs)
