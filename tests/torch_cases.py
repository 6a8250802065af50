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
    rows, splits = hvd.alltoall(torch.arange(4) + 10 * rank)
    assert rows.tolist() == ([0, 1, 10, 11] if rank == 0 else [2, 3, 12, 13])
    assert splits.tolist() == [2, 2]
    assert hvd.reducescatter(torch.ones(4, 2) * (rank + 1), op=hvd.Sum).tolist() == [[3.0] * 2] * 2
    grouped = hvd.grouped_allreduce([torch.ones(2) * rank, torch.ones(3, dtype=torch.float64)])
    assert grouped[0].tolist() == [0.5, 0.5] and grouped[1].dtype == torch.float64
    handle = hvd.allreduce_async_(torch.ones(5) * (rank + 1), op=hvd.Sum)
    assert hvd.synchronize(handle).tolist() == [3.0] * 5 and hvd.poll(handle)
    copy_handle = hvd.allreduce_async(torch.ones(2) * rank, name="async")
    assert hvd.synchronize(copy_handle).tolist() == [0.5, 0.5]
    assert size == 2


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
        assert "ranks hold different models" in str(error), error
    else:
        raise AssertionError("broadcast_parameters of different models did not raise")
