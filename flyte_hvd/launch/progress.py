"""Rank 0's per-epoch progress: one line per epoch that reaches the driver through the rank
output path (``epoch 3/10 · loss 0.41 · val_loss 0.44 · 12.1 s/epoch · ~85 s left``), and the
epochs kept in this process for the run's report (a Flyte Deck) and for listeners such as an
MLflow run.

The estimators' rank-side record and ``flyte_hvd.keras.callbacks.MetricAverageCallback``
call ``record_epoch`` on rank 0; a ``HorovodSpark`` task's rank 0 hands ``epochs()`` back to
the driver, which draws them. Nothing here imports a framework.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flyte_hvd.core.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Epoch:
    """One finished epoch: ``number`` counts from 1, ``metrics`` are the averaged logs."""

    number: int
    epochs: int | None
    metrics: dict[str, float]
    seconds: float


@dataclass
class _Run:
    epochs: list[Epoch] = field(default_factory=list)
    listeners: list[Callable[[Epoch], None]] = field(default_factory=list)


_run = _Run()


def reset() -> None:
    """Start a new run's record in this process (a rank process may serve several runs)."""
    global _run
    _run = _Run()


def add_listener(listener: Callable[[Epoch], None]) -> None:
    """Call ``listener(epoch)`` for each epoch recorded until the next ``reset``."""
    _run.listeners.append(listener)


def epochs() -> list[Epoch]:
    """The epochs recorded since the last ``reset``."""
    return list(_run.epochs)


def record_epoch(
    number: int,
    epochs: int | None,
    metrics: dict[str, float],
    seconds: float,
    seconds_so_far: list[float] | None = None,
    verbose: int = 1,
) -> Epoch:
    """Record epoch ``number`` (from 1) of ``epochs``, tell the listeners, and log its line.
    ``seconds_so_far``: this attempt's epoch times, for the time left (default: the
    epochs recorded in this process)."""
    epoch = Epoch(number, epochs, {k: float(v) for k, v in metrics.items()}, float(seconds))
    _run.epochs.append(epoch)
    for listener in list(_run.listeners):
        listener(epoch)
    if verbose:
        times = seconds_so_far if seconds_so_far is not None else [e.seconds for e in _run.epochs]
        logger.info("%s", progress_line(epoch, times))
    return epoch


def progress_line(epoch: Epoch, seconds_so_far: list[float]) -> str:
    """``epoch 3/10 · loss 0.41 · val_loss 0.44 · 12.1 s/epoch · ~85 s left``. The pace leaves
    out the first epoch once there are others: it holds the model's tracing and warm-up."""
    total = f"/{epoch.epochs}" if epoch.epochs else ""
    parts = [f"epoch {epoch.number}{total}"]
    parts += [f"{name} {value:.4g}" for name, value in sorted(epoch.metrics.items())]
    times = seconds_so_far or [epoch.seconds]
    steady = times[1:] if len(times) > 1 else times
    pace = sum(steady) / len(steady)
    parts.append(f"{pace:.1f} s/epoch")
    if epoch.epochs and epoch.number < epoch.epochs:
        parts.append(f"~{pace * (epoch.epochs - epoch.number):.0f} s left")
    return " · ".join(parts)
