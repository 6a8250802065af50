"""``DistributedOptimizer`` for PyTorch: gradients are averaged across ranks while
``backward()`` runs, and ``step()`` applies them once they are.

A hook on each parameter (``register_post_accumulate_grad_hook``) counts its gradient in. The
parameters are laid out, in reverse registration order (the order backward produces them), in
fusion buckets of one dtype and at most ``HOROVOD_FUSION_THRESHOLD`` bytes; a bucket whose
gradients are all in is handed to the background thread, which copies them into the bucket
(scaled by 1/size, so the average needs no extra pass), reduces the bucket with one MPI call
and leaves the result there. ``step()`` (or ``synchronize()``) waits, then points each
``param.grad`` at its slice of the bucket: the next backward accumulates straight into it when
``zero_grad(set_to_none=False)`` kept it, and the copy in is skipped.

Buckets are submitted strictly in order, so every rank issues the same reductions in the same
order whatever order its hooks fired in; gradients that never arrived (parameters unused in a
step) are reduced as zeros at ``synchronize()``, as Horovod does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mpi4py import MPI

from flyte_hvd.core import background, collectives, fusion, reduce_ops, state
from flyte_hvd.core.compression import Compression, Compressor
from flyte_hvd.core.process_sets import ProcessSet, async_comm_of, global_process_set
from flyte_hvd.core.reduce_ops import Average, ReduceOp


@dataclass(frozen=True)
class _Settings:
    compression: type[Compressor]
    backward_passes_per_step: int
    op: ReduceOp
    gradient_predivide_factor: float
    sparse_as_dense: bool
    process_set: ProcessSet


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    # numpy (and so MPI through mpi4py) has no bfloat16: such gradients travel as float32.
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_sparse or b.is_sparse:
        return False
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


class _Bucket:
    """Gradients of some parameters, packed (64-byte aligned) into one flat CPU buffer."""

    def __init__(self, index: int, params: list[torch.Tensor], names: list[str]):
        self.index = index
        self.params = params
        self.names = names
        dtype = _wire_dtype(params[0].dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        offsets, total = fusion.packed_offsets([p.numel() for p in params], itemsize)
        self.buffer = torch.zeros(total, dtype=dtype)
        self.array = self.buffer.numpy()
        self.views = [
            self.buffer[o : o + p.numel()].view(p.shape)
            for o, p in zip(offsets, params, strict=True)
        ]
        self.pending = len(params)
        self.handle: background.Handle | None = None

    def describe(self, op: ReduceOp) -> str:
        shown = ", ".join(self.names[:4]) + (", ..." if len(self.names) > 4 else "")
        return (
            f"allreduce(op={op.name}, dtype={self.buffer.dtype}, shape=({self.buffer.numel()},), "
            f"DistributedOptimizer bucket {self.index}: {len(self.names)} gradient(s) {shown})"
        )


class _Reducer:
    """The per-optimizer reduction state: buckets, hook counters and in-flight handles."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], settings: _Settings):
        self.settings = settings
        ps = settings.process_set
        self.size = ps.size() if ps.included() else 1
        self.names = {p: n for n, p in named}
        self.buckets = _layout(named, fusion.fusion_threshold())
        self.where = {p: b for b in self.buckets for p in b.params}
        self.delay = dict.fromkeys(self.where, settings.backward_passes_per_step)
        self.next_submit = 0
        self.fired = False  # a gradient arrived since the last synchronize
        self.synchronized = False  # synchronize() ran since the last step()
        self.should_synchronize = True
        # Ranks outside the process set (and lone ranks) step on their own gradients. With no
        # peer to reduce with there are no hooks either, as in Horovod: each one is a call
        # from autograd into Python per parameter per step (5% of a small MLP's step), and
        # the misuse they catch only matters where gradients are reduced.
        self.comm = async_comm_of(ps) if self.size > 1 else None
        self.hooks = (
            [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
            if self.comm is not None
            else []
        )

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    # -- during backward ---------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        left = self.delay[p] - 1
        if left < 0:
            n = self.settings.backward_passes_per_step
            raise RuntimeError(
                f"the gradient of `{self.names[p]}` was computed more than "
                f"backward_passes_per_step={n} time(s) before step(): call optimizer.step() (or "
                f"synchronize()) after every {n} backward pass(es), or raise "
                f"`backward_passes_per_step` to accumulate more passes locally."
            )
        if p.grad is not None and p.grad.requires_grad:
            raise RuntimeError(
                "DistributedOptimizer cannot reduce gradients that require grad "
                "(backward(create_graph=True)); compute higher-order gradients without it."
            )
        self.delay[p] = left
        self.fired = True
        if left == 0 and self.comm is not None:
            bucket = self.where[p]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._submit_ready()

    def _submit_ready(self) -> None:
        while self.next_submit < len(self.buckets) and self.buckets[self.next_submit].pending == 0:
            self._submit(self.buckets[self.next_submit])
            self.next_submit += 1

    def _submit(self, bucket: _Bucket) -> None:
        assert self.comm is not None  # only an optimizer over several ranks submits
        settings = self.settings
        floating = bucket.buffer.is_floating_point() or bucket.buffer.is_complex()
        op, pre, post = reduce_ops.average_as_sum(
            settings.op, settings.gradient_predivide_factor, self.size, floating
        )
        grads = [p.grad for p in bucket.params]

        def run(comm: MPI.Comm) -> None:
            with torch.no_grad():
                for grad, view in zip(grads, bucket.views, strict=True):
                    if grad is None or (grad.is_sparse and not settings.sparse_as_dense):
                        view.zero_()  # sparse ones travel on their own, at synchronize()
                        continue
                    if grad.is_sparse:
                        grad = grad.to_dense()
                    if _same_memory(grad, view):
                        if pre != 1.0:
                            view.mul_(pre)
                    elif pre != 1.0:
                        torch.mul(grad.to(view.device), pre, out=view)
                    else:
                        view.copy_(grad)
            collectives.reduce_in_place(
                comm,
                bucket.array,
                op,
                settings.compression,
                post,
                f"DistributedOptimizer.bucket{bucket.index}",
                lambda: bucket.describe(op),
            )

        bucket.handle = background.submit(run, self.comm)

    # -- at step -------------------------------------------------------------------------------

    def synchronize(self) -> None:
        if self.comm is not None:
            while self.next_submit < len(self.buckets):
                self._submit(self.buckets[self.next_submit])
                self.next_submit += 1
            error: BaseException | None = None
            for bucket in self.buckets:
                try:
                    bucket.handle.wait()  # type: ignore[union-attr]  # every bucket submitted
                except BaseException as e:
                    error = error or e
                bucket.handle = None
            if error is not None:
                self._reset()
                raise error
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is not None and p.grad.is_sparse:
                        self._reduce_sparse(p, view)
                    else:
                        _adopt(p, view)
        self._reset()
        self.synchronized = True

    def _reduce_sparse(self, p: torch.Tensor, view: torch.Tensor) -> None:
        """A sparse gradient stays sparse: with ``sparse_as_dense`` its bucket slice (reduced
        dense) is made sparse again; otherwise every rank's indices and values are gathered."""
        if self.settings.sparse_as_dense:
            p.grad = view.to(device=p.device, dtype=p.dtype).to_sparse()
            return
        from flyte_hvd.torch.async_collectives import sparse_allreduce_async

        op = self.settings.op
        grad = p.grad
        assert grad is not None  # only parameters with a gradient are reduced
        p.grad = sparse_allreduce_async(grad, None, op, self.settings.process_set)().coalesce()

    def _reset(self) -> None:
        n = self.settings.backward_passes_per_step
        for p in self.delay:
            self.delay[p] = n
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self.next_submit = 0
        self.fired = False


def _adopt(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``p.grad`` the reduced gradient: the bucket's slice itself when it can be."""
    grad = p.grad
    if grad is not None and _same_memory(grad, view):
        return
    if p.device.type == "cpu" and p.dtype == view.dtype:
        p.grad = view
    elif grad is None or grad.is_sparse:
        p.grad = view.to(device=p.device, dtype=p.dtype)
    else:
        grad.copy_(view)


def _layout(named: list[tuple[str, torch.Tensor]], threshold: int) -> list[_Bucket]:
    """Buckets in the order backward fills them (reverse registration), one wire dtype each,
    at most ``threshold`` bytes (a larger gradient gets a bucket of its own)."""
    ordered = list(reversed(named))
    items = []
    for _, p in ordered:
        dtype = _wire_dtype(p.dtype)
        items.append((dtype, p.numel() * torch.empty((), dtype=dtype).element_size()))
    return [
        _Bucket(i, [ordered[k][1] for k in members], [ordered[k][0] for k in members])
        for i, members in enumerate(fusion.fusion_buckets(items, threshold))
    ]


class DistributedMixin:
    """Mixed in front of the wrapped optimizer's own class (see ``DistributedOptimizer``)."""

    _hvd: _Reducer

    def synchronize(self) -> None:
        """Wait until every gradient is reduced (reducing those whose hooks did not fire, as
        zeros) and leave the results in ``param.grad``. Then clip or inspect the gradients,
        and call ``step()`` inside ``skip_synchronize()``."""
        self._hvd.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block applies the gradients without synchronizing (use it
        after calling ``synchronize()`` yourself)."""
        self._hvd.should_synchronize = False
        try:
            yield
        finally:
            self._hvd.should_synchronize = True

    def step(self, closure=None):
        reducer = self._hvd
        loss = None
        if closure is not None:
            # The closure computes the gradients, so it runs before they are reduced (the
            # wrapped optimizer would call it after).
            with torch.enable_grad():
                loss = closure()
        if reducer.should_synchronize:
            if reducer.synchronized and not reducer.fired:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(); the gradients were already reduced and are used "
                    "as they are. Write `with optimizer.skip_synchronize(): optimizer.step()` "
                    "after synchronize().",
                    stacklevel=2,
                )
            else:
                reducer.synchronize()
        elif reducer.fired:
            raise RuntimeError(
                "optimizer.step() inside optimizer.skip_synchronize() after backward() without "
                "optimizer.synchronize(): the gradients are still being reduced. Call "
                "optimizer.synchronize() before the step."
            )
        reducer.synchronized = False
        super().step()  # type: ignore[misc]  # the torch optimizer this class is mixed into
        return loss

    # Optimizer._patch_step_function must not wrap this step in the profiling hooks: the
    # wrapped class's own step (called above) runs them.
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd.fired:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients being reduced "
                "would be lost. Call zero_grad() before backward(), or step() first."
            )
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]  # mixed into an Optimizer

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError(
            "add_param_group() on a DistributedOptimizer: its gradient hooks and buckets cover "
            "the parameters it was wrapped with. Add the group to the optimizer first, then wrap "
            "it with hvd.DistributedOptimizer."
        )


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.nn.Parameter]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Make ``optimizer`` average gradients across ranks (collective: call on every rank).

    The optimizer is wrapped in place and returned: its state, its param groups and any LR
    scheduler built on it are kept, and it is still an instance of its own class.

    Args:
        named_parameters: ``model.named_parameters()``; names appear in errors and timelines.
        compression: ``hvd.Compression.fp16`` sends float gradients as float16.
        backward_passes_per_step: backward passes accumulated locally before a reduction;
            ``step()`` must follow every that many passes.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``Average``, divide by this before the sum and by
            ``size / factor`` after.
        num_groups: accepted for Horovod compatibility; grouping follows the fusion
            threshold (``HOROVOD_FUSION_THRESHOLD``).
        groups: accepted for Horovod compatibility, as ``num_groups``.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            tensors, made sparse again for the step; by default their indices and values
            are gathered from every rank (cheaper when few rows are touched).
        process_set: reduce among these ranks only; ranks outside it step on their own
            gradients.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer (e.g. torch.optim.SGD("
            f"model.parameters(), lr=0.01)); found {type(optimizer).__module__}."
            f"{type(optimizer).__name__}."
        )
    collectives.check_optimizer_args(backward_passes_per_step, op, gradient_predivide_factor)
    state.comm()  # fail now with the init() message
    if isinstance(optimizer, DistributedMixin):
        unwrap(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    named = _names(params, named_parameters)
    if process_set.included():
        _check_same_parameters(named, process_set)
    settings = _Settings(
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=ReduceOp(op),
        gradient_predivide_factor=float(gradient_predivide_factor),
        sparse_as_dense=bool(sparse_as_dense),
        process_set=process_set,
    )
    reducer = _Reducer(named, settings)
    base = type(optimizer)
    # Same name and module as the base, so it reads (and reprs) as the optimizer it wraps.
    optimizer.__class__ = type(
        base.__name__, (DistributedMixin, base), {"__module__": base.__module__}
    )
    # The optimizer's class is now the distributed one, which carries these.
    optimizer._hvd = reducer  # type: ignore[attr-defined]
    # Horovod's attribute: {parameter: name}; some scripts read it.
    optimizer._parameter_names = {p: n for n, p in named}  # type: ignore[attr-defined]
    _rewrap_scheduler_step(optimizer)
    return optimizer


def unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Undo ``DistributedOptimizer`` in place (hooks removed); returns the optimizer."""
    if isinstance(optimizer, DistributedMixin):
        optimizer._hvd.remove_hooks()
        del optimizer._hvd
        optimizer.__dict__.pop("_parameter_names", None)
        optimizer.__class__ = type(optimizer).__mro__[2]
        _rewrap_scheduler_step(optimizer)
    return optimizer


def _rewrap_scheduler_step(optimizer: torch.optim.Optimizer) -> None:
    """An LR scheduler built on the optimizer replaced its bound ``step`` with a wrapper that
    calls the class's step it saw then; rebind it to the class's step now."""
    wrapper = optimizer.__dict__.get("step")
    if wrapper is None or not getattr(wrapper, "_wrapped_by_lr_sched", False):
        return
    cls_step = type(optimizer).step

    # The wrapped optimizer's own ``step`` arguments and result (a closure, the loss).
    def step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what the scheduler checks
        return cls_step(optimizer, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


def _names(
    params: list[torch.Tensor], named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> list[tuple[str, torch.Tensor]]:
    if named_parameters is None:
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError(
            "`named_parameters` must be (name, parameter) pairs, as model.named_parameters() "
            "yields."
        )
    counts: dict[str, int] = {}
    for name, _ in named:
        counts[name] = counts.get(name, 0) + 1
    duplicates = sorted(n for n, c in counts.items() if c > 1)
    if duplicates:
        raise ValueError(f"`named_parameters` names must be unique; found duplicates {duplicates}.")
    by_param = {p: n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in by_param]
    if unnamed:
        raise ValueError(
            f"`named_parameters` does not name {len(unnamed)} of the optimizer's parameters "
            f"(positions {unnamed[:8]}); pass the named_parameters() of the model the optimizer "
            f"was built on."
        )
    return [(by_param[p], p) for p in params]


def _check_same_parameters(named: list[tuple[str, torch.Tensor]], process_set: ProcessSet) -> None:
    """Every rank must reduce the same gradients, or the buckets would not match."""
    if process_set.size() == 1:
        return
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    everyone = collectives.allgather_object(mine, process_set=process_set)
    root = everyone[0]
    for rank, theirs in enumerate(everyone):
        if [d[1:] for d in theirs] == [d[1:] for d in root]:
            continue
        if len(theirs) != len(root):
            detail = f"rank 0 has {len(root)} parameters, rank {rank} has {len(theirs)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(root, theirs, strict=True)) if a[1:] != b[1:])
            detail = (
                f"parameter {i}: rank 0 has `{root[i][0]}` {root[i][1]} {root[i][2]}, rank "
                f"{rank} has `{theirs[i][0]}` {theirs[i][1]} {theirs[i][2]}"
            )
        raise ValueError(
            f"ranks wrapped different optimizers, so their gradients cannot be reduced together: "
            f"{detail}. Every rank must build the same model and optimizer."
        )
