"""TensorBoard's PyTorch writer, imported the way a PyTorch or Lightning rank needs it: without
TensorFlow (``torch_model.tensorboard_without_tensorflow``).

Rank 0 of a fit writes each epoch's metrics with it (``torch.utils.tensorboard``, or
Lightning's TensorBoard logger on top of it), and its first import -- TensorBoard's stubs and
boto3 -- took about a second of rank 0's first epoch on two busy cores. Spare rank processes
import this module ahead of their run (the estimators' ``_preload``), so the run finds it
imported. For rank processes only: importing it tells TensorBoard that the process has no
TensorFlow."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from flyte_hvd.estimators.torch_model import tensorboard_without_tensorflow

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

tensorboard_without_tensorflow()
with contextlib.suppress(ImportError):  # tensorboard is optional: a run then has no logs
    import torch.utils.tensorboard  # noqa: F401


def summary_writer(logs_dir: str) -> SummaryWriter | None:
    """A writer of TensorBoard logs into ``logs_dir``, or None without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(logs_dir)
