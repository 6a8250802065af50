"""flyte_hvd.torch cases run on real rank processes (2 ranks); each asserts on every rank."""

from __future__ import annotations

import os
import traceback
import warnings

import numpy as np

CASES: dict[str, object] = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def run_cases(names: list[str] | None = None) -> dict[str, str | None]:
    import torch

    import flyte_hvd.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    results: dict[str, str | None] = {}
    for name, fn in CASES.items():
        if names is None or name in names:
            try:
                fn()
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
    return results


def _mlp(seed: int, width: int = 8):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


def _data(rows: int, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3


def _mse(model, x, y):
    import torch

    return torch.nn.functional.mse_loss(model(x), y)


def _params(model) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def _assert_close(a: list[np.ndarray], b: list[np.ndarray], rtol=1e-5, atol=1e-6) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _my_rows(rows: int):
    import flyte_hvd.torch as hvd

    per = rows // hvd.size()
    return slice(hvd.rank() * per, (hvd.rank() + 1) * per)


@case
def sgd_on_half_batches_matches_one_process_on_the_whole_batch():
    import torch

    import flyte_hvd.torch as hvd

    x, y = _data(16)
    reference = _mlp(0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model = _mlp(hvd.rank() * 10)  # different start on each rank: the broadcast fixes it
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(reference.state_dict(), root_rank=0)
    _assert_close(_params(model), _params(reference), 0, 0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    mine = _my_rows(16)
    for _ in range(4):
        ref_opt.zero_grad()
        _mse(reference, x, y).backward()
        ref_opt.step()
        opt.zero_grad()
        _mse(model, x[mine], y[mine]).backward()
        opt.step()
    _assert_close(_params(model), _params(reference))
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"


@case
def backward_passes_per_step_accumulates_locally():
    import torch

    import flyte_hvd.torch as hvd

    x, y = _data(16)
    reference = _mlp(1)
    # Two local passes on quarter batches, summed, then averaged over 2 ranks: twice the
    # whole-batch gradient.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    model = _mlp(1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2
    )
    quarter = 16 // (2 * hvd.size())
    for _ in range(3):
        ref_opt.zero_grad()
        _mse(reference, x, y).backward()
        ref_opt.step()
        opt.zero_grad()
        for k in range(2):
            start = (hvd.rank() * 2 + k) * quarter
            _mse(model, x[start : start + quarter], y[start : start + quarter]).backward()
        opt.step()
    _assert_close(_params(model), _params(reference))
    # A third pass before step() is an error that says what to do.
    opt.zero_grad()
    for _ in range(2):
        _mse(model, x, y).backward()
    try:
        _mse(model, x, y).backward()
    except RuntimeError as error:
        assert "backward_passes_per_step=2" in str(error), error
    else:
        raise AssertionError("a third backward pass before step() did not raise")
    opt.synchronize()
    opt.zero_grad()


@case
def synchronize_then_clip_then_step_inside_skip_synchronize():
    import torch

    import flyte_hvd.torch as hvd

    x, y = _data(8, seed=hvd.rank() + 5)  # different data per rank
    model = _mlp(2)
    plain = _mlp(2)
    _mse(plain, x, y).backward()
    expected = [hvd.allreduce(p.grad) for p in plain.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    _mse(model, x, y).backward()
    opt.synchronize()
    for p, e in zip(model.parameters(), expected, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), e.numpy(), rtol=1e-5, atol=1e-7)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.clone() for p in model.parameters()]
    before = _params(model)
    with opt.skip_synchronize():
        opt.step()
    for b, p, g in zip(before, model.parameters(), clipped, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), b - 0.5 * g.numpy(), rtol=1e-5, atol=1e-7)
    # step() right after synchronize() without skip_synchronize() warns and reduces nothing.
    opt.zero_grad()
    _mse(model, x, y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught
    # skip_synchronize() without synchronize() after backward() is refused.
    opt.zero_grad()
    _mse(model, x, y).backward()
    try:
        with opt.skip_synchronize():
            opt.step()
    except RuntimeError as error:
        assert "Call optimizer.synchronize() before the step" in str(error), error
    else:
        raise AssertionError("step() in skip_synchronize() without synchronize() did not raise")
    opt.step()


@case
def small_fusion_threshold_makes_several_buckets():
    import torch

    import flyte_hvd.torch as hvd

    x, y = _data(16)
    results = {}
    for threshold in ("0", "200", None):
        if threshold is None:
            os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        else:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = threshold
        try:
            model = _mlp(3, width=16)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        finally:
            os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        mine = _my_rows(16)
        for _ in range(2):
            opt.zero_grad()
            _mse(model, x[mine], y[mine]).backward()
            opt.step()
        results[threshold] = (len(opt._hvd.buckets), _params(model))
    assert results["0"][0] == 4, results["0"][0]  # one bucket per parameter
    assert 1 < results["200"][0] < 4, results["200"][0]
    assert results[None][0] == 1
    _assert_close(results["0"][1], results[None][1])
    _assert_close(results["200"][1], results[None][1])


@case
def sum_predivide_and_fp16_compression():
    import torch

    import flyte_hvd.torch as hvd

    x, y = _data(8, seed=hvd.rank() + 7)
    plain = _mlp(4)
    _mse(plain, x, y).backward()
    summed = [hvd.allreduce(p.grad, op=hvd.Sum) for p in plain.parameters()]
    for kwargs, factor, rtol in (
        ({"op": hvd.Sum}, 1.0, 1e-5),
        ({"gradient_predivide_factor": 2.0}, 0.5, 1e-5),
        ({"compression": hvd.Compression.fp16}, 0.5, 2e-3),
    ):
        model = _mlp(4)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        _mse(model, x, y).backward()
        opt.synchronize()
        for p, s in zip(model.parameters(), summed, strict=True):
            np.testing.assert_allclose(p.grad.numpy(), s.numpy() * factor, rtol=rtol, atol=1e-3)
        with opt.skip_synchronize():
            opt.step()


@case
def unused_parameters_are_reduced_as_zeros_without_hanging():
    import torch

    import flyte_hvd.torch as hvd

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.a = torch.nn.Linear(3, 1)
            self.b = torch.nn.Linear(3, 1)

        def forward(self, x, head):
            return self.a(x) if head == "a" else self.b(x)

    model = TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(4)
    # Rank 0 uses head a, rank 1 head b: each bucket is still reduced once on every rank.
    head = "a" if hvd.rank() == 0 else "b"
    torch.nn.functional.mse_loss(model(x, head), y).backward()
    opt.step()
    grads = hvd.allgather_object([p.grad.numpy().copy() for p in model.parameters()])
    _assert_close(grads[0], grads[1], 0, 0)


@case
def zero_grad_between_backward_and_step_is_refused():
    import torch

    import flyte_hvd.torch as hvd

    model = _mlp(6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(4)
    _mse(model, x, y).backward()
    try:
        opt.zero_grad()
    except RuntimeError as error:
        assert "before optimizer.step()" in str(error), error
    else:
        raise AssertionError("zero_grad() after backward() did not raise")
    opt.step()


@case
def lr_scheduler_made_before_wrapping_keeps_working():
    import torch

    import flyte_hvd.torch as hvd

    model = _mlp(7)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = hvd.DistributedOptimizer(base)
    x, y = _data(8, seed=hvd.rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            _mse(model, x, y).backward()
            opt.step()
            scheduler.step()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], caught
    assert opt.param_groups[0]["lr"] == 0.025
    # The step went through the distributed optimizer: every rank has the same weights.
    everyone = hvd.allgather_object(_params(model))
    _assert_close(everyone[0], everyone[1], 0, 0)


@case
def broadcast_optimizer_state_and_object():
    import torch

    import flyte_hvd.torch as hvd

    model = _mlp(8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    x, y = _data(4, seed=hvd.rank())
    _mse(model, x, y).backward()
    opt.step()
    hvd.broadcast_parameters(model.named_parameters(), root_rank=1)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    assert opt.param_groups[0]["lr"] == 0.02
    states = hvd.allgather_object(
        [v["exp_avg"].numpy().copy() for v in opt.state_dict()["state"].values()]
    )
    _assert_close(states[0], states[1], 0, 0)
    assert hvd.broadcast_object({"r": hvd.rank()}, root_rank=1) == {"r": 1}


@case
def broadcast_parameters_writes_only_the_receivers():
    import torch

    import flyte_hvd.torch as hvd

    # float32, int64 and bfloat16 (which travels as float32): one buffer per dtype, sent from
    # the root's own copy and received into the other ranks' tensors; the root's are not
    # written (its version counters stay), every other rank's hold the root's values.
    root = hvd.size() - 1
    rank = float(hvd.rank())
    state = {
        "w": torch.full((3, 4), rank),
        "steps": torch.full((2,), int(rank), dtype=torch.int64),
        "scale": torch.full((5,), rank + 0.5, dtype=torch.bfloat16),
        "bias": torch.arange(4.0) + rank,
    }
    versions = {name: t._version for name, t in state.items()}
    hvd.broadcast_parameters(state, root_rank=root)
    expected = {
        "w": torch.full((3, 4), float(root)),
        "steps": torch.full((2,), root, dtype=torch.int64),
        "scale": torch.full((5,), root + 0.5, dtype=torch.bfloat16),
        "bias": torch.arange(4.0) + root,
    }
    for name, t in state.items():
        assert torch.equal(t, expected[name]), (name, t, expected[name])
        written = t._version != versions[name]
        assert written == (hvd.rank() != root), (name, hvd.rank(), written)


@case
def tensor_collectives():
    import torch

    import flyte_hvd.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    t = torch.full((3,), float(rank + 1))
    assert hvd.allreduce(t).tolist() == [1.5] * 3
    assert hvd.allreduce(t, op=hvd.Sum).tolist() == [3.0] * 3
    assert hvd.allreduce(torch.tensor([rank + 1]), average=False).tolist() == [3]
    hvd.allreduce_(t, op=hvd.Max)
    assert t.tolist() == [2.0] * 3
    g = hvd.allgather(torch.full((rank + 1, 2), rank, dtype=torch.int32))
    assert g.dtype == torch.int32 and g.tolist() == [[0, 0], [1, 1], [1, 1]]
    b = torch.arange(4.0) * (rank + 1)
    assert hvd.broadcast(b, root_rank=1).tolist() == [0.0, 2.0, 4.0, 6.0]
    hvd.broadcast_(b, root_rank=0)
    assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
    rows = hvd.alltoall(torch.arange(4) + 10 * rank)
    assert rows.tolist() == ([0, 1, 10, 11] if rank == 0 else [2, 3, 12, 13])
    rows, splits = hvd.alltoall(torch.arange(3) + 10 * rank, splits=torch.tensor([1, 2]))
    assert rows.tolist() == ([0, 10] if rank == 0 else [1, 2, 11, 12])
    assert splits.tolist() == ([1, 1] if rank == 0 else [2, 2])
    assert hvd.reducescatter(torch.ones(4, 2) * (rank + 1), op=hvd.Sum).tolist() == [[3.0] * 2] * 2
    grouped = hvd.grouped_allreduce([torch.ones(2) * rank, torch.ones(3, dtype=torch.float64)])
    assert grouped[0].tolist() == [0.5, 0.5] and grouped[1].dtype == torch.float64
    handle = hvd.allreduce_async_(torch.ones(5) * (rank + 1), op=hvd.Sum)
    assert hvd.synchronize(handle).tolist() == [3.0] * 5 and hvd.poll(handle)
    copy_handle = hvd.allreduce_async(torch.ones(2) * rank, name="async")
    assert hvd.synchronize(copy_handle).tolist() == [0.5, 0.5]
    assert size == 2


@case
def broadcast_in_place_writes_the_tensor_itself():
    import torch

    import flyte_hvd.torch as hvd

    rank = hvd.rank()
    # A contiguous CPU tensor is received into directly: same storage, autograd told.
    t = torch.arange(300_000.0) * (rank + 1)
    storage, version = t.data_ptr(), t._version
    assert hvd.broadcast_(t, root_rank=1) is t
    assert t.data_ptr() == storage and t._version > version
    assert torch.equal(t, torch.arange(300_000.0) * 2)
    # A tensor autograd saved for backward: changing it in place is caught, as with copy_.
    w = torch.ones(3, requires_grad=True)
    x = torch.full((3,), float(rank))
    y = (w * x).sum()
    hvd.broadcast_(x, root_rank=0)
    try:
        y.backward()
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error), error
    else:
        raise AssertionError("backward used a tensor broadcast_ had changed")
    # Strided, conjugated and bfloat16 tensors take the copying path, with the same result.
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    column = base[:, 1]
    assert hvd.broadcast_(column, root_rank=0) is column and column.tolist() == [1.0, 5.0, 9.0]
    assert base[:, 0].tolist() == [v * (rank + 1) for v in (0.0, 4.0, 8.0)]
    z = (torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)).conj()
    assert z.is_conj()
    hvd.broadcast_(z, root_rank=0)
    assert z.tolist() == [1 - 2j, 3 + 1j]
    h = torch.full((2,), float(rank), dtype=torch.bfloat16)
    try:
        hvd.broadcast_(h, root_rank=0)
    except ValueError as error:
        assert "cannot take a bfloat16 tensor" in str(error), error
    else:
        raise AssertionError("a bfloat16 broadcast_ did not raise")


@case
def ranks_with_different_models_get_a_clear_error():
    import torch

    import flyte_hvd.torch as hvd

    model = _mlp(9, width=4 + hvd.rank())
    try:
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
    except ValueError as error:
        assert "`0.weight` (4, 3)" in str(error) and "rank 1 has `0.weight` (5, 3)" in str(error)
    else:
        raise AssertionError("different models on the ranks did not raise")
    try:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    except ValueError as error:
        assert "ranks built different models" in str(error), error
    else:
        raise AssertionError("broadcast_parameters of different models did not raise")


@case
def zero_dim_tensors_stay_zero_dim():
    import torch

    import flyte_hvd.torch as hvd

    rank = hvd.rank()
    scalar = torch.tensor(float(rank + 1))
    out = hvd.allreduce(scalar, op=hvd.Sum)
    assert out.shape == () and out.item() == 3.0
    hvd.allreduce_(scalar, op=hvd.Max)
    assert scalar.shape == () and scalar.item() == 2.0
    step = torch.tensor(float(rank))
    hvd.broadcast_(step, root_rank=1)
    assert step.shape == () and step.item() == 1.0
    assert hvd.allgather(torch.tensor(rank)).tolist() == [0, 1]


@case
def mismatches_are_runtime_errors_on_every_rank():
    import torch

    import flyte_hvd.torch as hvd

    rank = hvd.rank()
    calls = (
        lambda: hvd.allreduce(torch.ones(3 + rank)),
        lambda: hvd.allgather(torch.ones(2, 1 + rank)),
        lambda: hvd.broadcast(torch.ones(2), root_rank=rank),
        lambda: hvd.reducescatter(torch.ones(4, dtype=torch.float32 if rank else torch.float64)),
    )
    for call in calls:
        try:
            call()
        except RuntimeError as error:
            assert isinstance(error, hvd.CollectiveMismatchError), error
        else:
            raise AssertionError("a mismatch did not raise")
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


@case
def alltoall_refuses_fractional_splits():
    import torch

    import flyte_hvd.torch as hvd

    for splits in (torch.tensor([1.0, 1.0]), [0.5, 1.5]):
        try:
            hvd.alltoall(torch.ones(2), splits=splits)
        except ValueError as error:
            assert "integers" in str(error), error
        else:
            raise AssertionError(f"splits={splits!r} accepted")


@case
def gradients_flow_through_collectives():
    import torch

    import flyte_hvd.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    x = torch.full((2, 3), float(rank), requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    assert x.grad.tolist() == [[float(size)] * 3] * 2
    x.grad = None
    hvd.allreduce(x).sum().backward()  # Average: the gradient is averaged too
    assert x.grad.tolist() == [[1.0] * 3] * 2

    # allgather: each rank gets the (rank-averaged) gradient of its own rows
    rows = torch.ones(rank + 1, 2, requires_grad=True)
    gathered = hvd.allgather(rows)
    weights = torch.arange(gathered.shape[0], dtype=torch.float32).unsqueeze(1)
    (gathered * weights).sum().backward()
    mine = list(range(rank, 2 * rank + 1)) if rank else [0]
    assert rows.grad[:, 0].tolist() == [float(i) for i in mine]

    # broadcast: only the root's input receives a gradient
    b = torch.ones(3, requires_grad=True)
    hvd.broadcast(b, root_rank=1).sum().backward()
    assert b.grad.tolist() == ([1.0] * 3 if rank == 1 else [0.0] * 3)

    # alltoall: the gradient goes back to the rows that were sent
    a = torch.arange(4.0, requires_grad=True)
    (hvd.alltoall(a) * 2).sum().backward()
    assert a.grad.tolist() == [2.0] * 4

    # reducescatter (Sum): Horovod's convention, the output gradient times the set size
    r = torch.ones(4, 2, requires_grad=True)
    hvd.reducescatter(r, op=hvd.Sum).sum().backward()
    assert r.grad.tolist() == [[float(size)] * 2] * 4

    grouped = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    sum(t.sum() for t in hvd.grouped_allreduce(grouped, op=hvd.Sum)).backward()
    assert [t.grad.tolist() for t in grouped] == [[2.0] * 2, [2.0] * 3]


@case
def async_collectives_and_duplicate_names():
    import torch

    import flyte_hvd.torch as hvd

    rank = hvd.rank()
    handles = [
        hvd.allgather_async(torch.full((1, 2), rank)),
        hvd.broadcast_async(torch.full((2,), float(rank)), root_rank=1),
        hvd.alltoall_async(torch.arange(2) + 10 * rank),
        hvd.reducescatter_async(torch.ones(4) * (rank + 1), op=hvd.Sum),
        hvd.grouped_allreduce_async([torch.ones(1) * rank, torch.ones(2)], op=hvd.Sum),
    ]
    hvd.barrier()  # the calling thread's collectives go on while those are in flight
    gathered, bcast, a2a, rs, grouped = [hvd.synchronize(h) for h in handles]
    assert gathered.tolist() == [[0, 0], [1, 1]] and bcast.tolist() == [1.0, 1.0]
    assert a2a.tolist() == ([0, 10] if rank == 0 else [1, 11]) and rs.tolist() == [3.0, 3.0]
    assert [g.tolist() for g in grouped] == [[1.0], [2.0, 2.0]]
    assert all(hvd.poll(h) for h in handles)
    inplace = torch.ones(3) * rank
    assert hvd.synchronize(hvd.broadcast_async_(inplace, root_rank=1)) is inplace
    assert inplace.tolist() == [1.0] * 3

    # A name still in flight on this rank is refused there and then.
    if rank == 0:
        first = hvd.allreduce_async(torch.ones(2), name="same")
        try:
            hvd.allreduce_async(torch.ones(2), name="same")
        except ValueError as error:
            assert "still in flight" in str(error)
        else:
            raise AssertionError("a duplicate name in flight was accepted")
        hvd.barrier()
    else:
        hvd.barrier()
        first = hvd.allreduce_async(torch.ones(2), name="same")
    assert hvd.synchronize(first).tolist() == [1.0, 1.0]
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="same"))  # reusable once done


@case
def joined_rank_serves_allreduces_until_all_join():
    import torch

    import flyte_hvd.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    model = _mlp(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for early in range(size):
        if rank == early:
            last = hvd.join()
        else:
            # Uneven data: this rank has more batches; the joined rank adds zeros.
            total = hvd.allreduce(torch.tensor([4.0, -3.0]), op=hvd.Sum)
            avg = hvd.synchronize(hvd.allreduce_async(torch.tensor([4, -3]), name="avg"))
            opt.zero_grad()
            _mse(model, *_data(4)).backward()
            opt.step()
            try:
                hvd.allgather(torch.ones(1))
            except RuntimeError as error:
                assert "inside hvd.join()" in str(error), error
            else:
                raise AssertionError("allgather with a joined rank did not raise")
            last = hvd.join()
            assert total.tolist() == [4.0 * (size - 1), -3.0 * (size - 1)]
            assert avg.tolist() == [4 * (size - 1) // size, -(3 * (size - 1) // size)]
        assert last != early
        assert hvd.allgather_object(last) == [last] * size


@case
def process_sets_run_on_their_ranks_only():
    import torch

    import flyte_hvd.torch as hvd

    rank = hvd.rank()
    first = hvd.add_process_set([0])  # every rank adds every set, in the same order
    second = hvd.add_process_set(hvd.ProcessSet([1]))
    mine, theirs = (first, second) if rank == 0 else (second, first)
    try:
        assert mine.included() and mine.rank() == 0 and mine.size() == 1
        assert not theirs.included() and theirs.rank() == -1
        out = hvd.allreduce(torch.ones(2) * (rank + 1), op=hvd.Sum, process_set=mine)
        assert out.tolist() == [float(rank + 1)] * 2
        assert hvd.broadcast(torch.ones(1) * rank, rank, process_set=mine).tolist() == [rank]
        handle = hvd.allgather_async(torch.ones(1, 2), process_set=mine)
        assert hvd.synchronize(handle).shape == (1, 2)
        for bad, match in (
            (lambda: hvd.allreduce(torch.ones(1), process_set=theirs), "is not in"),
            (lambda: hvd.broadcast(torch.ones(1), 1 - rank, process_set=mine), "not in"),
            (lambda: hvd.add_process_set([0]), "already registered"),
            (lambda: hvd.remove_process_set(hvd.global_process_set), "cannot be removed"),
        ):
            try:
                bad()
            except ValueError as error:
                assert match in str(error), error
            else:
                raise AssertionError(f"expected an error containing {match!r}")

        # An optimizer on the set {0}: rank 1 is outside it and steps on its own gradient.
        model, plain = _mlp(4), _mlp(4)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), process_set=first
        )
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        x, y = _data(4, seed=rank)
        for m, o in ((model, opt), (plain, plain_opt)):
            o.zero_grad()
            _mse(m, x, y).backward()
            o.step()
        _assert_close(_params(model), _params(plain))
    finally:
        assert hvd.remove_process_set(second) and hvd.remove_process_set(first)
    assert not hvd.remove_process_set(first)


@case
def sparse_gradients_stay_sparse():
    import torch

    import flyte_hvd.torch as hvd

    rank = hvd.rank()
    ids = torch.tensor([[1, 2], [2, 5]]) if rank == 0 else torch.tensor([[2, 7]])
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 3, sparse=True)
        dense = torch.nn.Embedding(8, 3)
        dense.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
            sparse_as_dense=sparse_as_dense,
        )
        emb(ids).sum().backward()
        opt.step()
        assert emb.weight.grad.is_sparse
        dense(ids).sum().backward()
        expected = hvd.allreduce(dense.weight.grad)  # the average of the dense gradients
        np.testing.assert_allclose(emb.weight.grad.to_dense().numpy(), expected.numpy(), 1e-6)
        np.testing.assert_allclose(  # every rank applied the same update
            *hvd.allgather_object(emb.weight.detach().numpy().copy()), rtol=0, atol=0
        )


@case
def optimizer_state_is_created_before_broadcast():
    import torch

    import flyte_hvd.torch as hvd

    model = _mlp(5)
    before = _params(model)
    sgd = torch.optim.SGD(
        model.parameters(), lr=0.1 * (hvd.rank() + 1), momentum=0.9, weight_decay=0.1
    )
    opt = hvd.DistributedOptimizer(sgd)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state_dict()["state"]) == len(before)  # momentum buffers exist now
    assert opt.param_groups[0]["lr"] == 0.1
    _assert_close(_params(model), before, 0, 0)  # the zero-gradient step changed nothing
    assert all(p.grad is not None for p in model.parameters())


@case
def sync_batch_norm_matches_batch_norm_on_the_whole_batch():
    import torch

    import flyte_hvd.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    full = torch.randn(4 * size, 3, 5)
    mine = full[4 * rank : 4 * (rank + 1)].clone().requires_grad_()
    whole = full.clone().requires_grad_()
    sync, plain = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    out = sync(mine)
    ref = plain(whole)
    np.testing.assert_allclose(out.detach(), ref[4 * rank : 4 * (rank + 1)].detach(), atol=1e-5)
    np.testing.assert_allclose(sync.running_mean, plain.running_mean, atol=1e-6)
    np.testing.assert_allclose(sync.running_var, plain.running_var, atol=1e-5)
    weights = torch.arange(4.0 * size * 15).reshape(4 * size, 3, 5)
    (out * weights[4 * rank : 4 * (rank + 1)]).sum().backward()
    (ref * weights).sum().backward()
    np.testing.assert_allclose(mine.grad, whole.grad[4 * rank : 4 * (rank + 1)], atol=1e-3)
    grad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
    np.testing.assert_allclose(grad, plain.weight.grad, rtol=1e-4)


@case
def grouped_allgather_and_reducescatter_with_scaling():
    import torch

    import flyte_hvd.torch as hvd

    rank = hvd.rank()
    gathered = hvd.grouped_allgather([torch.full((1,), rank), torch.full((rank + 1, 2), 1.0)])
    assert gathered[0].tolist() == [0, 1] and gathered[1].shape == (3, 2)
    ints = torch.tensor([7, -7, 5, 3], dtype=torch.int32)
    # Integers are scaled in float64 and truncated toward zero, before and after the sum.
    pre = hvd.reducescatter(ints, op=hvd.Sum, prescale_factor=0.5)
    assert pre.tolist() == ([6, -6] if rank == 0 else [4, 2]) and pre.dtype == torch.int32
    post = hvd.grouped_reducescatter([ints], op=hvd.Sum, postscale_factor=0.25)[0]
    assert post.tolist() == ([3, -3] if rank == 0 else [2, 1])
    assert hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.5).tolist() == [6, -6, 4, 2]
    try:
        hvd.grouped_reducescatter([torch.ones(2), torch.tensor(1.0)])
    except ValueError as error:
        assert "scalar" in str(error)
    else:
        raise AssertionError("a 0-dim tensor was accepted by grouped_reducescatter")
