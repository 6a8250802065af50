"""An estimator's fit with its per-epoch metrics live in the task's Flyte 2 report."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import flyte.report

from flyte_hvd.estimators.history import history_html, read_history, watch_history

if TYPE_CHECKING:
    from pyspark.ml import Model
    from pyspark.sql import DataFrame

    from flyte_hvd.estimators.base import HorovodEstimator


def fit_with_report(
    estimator: HorovodEstimator,
    df: DataFrame,
    tab: str = "Training",
    poll_s: float = 2.0,
    params: dict | None = None,
) -> Model:
    """``estimator.fit(df, params)`` with a report tab that shows its metrics per epoch (a
    table and the curves), replaced and flushed after every epoch while the fit runs, so the
    Flyte UI shows the run's progress live; use it in a task with ``report=True``.

    The epochs are read from the run's ``state.json`` in the estimator's Store (rank 0
    replaces it after each epoch), every ``poll_s`` seconds, by a thread of the driver. An
    estimator without ``run_id`` fits under a new unique one (on a copy), so the report
    follows this fit only.

    Returns:
        The fitted model, as ``fit`` returns it.
    """
    run_id = estimator.getRunId()
    if not run_id:
        run_id = f"{type(estimator).__name__.lower()}_{uuid.uuid4().hex[:12]}"
        estimator = estimator.copy()
        estimator.setRunId(run_id)
    store = estimator.getStore()

    def show(history: dict[str, list[float]]) -> None:
        flyte.report.get_tab(tab).replace(history_html(history))
        flyte.report.flush()

    with watch_history(store, run_id, show, poll_s):
        model = estimator.fit(df, params)
    history = model.getHistory() or read_history(store, run_id)
    if history:  # the run folder is gone when the Store keeps no runs
        show({k: [float(v) for v in values] for k, values in history.items()})
    return model
