"""Which Flyte task this process runs, if any: its execution, its node and its attempt.

A Flyte retry is a new attempt of the same node of the same execution, in a new pod; what it
shares with the attempt before it is the execution and the node. flytekit's entrypoint
(``pyflyte-execute``) names the execution in ``FLYTE_INTERNAL_EXECUTION_*`` (or ``_F_*``) and the
attempt in ``FLYTE_ATTEMPT_NUMBER``; no variable names the node, but the output prefix it gets
does: ``<metadata>/<execution>/<node path>/data/<attempt>``. Flyte 2 names the run and the action
(``flyte.ctx().action``), which is the same for each attempt of the action.

Outside a Flyte execution (a script, a notebook, ``pyflyte run`` on a laptop) ``current()`` is
None and nothing here changes what the library does.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import threading
from dataclasses import dataclass

_ATTEMPT_ENV = "FLYTE_ATTEMPT_NUMBER"
_TRAILING_ATTEMPT = re.compile(r"/(\d+)/?$")


@dataclass(frozen=True)
class TaskIdentity:
    """The Flyte task attempt this process runs."""

    sdk: str  # "flytekit" or "flyte2"
    execution: str  # project/domain/name of the execution (a Flyte 2 run)
    node: str  # the node (a Flyte 2 action) in the execution, the same for every attempt
    attempt: int

    @property
    def node_key(self) -> str:
        """8 hex digits for the execution and node: the same for every attempt."""
        return hashlib.sha256(f"{self.execution}\n{self.node}".encode()).hexdigest()[:8]

    def fit_key(self, index: int) -> str:
        """8 hex digits for the ``index``-th fit (from 1) of this task: the same in every
        attempt, different for each fit, node and execution."""
        text = f"{self.execution}\n{self.node}\n{index}"
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def as_record(self) -> dict[str, object]:
        return {"execution": self.execution, "node": self.node, "attempt": self.attempt}


def _attempt() -> int:
    try:
        return max(0, int(os.environ.get(_ATTEMPT_ENV, "0")))
    except ValueError:
        return 0


def _env(*names: str) -> str:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return ""


def _flytekit() -> TaskIdentity | None:
    name = _env("FLYTE_INTERNAL_EXECUTION_ID", "_F_NM")
    if not name or "flytekit" not in sys.modules:
        return None
    from flytekit import FlyteContextManager

    params = FlyteContextManager.current_context().user_space_params
    prefix = getattr(params, "output_metadata_prefix", None) if params else None
    if not prefix:
        return None
    attempt = _attempt()
    node = str(prefix).rstrip("/")
    found = _TRAILING_ATTEMPT.search(node)
    if found is not None:  # .../<node>/data/<attempt>
        node = node[: found.start()]
        attempt = int(found.group(1)) if _ATTEMPT_ENV not in os.environ else attempt
    project = _env("FLYTE_INTERNAL_EXECUTION_PROJECT", "_F_PRJ")
    domain = _env("FLYTE_INTERNAL_EXECUTION_DOMAIN", "_F_DM")
    return TaskIdentity("flytekit", f"{project}/{domain}/{name}", node, attempt)


def _flyte2() -> TaskIdentity | None:
    if "flyte" not in sys.modules:
        return None
    import flyte

    ctx = flyte.ctx()  # outside a task: a falsy context whose fields are None
    if not ctx or ctx.action is None or not ctx.is_in_cluster():
        return None  # a local run (flyte.run on a laptop) is not retried by Flyte
    action = ctx.action
    execution = f"{action.project or ''}/{action.domain or ''}/{action.run_name or action.name}"
    return TaskIdentity("flyte2", execution, action.name, _attempt())


def current() -> TaskIdentity | None:
    """The Flyte task attempt this process runs (None outside a Flyte execution)."""
    return _flytekit() or _flyte2()


def current_sdk() -> str | None:
    """``flytekit`` or ``flyte2`` inside a Flyte execution's task, else None."""
    identity = current()
    return identity.sdk if identity else None


_fits_lock = threading.Lock()
_fits: dict[tuple[str, str, int], int] = {}


def next_fit_key() -> str | None:
    """Inside a Flyte execution: the key of this task's next fit (its first, second...), the
    same in every attempt of the task; None outside one."""
    identity = current()
    if identity is None:
        return None
    slot = (identity.execution, identity.node, identity.attempt)
    with _fits_lock:
        _fits[slot] = index = _fits.get(slot, 0) + 1
    return identity.fit_key(index)
