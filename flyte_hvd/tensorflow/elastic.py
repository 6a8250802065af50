"""Horovod's elastic training (``hvd.elastic``) is not supported.

Ranks run as one Spark barrier stage (or one ``mpiexec`` job), which is all-or-nothing: ranks
cannot join or leave a running stage, so there is nothing to re-form the communicator from.
A failed stage is retried whole and resumes from the last checkpoint instead.
"""

from __future__ import annotations

from typing import NoReturn

REASON = (
    "flyte_hvd does not support Horovod's elastic training (`hvd.elastic`): ranks run as one "
    "Spark barrier stage, which is all-or-nothing, so ranks cannot be added or removed while "
    "it runs. Train with a fixed number of ranks and checkpoint; a failed stage is retried "
    "whole and resumes from the last checkpoint (KerasEstimator does this with its run_id)."
)


def __getattr__(name: str) -> NoReturn:
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(f"`hvd.elastic.{name}`: {REASON}")
