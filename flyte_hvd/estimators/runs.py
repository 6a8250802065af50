"""A fit's run in the store, on the driver, before any rank starts: the run's id, the lease
that keeps two fits out of one run, and the check of what a resumed run starts from.

A default ``run_id`` is the time to the second and a random suffix
(``keras_20261125_120650_3f9a1c0e``): sortable and readable, and unique across threads,
processes and hosts sharing a Store, so a fit never resumes a run it did not start unless it
was given that ``run_id``. While a fit runs, ``runs/<run_id>/lease.json`` names it (host,
process, when it expires); the driver renews it every ``LEASE_SECONDS / 3`` and removes it at
the end. A second fit of the run is refused while the lease lives; a lease whose owner died
(expired, or its process is gone from this host) is taken over (``flyte_hvd.data.lease``, which
``prepare_data``'s writes use too). Every Store call here is ``bounded`` by the Store's
timeout, as the ranks' are: a store that stops answering fails the fit, naming the call,
instead of hanging it.

Inside a Flyte execution the default ``run_id`` is the task's instead
(``flyte_hvd.launch.task_identity``): its suffix derives from the execution, the node and the
fit's place in the task (``keras_20261125_120650_<key>``), and a run of the Store that ends with
that key is the one the fit trains, so a Flyte retry (a new attempt of the node) resumes the
run of the attempt before it. Its lease, held by that earlier attempt, is taken over at once:
Flyte starts an attempt only once the one before it has ended.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from flyte_hvd.core.log import get_logger
from flyte_hvd.data.lease import LEASE_SECONDS, StoreLease
from flyte_hvd.data.store import bounded
from flyte_hvd.estimators.training import (
    archive_problem,
    checkpoint_path,
    read_run_state,
    run_file,
)
from flyte_hvd.launch import task_identity

if TYPE_CHECKING:
    from flyte_hvd.data.store import RemoteStore, Store

logger = get_logger(__name__)

LEASE_FILENAME = "lease.json"


def new_run_id(framework: str, suffix: str | None = None) -> str:
    """``<framework>_<YYYYmmdd_HHMMSS>_<suffix or 8 random hex digits>``."""
    return f"{framework}_{time.strftime('%Y%m%d_%H%M%S')}_{suffix or secrets.token_hex(4)}"


def run_ids(store: Store) -> list[str]:
    """The ids of the runs in ``store`` (its ``runs/`` folder), sorted."""
    runs = store.get_runs_path()
    if not bounded(store, ("looking for", "in"), runs, 0, store.exists, runs):
        return []
    found = bounded(
        store, ("listing", "in"), runs, 0, lambda: store.fs.ls(store.fs_path(runs), detail=False)
    )
    return sorted(os.path.basename(str(p).rstrip("/")) for p in found)


def task_run_id(store: Store, make: Callable[[str], str]) -> str | None:
    """Inside a Flyte execution, the run of this task's next fit: the run in ``store`` whose
    id ends with the fit's key (made by an earlier attempt of the task), else ``make(key)``.
    None outside a Flyte execution."""
    key = task_identity.next_fit_key()
    if key is None:
        return None
    for run_id in run_ids(store):
        if run_id.endswith(key):
            logger.info("run `%s`: this task's run in an earlier attempt; it resumes", run_id)
            return run_id
    return make(key)


# -- the lease -------------------------------------------------------------------------------


class RunLease(StoreLease):
    """The lease of one run (``runs/<run_id>/lease.json``), held by this process from
    ``acquire`` to ``release``."""

    def __init__(self, store: Store, run_id: str):
        path = store.join(store.get_run_path(run_id), LEASE_FILENAME)
        super().__init__(store, path, f"run `{run_id}`")
        self.run_id = run_id

    def acquire(self) -> None:
        """``try_acquire``, or a ValueError that names the run, its owner and what to do."""
        if self.try_acquire():
            return
        held = self.read() or {}
        renewed = time.time() - float(held.get("renewed", time.time()))
        raise ValueError(
            f"run `{self.run_id}` is in use by another fit: its lease `{self.path}` is held by "
            f"{held.get('owner', 'an unknown owner')} (renewed {renewed:.0f}s ago). Wait for "
            f"that fit to end, or give another `run_id`. A lease whose fit died is taken over "
            f"once its process is gone from this host or {LEASE_SECONDS:g}s after its last "
            f"renewal."
        )


@contextlib.contextmanager
def leased_run(store: Store, run_id: str | None, framework: str) -> Iterator[str]:
    """The run a fit trains, leased for the block: ``run_id`` when given (refused while
    another fit holds it), else in a Flyte execution this task's (``task_run_id``), else a
    new id whose folder does not exist yet."""
    if run_id is not None:
        store.to_remote(run_id)  # checks the name
        lease = RunLease(store, run_id)
        lease.acquire()
    elif (own := task_run_id(store, lambda key: new_run_id(framework, key))) is not None:
        lease = RunLease(store, own)  # this Flyte task's run, in every attempt
        lease.acquire()
    else:
        while True:
            candidate = new_run_id(framework)
            folder = store.get_run_path(candidate)
            if bounded(store, ("looking for", "in"), folder, 0, store.exists, folder):
                continue
            lease = RunLease(store, candidate)
            if lease.try_acquire():
                break
    try:
        yield lease.run_id
    finally:
        lease.release()


# -- what a resumed run starts from ----------------------------------------------------------


def _file_problem(store: RemoteStore, path: str) -> str | None:
    """What is wrong with a model file of the run, as a phrase (None: nothing); read within
    the Store's timeout (plus its share per MiB)."""
    st, target = store.store, store.fs_path(path)
    try:
        size = bounded(st, ("looking for", "in"), path, 0, lambda: st.fs.size(target))
        problem = bounded(st, ("reading", "from"), path, size or 0, _archive_problem, st, target)
    except FileNotFoundError:
        return "is missing"
    except OSError as error:
        return f"cannot be read ({type(error).__name__}: {error})"
    return None if problem is None else f"is damaged: {problem}"


def _archive_problem(store: Store, target: str) -> str | None:
    with store.fs.open(target, "rb") as f:
        return archive_problem(f)


def check_resumable(
    store: RemoteStore, epochs: int, extension: str, epoch_in_model: bool = False
) -> bool:
    """Before any rank starts: the run's ``state.json`` is valid and the model it resumes
    from is intact. A damaged or missing last model is replaced by the run's checkpoint when
    that is intact (one warning); otherwise, and for a damaged best model, the error names
    the file, what is wrong and what to do. True when the run has trained ``epochs`` already:
    the fit then returns its model without training (one warning), so a retried task whose fit
    had finished gets the same model.

    ``epoch_in_model``: the framework resumes at the epoch its model file records
    (Lightning), so a checkpoint that holds the best of earlier epochs cannot stand in for
    the last model."""
    state = read_run_state(store)
    if state is None:
        return False
    run_id, done = store.run_id, state["epoch"]
    if done >= epochs:
        checkpoint = checkpoint_path(store, extension)
        problem = _file_problem(store, checkpoint)
        if problem is not None:
            raise ValueError(
                f"run `{run_id}` trained {done} epoch(s) (`epochs`={epochs}), but its model "
                f"`{checkpoint}` {problem}. Restore it, or give a new `run_id` to train anew."
            )
        logger.warning(
            "run `%s` already trained %d epoch(s) and `epochs`=%d: its model is returned "
            "without training. To train it further, fit again with `epochs` > %d and the same "
            "`run_id`; to train anew, give a new `run_id`.",
            run_id,
            done,
            epochs,
            done,
        )
        return True
    todo = (
        f"Restore it, or delete the run's folder `{store.run_path}` to train it from the "
        f"start, or give a new `run_id`."
    )
    last, checkpoint = run_file(store, f"last{extension}"), checkpoint_path(store, extension)
    saved = _file_problem(store, checkpoint) if checkpoint != last else "is the last model"
    problem = _file_problem(store, last)
    if problem is not None and saved is None and epoch_in_model and "best" in state:
        saved = "holds the best model of an earlier epoch, where the framework would resume"
    if problem is not None:
        if saved is not None:
            raise ValueError(
                f"run `{run_id}` cannot resume: its state.json says {done} epoch(s) are done, "
                f"but its last model `{last}` {problem}, and its checkpoint `{checkpoint}` "
                f"{saved}. {todo.replace('it,', 'either file,', 1)}"
            )
        logger.warning(
            "run `%s`: its last model `%s` %s; resuming from its checkpoint `%s`",
            run_id,
            last,
            problem,
            checkpoint,
        )
        with tempfile.TemporaryDirectory(prefix="flyte-hvd-resume-") as folder:
            local = os.path.join(folder, "model")
            store.download_file(checkpoint, local)
            store.upload_file(local, last)
    elif state.get("best") is not None and saved is not None:
        raise ValueError(
            f"run `{run_id}` cannot resume: its checkpoint `{checkpoint}`, the best model of "
            f"its earlier epochs, {saved}. {todo}"
        )
    return False
