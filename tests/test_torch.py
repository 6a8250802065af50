"""flyte_hvd.torch: correctness on 2 real ranks, Horovod's Run API example inside Spark, and
errors in-process."""

from __future__ import annotations

import os
import subprocess
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_cases  # noqa: E402

from flyte_hvd.launch.job import FunctionJob  # noqa: E402
from flyte_hvd.launch.supervisor import launch_local  # noqa: E402

cloudpickle.register_pickle_by_value(torch_cases)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_results: list[dict] = []


def two_rank_results() -> list[dict[str, str | None]]:
    if not _results:
        _results.extend(launch_local(FunctionJob(torch_cases.run_cases), 2, start_timeout=120))
    return _results


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(torch_cases.CASES))
def test_torch_on_two_ranks(name):
    failures = {r: res[name] for r, res in enumerate(two_rank_results()) if res[name]}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


@pytest.mark.spark
@pytest.mark.mpi
def test_run_api_example_returns_every_rank(spark_local2, capfd, no_leftover_ranks):
    """The example of Horovod's Run API, with one changed import."""
    import flyte_hvd.spark

    def fn(magic_number):
        import flyte_hvd.torch as hvd

        hvd.init()
        print(
            "Hello, rank = %d, local_rank = %d, size = %d, local_size = %d, magic_number = %d"  # noqa: UP031
            % (hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), magic_number)
        )
        return hvd.rank()

    assert flyte_hvd.spark.run(fn, args=(42,), num_proc=2) == [0, 1]
    out = capfd.readouterr().out
    assert "Hello, rank = 1, local_rank = 1, size = 2, local_size = 2, magic_number = 42" in out


# -- in one process --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hvd():
    import flyte_hvd.torch as hvd

    hvd.init()
    return hvd


def test_size_one_behaves_like_the_wrapped_optimizer(hvd):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    plain = torch.nn.Linear(3, 1)
    plain.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (plain, plain_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.step(lambda: None) is None  # a closure runs before the reduction


def test_one_rank_registers_no_gradient_hooks(hvd):
    """As Horovod: with no peer there is nothing to reduce, so no per-parameter hooks run each
    step, and passes accumulate until step() as with the wrapped optimizer."""
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt._hvd.hooks == []
    x = torch.ones(2, 3)
    for _ in range(3):  # more passes than backward_passes_per_step: summed, as in plain torch
        model(x).sum().backward()
    np.testing.assert_allclose(model.weight.grad.numpy(), np.full((1, 3), 6.0))
    opt.step()
    opt.zero_grad()
    assert model.weight.grad is None


def test_tensor_results_are_tensors_on_one_rank(hvd):
    out = hvd.allreduce(torch.ones(3, dtype=torch.float64))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    with pytest.raises(ValueError, match="bfloat16"):
        hvd.allreduce(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="either `op` or the deprecated `average`"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="takes the handle"):
        hvd.synchronize("not a handle")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backward_passes_per_step": 0}, "backward_passes_per_step"),
        ({"backward_passes_per_step": 1.5}, "backward_passes_per_step"),
        ({"op": 3}, r"hvd\.Average or hvd\.Sum"),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor"),
        ({"named_parameters": [("w", torch.nn.Parameter(torch.ones(1)))]}, "does not name"),
        ({"named_parameters": "weights"}, r"\(name, parameter\) pairs"),
    ],
)
def test_bad_distributed_optimizer_arguments(hvd, kwargs, match):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=match):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_wrapping_something_else_and_adding_groups_are_refused(hvd):
    with pytest.raises(ValueError, match=r"wraps a torch\.optim\.Optimizer"):
        hvd.DistributedOptimizer("sgd")
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="Add the group to the optimizer first"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})


def test_duplicate_names_are_refused(hvd):
    model = torch.nn.Linear(2, 1)
    named = [("w", model.weight), ("w", model.bias)]
    with pytest.raises(ValueError, match=r"duplicates \['w'\]"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)


def test_distributed_optimizer_needs_init(hvd):
    hvd.shutdown()
    try:
        with pytest.raises(ValueError, match=r"hvd.init\(\)"):
            hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
    finally:
        hvd.init()


def test_importing_without_torch_names_the_extra():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n"
        "    import flyte_hvd.torch\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    ).stdout
    assert "pip install flyte-hvd[torch]" in out


def test_fp16_compression_takes_tensors(hvd):
    for dtype in (torch.float32, torch.float64):
        wire, ctx = hvd.Compression.fp16.compress(torch.ones(2, 3, dtype=dtype))
        assert wire.dtype == torch.float16
        back = hvd.Compression.fp16.decompress(wire, ctx)
        assert back.dtype == dtype and torch.equal(back, torch.ones(2, 3, dtype=dtype))
    for dtype in (torch.uint8, torch.int32, torch.int64, torch.float16):
        wire, ctx = hvd.Compression.fp16.compress(torch.ones(4, dtype=dtype))
        assert wire.dtype == dtype and hvd.Compression.fp16.decompress(wire, ctx).dtype == dtype


def test_build_queries_describe_this_build(hvd):
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert hvd.nccl_built() == 0
    others = (hvd.gloo_built, hvd.gloo_enabled, hvd.cuda_built, hvd.rocm_built)
    assert not any(q() for q in (*others, hvd.ccl_built, hvd.ddl_built))


def test_zero_dim_tensor_on_one_rank(hvd):
    step = torch.tensor(3.0)
    assert hvd.allreduce(step).shape == ()
    assert hvd.broadcast_(step, root_rank=0) is step and step.shape == ()


def test_bad_process_set_arguments(hvd):
    with pytest.raises(ValueError, match=r"must be a hvd\.ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set=[0])
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="distinct non-negative ranks"):
        hvd.ProcessSet([1, 1])
    with pytest.raises(ValueError, match="list of global ranks"):
        hvd.ProcessSet(["a"])
    with pytest.raises(ValueError, match="already registered"):
        hvd.add_process_set([0])  # all ranks: the global set
    with pytest.raises(ValueError, match="do not exist"):
        hvd.add_process_set([0, 5])


def test_bad_async_and_sparse_arguments(hvd):
    with pytest.raises(ValueError, match="takes the handle"):
        hvd.poll(42)
    with pytest.raises(ValueError, match="sparse COO tensor"):
        hvd.sparse_allreduce_async(torch.ones(2), "x", hvd.Average)
    with pytest.raises(ValueError, match=r"hvd\.Average and hvd\.Sum"):
        hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), "x", hvd.Max)
    with pytest.raises(ValueError, match="integers"):
        hvd.alltoall_async(torch.ones(2), splits=torch.tensor([2.0]))
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), op=hvd.Adasum
        )
    with pytest.raises(ValueError, match="at least 2-D"):
        hvd.SyncBatchNorm(3)(torch.ones(3))


def test_sparse_allreduce_on_one_rank(hvd):
    dense = torch.tensor([[0.0, 2.0], [0.0, 0.0], [4.0, 0.0]])
    reduced = hvd.sparse_allreduce_async(dense.to_sparse(), "s", hvd.Average)()
    assert reduced.is_sparse and torch.equal(reduced.to_dense(), dense)


def test_dynamic_timeline_env_writes_no_file(monkeypatch, tmp_path):
    from flyte_hvd.core import timeline

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    timeline.start_from_env(0)
    assert timeline.current() is None
    assert not os.path.exists(tmp_path / "DYNAMIC")
