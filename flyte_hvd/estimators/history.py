"""A fit's per-epoch metrics while it runs and after: read from the run's ``state.json``, which
rank 0 replaces after every epoch, and drawn as HTML (a table and the curves) for a Flyte
report or Deck.

The driver learns of epochs through the Store, not through the ranks: ``watch_history`` polls
``runs/<run_id>/state.json`` from a thread of its own, so it works the same for every
estimator, on a local disk or S3, and adds nothing to the ranks' work.
"""

from __future__ import annotations

import contextvars
import html
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flyte_hvd.core.log import get_logger

logger = get_logger(__name__)


def read_history(store: Any, run_id: str) -> dict[str, list[float]] | None:
    """The metric history in ``run_id``'s ``state.json``, or None before its first epoch."""
    path = store.get_state_path(run_id)
    store.fs.invalidate_cache(store.fs_path(path))  # a cached listing would hide new epochs
    try:
        state = json.loads(store.read(path))
    except FileNotFoundError:
        return None
    return {k: [float(v) for v in values] for k, values in state.get("history", {}).items()}


@contextmanager
def watch_history(
    store: Any,
    run_id: str,
    on_epoch: Callable[[dict[str, list[float]]], None],
    poll_s: float = 2.0,
) -> Iterator[None]:
    """Call ``on_epoch(history)`` from a thread each time ``run_id`` completes an epoch, while
    the block runs, and once more at its end if an epoch came since the last call. The thread
    runs in the caller's context (``contextvars``), so ``on_epoch`` may use what the caller's
    task context offers (a Flyte report). A failing ``on_epoch`` is logged, not raised: a
    report must not stop a fit."""
    stop = threading.Event()
    seen = [0]

    def poll() -> None:
        try:
            history = read_history(store, run_id)
            epochs = len(next(iter(history.values()), [])) if history else 0
            if history and epochs != seen[0]:
                seen[0] = epochs
                on_epoch(history)
        except Exception as error:
            logger.warning("the progress of run %s could not be shown: %s", run_id, error)

    def loop() -> None:
        while not stop.wait(poll_s):
            poll()

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(loop,), name=f"watch-{run_id}")
    thread.daemon = True
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        context.run(poll)


def history_html(history: dict[str, list[float]], best: int | None = None) -> str:
    """The metrics per epoch as an HTML table, and the loss and every other metric with a
    validation twin as inline SVG curves (training and validation); ``best`` (0-based)
    marks an epoch."""
    epochs = max((len(v) for v in history.values()), default=0)
    keys = sorted(history)
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    rows = []
    for i in range(epochs):
        cells = "".join(
            f"<td>{history[k][i]:.4g}</td>" if i < len(history[k]) else "<td></td>" for k in keys
        )
        mark = " style='font-weight:bold'" if i == best else ""
        rows.append(f"<tr{mark}><td>{i + 1}</td>{cells}</tr>")
    table = f"<table><tr><th>epoch</th>{head}</tr>{''.join(rows)}</table>"
    return table + history_charts(history, best)


def history_charts(
    history: dict[str, list[float]], best: int | None = None, titles: dict[str, str] | None = None
) -> str:
    """One inline SVG chart per metric (training and validation curves): the metrics
    ``titles`` names, under those titles, else every metric with its name."""
    if titles is None:
        titles = {k: k for k in sorted(history) if not k.startswith("val_")}
    charts = []
    for metric, title in titles.items():
        series = {
            name: history[key]
            for name, key in (("train", metric), ("validation", f"val_{metric}"))
            if key in history
        }
        charts.append(line_chart(title, series, best))
    return "<div style='display:flex;gap:24px;flex-wrap:wrap'>" + "".join(charts) + "</div>"


def line_chart(title: str, series: dict[str, list[float]], best: int | None = None) -> str:
    """Named series of values per epoch as one inline SVG chart."""
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
    marked = f" (best {best + 1})" if best is not None else ""
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>",
        f"<text x='{width / 2}' y='18' text-anchor='middle'>{html.escape(title)}</text>",
        f"<text x='4' y='{pad}'>{high:.4g}</text><text x='4' y='{height - pad}'>{low:.4g}</text>",
        f"<text x='{width / 2}' y='{height - 8}' text-anchor='middle'>epoch 1..{epochs}"
        f"{marked}</text>",
    ]
    for k, (name, vs) in enumerate(series.items()):
        color = colors.get(name, "#333")
        points = " ".join(xy(i, v) for i, v in enumerate(vs))
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{points}'/>")
        parts.append(
            f"<text x='{width - pad}' y='{34 + 14 * k}' fill='{color}' "
            f"text-anchor='end'>{html.escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
