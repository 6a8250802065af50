"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

In training, each rank's per-channel sum, sum of squares and element count are summed across
ranks with one allreduce (through autograd, so gradients account for the other ranks' use of
this rank's inputs); evaluation uses the running statistics, like ``torch.nn.BatchNorm*d``.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from flyte_hvd.core import state
from flyte_hvd.core.reduce_ops import Sum


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` that normalizes with the statistics of the
    global batch (all ranks). Every rank must call ``forward`` the same number of times."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects input of shape (N, C, ...), at least 2-D; found "
                f"{input.dim()}-D."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or not state.is_initialized() or state.size() == 1:
            return super().forward(input)
        from flyte_hvd.torch.functions import allreduce

        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        count = torch.full((1,), input.numel() // channels, dtype=input.dtype, device=input.device)
        stats = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = allreduce(stats, op=Sum, name="SyncBatchNorm.stats")
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean * mean
        if self.track_running_stats:
            assert self.num_batches_tracked is not None  # kept when tracking running stats
            assert self.running_mean is not None and self.running_var is not None
            with torch.no_grad():
                self.num_batches_tracked += 1
                factor = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * n / torch.clamp(n - 1, min=1)
                self.running_mean.mul_(1 - factor).add_(factor * mean)
                self.running_var.mul_(1 - factor).add_(factor * unbiased)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
