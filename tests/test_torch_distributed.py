"""torch.distributed inside flyte-hvd's ranks (RANK, WORLD_SIZE, MASTER_ADDR, ... on every
launch path; DDP gives what DistributedOptimizer gives), flyte_hvd.spark.TorchDistributor
running a program written for pyspark's, and the faults: a rank killed or stalled in a gloo
collective, too many processes, GPUs asked for where there are none."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import time

import cloudpickle
import pytest

torch = pytest.importorskip("torch")

import torch_distributed_cases as cases  # noqa: E402

from flyte_hvd.core.errors import RanksFailedError  # noqa: E402
from flyte_hvd.launch import environment, torch_env  # noqa: E402
from flyte_hvd.spark import TorchDistributor, run  # noqa: E402

cloudpickle.register_pickle_by_value(cases)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank functions below
TESTS = os.path.dirname(os.path.abspath(__file__))


def check_two_ranks(results: list[dict], node_per_host: bool = True) -> None:
    """Both ranks saw their place and one free MASTER_PORT on loopback, and DDP trained the
    same weights as DistributedOptimizer, on both ranks."""
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and 1024 <= int(ports.pop()) <= 65535
    for rank, result in enumerate(results):
        env = result["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"  # one host: loopback only
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == (
            str(rank), "2", "0"
        )  # fmt: skip
        assert result["ddp"] == pytest.approx(results[0]["ddp"], abs=0)
        assert result["ddp"] == pytest.approx(result["hvd"], rel=1e-5, abs=1e-6)
    initial = cases._model()
    assert results[0]["ddp"] != pytest.approx(
        [float(v) for p in initial.parameters() for v in p.detach().flatten()]
    )  # it trained


@pytest.mark.mpi
def test_ddp_under_flyte_hvd_run_matches_distributed_optimizer(cli, tmp_path, no_leftover_ranks):
    out = tmp_path / "result"
    proc = cli("-np", "2", "python", os.path.join(TESTS, "torch_distributed_cases.py"), str(out))
    assert proc.returncode == 0, proc.stderr
    check_two_ranks([json.loads((tmp_path / f"result.{r}.json").read_text()) for r in (0, 1)])


@pytest.mark.spark
@pytest.mark.mpi
def test_ddp_in_spark_run_matches_distributed_optimizer(spark_local2, no_leftover_ranks):
    check_two_ranks(run(cases.main, num_proc=2, verbose=0))


@pytest.mark.spark
@pytest.mark.mpi
def test_a_program_for_pysparks_torch_distributor_runs_with_one_import_changed(
    spark_local2, tmp_path, no_leftover_ranks
):
    with open(os.path.join(TESTS, "pyspark_torch_program.py")) as f:
        source = f.read()
    ours = source.replace(
        "from pyspark.ml.torch.distributor import TorchDistributor",
        "from flyte_hvd.spark import TorchDistributor",
    )
    changed = [a for a, b in zip(source.splitlines(), ours.splitlines(), strict=True) if a != b]
    assert len(changed) == 1
    program: dict = {"__name__": "pyspark_torch_program"}
    exec(compile(ours, "pyspark_torch_program.py", "exec"), program)

    out = tmp_path / "script"
    script = os.path.join(TESTS, "torch_distributor_script.py")
    on_driver, on_cluster = program["main"](script, str(out))

    assert on_driver == {"rank": 0, "world_size": 2, "total": 30.0}  # rank 0's return value
    assert on_cluster is None  # a script returns nothing, as under pyspark
    seen = [json.loads((tmp_path / f"script.{r}.json").read_text()) for r in (0, 1)]
    for rank, ranks_view in enumerate(seen):
        assert ranks_view == {
            "rank": rank,
            "world_size": 2,
            "local_rank": 0,  # each Spark task is a node of its own, as under pyspark
            "total": 9.0,  # (1 + 2) * --scale 3: the arguments reached the script as strings
            "cuda_visible_devices": "",  # use_gpu=False hides every GPU
        }


def _killed_in_all_reduce():
    import os
    import signal
    import threading
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:  # killed while it waits in all_reduce for rank 0
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        time.sleep(2.0)
    dist.all_reduce(torch.ones(1))
    time.sleep(300)  # never reached: rank 0 fails too, or is stopped


@pytest.mark.spark
@pytest.mark.mpi
def test_rank_killed_in_a_gloo_all_reduce_ends_the_run_naming_it(spark_local2, no_leftover_ranks):
    started = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        run(_killed_in_all_reduce, num_proc=2, verbose=0, stderr=io.StringIO())
    took = time.monotonic() - started
    assert took < 30, f"{took:.1f}s: the stall time is 60s, a death is seen at once"
    message = str(info.value)
    assert message.startswith("rank 1 failed; the Spark barrier stage was stopped")
    assert "rank 1 died: Killed (signal 9)" in message


def _rank_one_stalls():
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(300)
    dist.all_reduce(torch.ones(1))


@pytest.mark.mpi
def test_rank_stalled_away_from_a_gloo_all_reduce_ends_the_run_naming_it(
    monkeypatch, no_leftover_ranks
):
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "2")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "3")
    started = time.monotonic()
    with pytest.raises(RanksFailedError) as info:
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(_rank_one_stalls)
    took = time.monotonic() - started
    assert took < 30, f"{took:.1f}s"
    message = str(info.value)
    assert message.startswith("rank 1 failed")
    assert "ranks [0] have waited 3s in `torch.distributed.all_reduce`" in message
    assert "ranks [1] are not there (rank 1 at test_torch_distributed.py:" in message
    assert "The run was stopped after 3s" in message


def _nccl():
    import torch.distributed as dist

    dist.init_process_group("nccl")


@pytest.mark.mpi
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_nccl_without_gpus_fails_the_rank_at_once(no_leftover_ranks):
    started = time.monotonic()
    with pytest.raises(RanksFailedError, match="NCCL"):
        TorchDistributor(num_processes=1, local_mode=True, use_gpu=False).run(_nccl)
    assert time.monotonic() - started < 30


@pytest.mark.spark
@pytest.mark.mpi
def test_more_processes_than_task_slots_is_refused_before_ranks_start(
    spark_local2, no_leftover_ranks
):
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=False).run(_nccl)
    assert time.monotonic() - started < 5
    assert str(info.value).startswith(
        "`num_processes`=3 but the cluster has 2 free task slot(s) (master local[2]"
    )
    assert "Lower `num_processes`" in str(info.value)


@pytest.mark.spark
def test_use_gpu_without_gpus_is_refused_with_what_to_do(spark_local2):
    with pytest.raises(RuntimeError) as info:
        TorchDistributor(num_processes=2, local_mode=True)  # use_gpu=True, pyspark's default
    assert "the active SparkSession has none (set spark.driver.resource.gpu.amount" in str(
        info.value
    )
    assert "pass `use_gpu=False` and use the `gloo` backend" in str(info.value)
    with pytest.raises(RuntimeError) as info:
        TorchDistributor(num_processes=2, local_mode=False)
    assert "spark.task.resource.gpu.amount is 0: set spark.task.resource.gpu.amount=1" in str(
        info.value
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_processes": 0}, r"`num_processes` must be >= 1; found 0"),
        ({"num_processes": "2"}, r"`num_processes` must be an int >= 1; found '2'"),
        ({"local_mode": "yes"}, r"`local_mode` must be True or False; found 'yes'"),
        ({"use_gpu": 1}, r"`use_gpu` must be True or False; found 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchDistributor(**{"use_gpu": False, **kwargs})


def test_bad_train_objects_are_refused(tmp_path):
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    with pytest.raises(ValueError, match="must be a function or the path of a Python script"):
        distributor.run(42)
    with pytest.raises(ValueError, match=r"is not a file on the driver"):
        distributor.run(str(tmp_path / "missing.py"))
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError, match=r"not keyword arguments; found \['lr'\]"):
        distributor.run(str(script), lr=0.1)


# -- the variables, without processes --------------------------------------------------------


class _Place:
    local_rank, local_size, cross_rank = 1, 2, 0


def _gathered(hosts: list[str]) -> list[list]:
    return [[hosts[0], "10.0.0.5", 40000]] + [[h, None, None] for h in hosts[1:]]


def test_master_addr_is_rank_zeros_address_across_hosts_and_loopback_on_one():
    one = torch_env.rank_env(1, 2, _Place(), _gathered(["a", "a"]), {})
    assert one == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40000",
    }  # fmt: skip
    two = torch_env.rank_env(1, 2, _Place(), _gathered(["a", "b"]), {})
    assert two["MASTER_ADDR"] == "10.0.0.5"


def test_master_addr_and_port_given_are_kept_unless_loopback_across_hosts(caplog):
    given = {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29500"}
    env = torch_env.rank_env(1, 2, _Place(), _gathered(["a", "b"]), given)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.9.9.9", "29500")
    given = {"MASTER_ADDR": "localhost", "RANK": "7"}
    env = torch_env.rank_env(0, 2, _Place(), _gathered(["a", "b"]), given)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"]) == ("10.0.0.5", "40000", "0")
    assert "MASTER_ADDR=localhost is a loopback address but the ranks run on 2 hosts" in (
        caplog.text
    )
    env = torch_env.rank_env(0, 2, _Place(), _gathered(["a", "a"]), given)
    assert env["MASTER_ADDR"] == "localhost"  # one host: loopback reaches rank 0


def test_a_node_per_rank_as_pysparks_tasks():
    env = torch_env.rank_env(
        1, 2, _Place(), _gathered(["a", "a"]), {torch_env.NODE_PER_RANK_ENV: "1"}
    )
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == ("0", "1", "1")


def test_reserved_port_is_held_until_released():
    reserved = torch_env.reserve_port()
    port = reserved.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("", port))
    reserved.close()
    with socket.socket() as other:
        other.bind(("", port))  # free for the job's init_process_group


def test_the_drivers_own_process_group_does_not_reach_the_ranks(monkeypatch):
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:/tmp/x")
    env = environment.driver_env()
    assert env["MLFLOW_TRACKING_URI"] == "file:/tmp/x"
    assert not {"RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)


# -- our torch collectives through the process group ------------------------------------------


def _collectives_on_both_routes():
    """Every collective with a process-group route, run on each route over a gloo group;
    the calls each route made to torch.distributed; the errors of mismatched calls."""
    import os

    import torch
    import torch.distributed as dist

    import flyte_hvd.torch as hvd
    from flyte_hvd.core.errors import CollectiveMismatchError
    from flyte_hvd.torch.process_group import ROUTE_ENV

    hvd.init()
    dist.init_process_group("gloo")
    rank = hvd.rank()
    calls = {"count": 0}
    for name in ("all_reduce", "all_gather", "broadcast"):
        real = getattr(dist, name)

        def counted(*args, _real=real, **kwargs):  # the real call, counted
            calls["count"] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    own_sets = [hvd.add_process_set([r]) for r in range(hvd.size())]

    def everything(route: str) -> tuple[dict, int]:
        os.environ[ROUTE_ENV] = route
        calls["count"] = 0
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        n = torch.tensor([7, -7, 9], dtype=torch.int32) * (rank + 1)
        grad_in = x.clone().requires_grad_()
        hvd.allreduce(grad_in, op=hvd.Sum).sum().backward()
        out = {
            "sum": hvd.allreduce(x, op=hvd.Sum),
            "average": hvd.allreduce(x),
            "min": hvd.allreduce(x, op=hvd.Min),
            "max": hvd.allreduce(x, op=hvd.Max),
            "product": hvd.allreduce(x, op=hvd.Product),
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
            "int_average": hvd.allreduce(n),  # 7+14=21 -> 10: toward zero
            "int_scaled": hvd.allreduce(n, op=hvd.Sum, prescale_factor=0.3),
            "half": hvd.allreduce(x.half(), postscale_factor=0.1),
            "in_place": hvd.allreduce_(x.clone(), op=hvd.Sum),
            "grouped": hvd.grouped_allreduce([x, n, x.double()], op=hvd.Sum),
            "grouped_in_place": hvd.grouped_allreduce_([x.clone(), n.clone()]),
            "gather": hvd.allgather(torch.full((rank + 1, 2), float(rank))),  # ragged
            "gather_scalar": hvd.allgather(torch.tensor(rank)),
            "grouped_gather": hvd.grouped_allgather([n, x[: rank + 1]]),
            "broadcast": hvd.broadcast(x, root_rank=1),
            "broadcast_bool": hvd.broadcast(torch.tensor([rank == 1, False]), root_rank=1),
            "broadcast_in_place": hvd.broadcast_(x.clone(), root_rank=0),
            "grad": grad_in.grad,
            "own_set": hvd.allreduce(x, op=hvd.Sum, process_set=own_sets[rank]),  # MPI
        }
        flat = {
            k: [(str(t.dtype), t.tolist()) for t in (v if isinstance(v, list) else [v])]
            for k, v in out.items()
        }
        return flat, calls["count"]

    results = {route: everything(route) for route in ("mpi", "process_group", "auto")}
    errors = []
    for routes in (("process_group", "process_group"), ("mpi", "process_group")):
        os.environ[ROUTE_ENV] = routes[rank]
        try:
            hvd.allreduce(torch.ones(3 + rank))
        except CollectiveMismatchError as error:
            errors.append(str(error))
    dist.destroy_process_group()
    return {"results": results, "errors": errors}


@pytest.mark.mpi
def test_torch_collectives_through_the_process_group_equal_the_mpi_route(no_leftover_ranks):
    from flyte_hvd.launch.job import FunctionJob
    from flyte_hvd.launch.supervisor import launch_local

    for rank, seen in enumerate(launch_local(FunctionJob(_collectives_on_both_routes), 2)):
        (mpi, mpi_calls), (forced, forced_calls), (auto, auto_calls) = (
            seen["results"][route] for route in ("mpi", "process_group", "auto")
        )  # fmt: skip
        assert forced == mpi  # values and dtypes, exactly: two addends sum alike in any order
        assert auto == mpi
        # Forced, every call but the process-set one went through gloo: 2 for the gradient
        # (forward, backward), 10 allreduces, 3 + 2 fusion buffers (one per dtype), 4 gathers
        # (one per tensor), 3 broadcasts. Auto (gloo, CPU tensors) and mpi: none.
        assert (mpi_calls, auto_calls) == (0, 0)
        assert forced_calls == 24
        # Closed forms: rank r holds x * (r + 1) and n * (r + 1).
        x = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert mpi["sum"] == [("torch.float32", [[v * 3 for v in row] for row in x])]
        assert mpi["int_average"] == [("torch.int32", [10, -10, 13])]
        assert mpi["gather"] == [("torch.float32", [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])]
        assert mpi["broadcast_bool"] == [("torch.bool", [True, False])]
        assert mpi["grad"] == [("torch.float32", [[2.0] * 3] * 2)]  # Sum's gradient: size
        assert mpi["own_set"] == [("torch.float32", [[v * (rank + 1) for v in r] for r in x])]
        # Mismatched calls raise on every rank, on the process-group route too, and a rank on
        # the other route is a mismatch rather than a wait in another library.
        same, mixed = seen["errors"]
        assert "ranks called `allreduce` with different arguments" in same
        assert "rank 0: allreduce(op=AVERAGE, dtype=float32, shape=(3,), route=process group)" in (
            same
        )
        assert "rank 1: allreduce(op=AVERAGE, dtype=float32, shape=(4,), route=process group)" in (
            same
        )
        assert "rank 0: allreduce(op=AVERAGE, dtype=float32, shape=(3,), compression=" in mixed
        assert "rank 1: allreduce(op=AVERAGE, dtype=float32, shape=(4,), route=process group)" in (
            mixed
        )


def test_an_unknown_collectives_route_is_refused(monkeypatch):
    from flyte_hvd.torch.process_group import ROUTE_ENV, route_setting

    monkeypatch.setenv(ROUTE_ENV, "nccl")
    with pytest.raises(ValueError) as info:
        route_setting()
    assert str(info.value) == (
        "FLYTE_HVD_TORCH_COLLECTIVES='nccl': expected 'auto' (the process group for GPU tensors "
        "when its backend is NCCL), 'process_group' (whenever one is initialized) or 'mpi'."
    )
    monkeypatch.setenv(ROUTE_ENV, " Process_Group ")
    assert route_setting() == "process_group"
    monkeypatch.delenv(ROUTE_ENV)
    assert route_setting() == "auto"


@pytest.mark.spark
@pytest.mark.mpi
def test_ddp_in_a_horovod_spark_task_matches_distributed_optimizer(spark_local2, no_leftover_ranks):
    """The body of a flytekit ``HorovodSpark`` task trains with DDP on gloo as in
    ``spark.run``; rank 0 returns what both ranks saw and trained."""
    from flytekit import task

    from flyte_hvd.flyte import HorovodSpark

    @task(task_config=HorovodSpark(num_proc=2))
    def train() -> str:
        import flyte_hvd.core as hvd

        return json.dumps(hvd.allgather_object(cases.main()))

    check_two_ranks(json.loads(train()))
