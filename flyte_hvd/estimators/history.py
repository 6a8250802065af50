"""A fit's per-epoch metrics while it runs and after: read from the run's ``state.json``, which
rank 0 replaces after every epoch, and drawn as HTML (a table and the curves) for a Flyte
report or Deck.

The driver learns of epochs through the Store, not through the ranks: ``watch_history`` polls
``runs/<run_id>/state.json`` from a thread of its own, so it works the same for every
estimator, on a local disk or S3, and adds nothing to the ranks' work.
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from flyte_hvd.core.log import get_logger
from flyte_hvd.estimators import report

if TYPE_CHECKING:
    from flyte_hvd.data.store import Store

logger = get_logger(__name__)


def read_history(store: Store, run_id: str) -> dict[str, list[float]] | None:
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
    store: Store,
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
    """The metrics per epoch as an HTML table and inline SVG curves (training and
    validation, ``flyte_hvd.estimators.report``); ``best`` (0-based) marks an epoch, by
    default the one with the lowest validation loss."""
    if not any(history.values()):
        return report.epoch_table_html(history)
    marked = report.best_epoch(history) if best is None else best
    return report.epoch_table_html(history) + report.training_curves_html(history, marked)
