"""A training run's report as HTML, and as a Flyte Deck when a Flyte task runs it: the run's
facts (ranks, hosts, store path, run ids, time per epoch), a table of the metrics of each
epoch and inline SVG curves. Plain HTML and SVG: no plotting library.

An estimator's ``fit`` inside a Flyte task adds its report as a Deck, and so does every
``HorovodSpark`` task; flytekit renders Decks of tasks with ``enable_deck=True`` (the
``HorovodSpark`` task's default).
"""

from __future__ import annotations

import html
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flyte_hvd.core.log import get_logger

if TYPE_CHECKING:
    from flyte_hvd.data.store import RemoteStore
    from flyte_hvd.estimators.tracking import MlflowRun

logger = get_logger(__name__)

DECK_TITLE = "Training"


def run_report_html(
    facts: Mapping[str, Any],
    history: Mapping[str, Sequence[float]],
    epoch_seconds: Sequence[float] = (),
) -> str:
    """The report: facts, the epoch table and the curves (one chart per metric, training and
    validation together)."""
    facts = dict(facts)
    if epoch_seconds:
        facts.setdefault("time per epoch", f"{sum(epoch_seconds) / len(epoch_seconds):.1f} s")
    rows = "".join(
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
        f"<td>{html.escape(_fact(v))}</td></tr>"
        for k, v in facts.items()
        if v not in (None, "", [])
    )
    parts = [
        f"<h3>Run</h3><table>{rows}</table>",
        "<h3>Epochs</h3>",
        epoch_table_html(history, epoch_seconds),
    ]
    if any(history.values()):
        parts.append(training_curves_html(history, best_epoch(history)))
    return "".join(parts)


def epoch_table_html(
    history: Mapping[str, Sequence[float]], epoch_seconds: Sequence[float] = ()
) -> str:
    """One row per epoch: its number, each metric and its seconds."""
    names = sorted(history, key=lambda k: (k.removeprefix("val_"), k.startswith("val_")))
    epochs = max([len(v) for v in history.values()] + [len(epoch_seconds)], default=0)
    if not epochs:
        return "<p class='epochs'>no epochs recorded</p>"
    head = "".join(f"<th>{html.escape(n)}</th>" for n in ["epoch", *names, "seconds"])
    body = []
    for i in range(epochs):
        cells = [str(i + 1)]
        cells += [_number(history[n], i) for n in names]
        cells.append(_number(epoch_seconds, i, ".1f"))
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table class='epochs'><tr>{head}</tr>{''.join(body)}</table>"


def training_curves_html(
    history: Mapping[str, Sequence[float]], best: int, metrics: Mapping[str, str] | None = None
) -> str:
    """Each metric per epoch, training and validation (``val_<metric>``), as inline SVG
    charts; ``metrics`` maps the metrics to draw to their titles (default: every metric of
    ``history``); ``best`` (from 0) is the epoch named under each chart."""
    if metrics is None:
        metrics = {k: k for k in history if not k.startswith("val_")}
        metrics.update({k[4:]: k[4:] for k in history if k.startswith("val_")})
    charts = []
    for metric, title in metrics.items():
        series = {
            name: history[key]
            for name, key in (("train", metric), ("validation", f"val_{metric}"))
            if key in history
        }
        charts.append(_line_chart(title, series, best))
    return "<div style='display:flex;flex-wrap:wrap;gap:24px'>" + "".join(charts) + "</div>"


def in_flyte_task() -> bool:
    """Whether this process runs a Flyte task's body now (not on a Flyte rank)."""
    if "flytekit" not in sys.modules:  # no Flyte task runs in a process that never loaded it
        return False
    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionState

    ctx = FlyteContextManager.current_context()
    state = ctx.execution_state
    return (
        state is not None
        and ctx.user_space_params is not None
        and state.mode
        in (
            ExecutionState.Mode.TASK_EXECUTION,
            ExecutionState.Mode.LOCAL_TASK_EXECUTION,
            ExecutionState.Mode.DYNAMIC_TASK_EXECUTION,
            ExecutionState.Mode.LOCAL_DYNAMIC_TASK_EXECUTION,
        )
    )


def add_deck(content: str, title: str = DECK_TITLE) -> bool:
    """Add ``content`` as a Flyte Deck when this process runs a Flyte task (flytekit renders
    it if the task has ``enable_deck=True``); False, and nothing done, elsewhere."""
    if not in_flyte_task():
        return False
    from flytekit import Deck, FlyteContextManager

    Deck(title, content)
    params = FlyteContextManager.current_context().user_space_params
    if params is not None and not params.enable_deck:
        logger.debug("the task has enable_deck=False: its %r Deck is not rendered", title)
    return True


def add_fit_report(
    estimator: str,
    results: list[dict],
    remote_store: RemoteStore,
    run_id: str,
    mlflow_run: MlflowRun | None,
) -> None:
    """Inside a Flyte task, an estimator's fit's report as a Deck: its facts (from the ranks'
    ``results`` and the run's state in the store), epochs and curves."""
    from flyte_hvd.estimators.training import read_run_state

    if not in_flyte_task():
        return
    state = read_run_state(remote_store) or {}
    hosts = {r["host"] for r in results if isinstance(r, dict) and "host" in r}
    facts = {
        "estimator": estimator,
        "ranks": len(results),
        "hosts": sorted(hosts),
        "store run path": remote_store.run_path,
        "run id": run_id,
        "MLflow run id": mlflow_run.run_id if mlflow_run else None,
        "MLflow tracking URI": mlflow_run.tracking_uri if mlflow_run else None,
    }
    history = results[0]["history"]
    add_deck(run_report_html(facts, history, state.get("epoch_seconds", [])))


def best_epoch(history: Mapping[str, Sequence[float]]) -> int:
    """The epoch (from 0) with the lowest validation loss, else the lowest loss, else the
    last."""
    for key in ("val_loss", "loss"):
        values = list(history.get(key) or [])
        if values:
            return min(range(len(values)), key=values.__getitem__)
    return max((len(v) for v in history.values()), default=1) - 1


def _fact(value: object) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def _number(values: Sequence[float], i: int, spec: str = ".4g") -> str:
    return format(float(values[i]), spec) if i < len(values) else ""


def _line_chart(title: str, series: dict[str, Sequence[float]], best: int) -> str:
    width, height, pad = 420, 260, 40
    values = [v for vs in series.values() for v in vs]
    if not values:
        return f"<p>{html.escape(title)}: no values</p>"
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    epochs = max(len(vs) for vs in series.values())

    def xy(i: int, v: float) -> str:
        x = pad + (width - 2 * pad) * (i / max(epochs - 1, 1))
        y = height - pad - (height - 2 * pad) * ((v - low) / span)
        return f"{x:.1f},{y:.1f}"

    colors = {"train": "#1f77b4", "validation": "#d62728"}
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>",
        f"<text x='{width / 2}' y='18' text-anchor='middle'>{html.escape(title)}</text>",
        f"<text x='4' y='{pad}'>{high:.4g}</text><text x='4' y='{height - pad}'>{low:.4g}</text>",
        f"<text x='{width / 2}' y='{height - 8}' text-anchor='middle'>epoch 1..{epochs} "
        f"(best {best + 1})</text>",
    ]
    for k, (name, vs) in enumerate(series.items()):
        color = colors.get(name, "#333")
        points = " ".join(xy(i, v) for i, v in enumerate(vs))
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{points}'/>")
        parts.append(
            f"<text x='{width - pad}' y='{34 + 14 * k}' fill='{color}' "
            f"text-anchor='end'>{name}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
