"""The rank process: ``mpiexec -n 1 python -m flyte_hvd.launch.bootstrap``.

Every launcher (``flyte-hvd-run``, ``HorovodRunner(np<0)``, ``flyte_hvd.spark.run``) starts
its ranks through this module: join the other ranks, check the run's secret, then run the
job. The supervisor passes the rank's place through the environment and the job through a
file; the run's secret comes over the private control socket, so it is in no process's
environment or command line. A probe thread reports collective waits (``core.stall``).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import cloudpickle

from flyte_hvd.core import state
from flyte_hvd.core.errors import ExplainedError
from flyte_hvd.core.log import get_logger
from flyte_hvd.launch import job as job_module
from flyte_hvd.launch import messages, rendezvous, spare, stall, torch_env
from flyte_hvd.launch.environment import DRIVER_VERSION_ENV, rank_threads_env, version_mismatch
from flyte_hvd.launch.messages import RankOp
from flyte_hvd.launch.output import adopt_rank_pipes

logger = get_logger("flyte_hvd.launch.bootstrap")  # run as __main__ (python -m)
# A level for the flyte_hvd logger in rank processes (e.g. INFO), which log to stderr; the
# launcher forwards a rank's stderr to the driver.
LOG_LEVEL_ENV = "FLYTE_HVD_LOG_LEVEL"


def main() -> None:
    adopt_rank_pipes()  # before anything prints: the rank's output bypasses mpiexec
    env = os.environ
    if env.get(LOG_LEVEL_ENV):
        logging.basicConfig(format="%(name)s %(levelname)s: %(message)s", stream=sys.stderr)
        get_logger().setLevel(env[LOG_LEVEL_ENV].upper())
    if env.get(spare.SPARE_ENV):  # started ahead of its run: wait for a rank
        env.update(spare.wait_for_rank())
    rank, size = int(env.pop(rendezvous.RANK_ENV)), int(env.pop(rendezvous.SIZE_ENV))
    job_path, result_path = env.pop(rendezvous.JOB_ENV), env.pop(rendezvous.RESULT_ENV)
    client = rendezvous.ControlClient(env.pop(rendezvous.CONTROL_ENV), rank)
    try:
        mismatch = version_mismatch(env.pop(DRIVER_VERSION_ENV, None), f"rank {rank}")
        if mismatch:  # before it joins: the job was pickled by another flyte_hvd
            raise ExplainedError(mismatch)
        limit = job_module.result_limit(env)
        env.pop(job_module.MAX_RESULT_ENV, None)  # the launcher's, not the job's
        comm = rendezvous.join(client, rank, size)
        rendezvous.verify_secret(comm, client.secret)
        client.secret = ""
        state.set_launcher_comm(comm)
        # Rank 0's torch.distributed port, held until the job runs (see torch_env).
        reserved = torch_env.reserve_port() if rank == 0 else None
        gathered = comm.allgather(
            torch_env.rendezvous_value(rank, state.host_hash(), env, reserved)
        )
        env.pop(torch_env.ADDRESS_ENV, None)  # the launcher's, not the job's
        hosts = [value[0] for value in gathered]
        topo = state.Topology.from_hosts(hosts, rank)
        # Where each rank landed is shown only when asked for (FLYTE_HVD_LOG_LEVEL): by
        # default a rank's stderr is the user's program output, forwarded to the driver.
        logger.log(
            logging.INFO if env.get(LOG_LEVEL_ENV) else logging.DEBUG,
            "rank %d of %d on host %s: local_rank %d of %d, cross_rank %d of %d",
            rank,
            size,
            state.host_name(),
            topo.local_rank,
            topo.local_size,
            topo.cross_rank,
            topo.cross_size,
        )
        env.update(
            HOROVOD_RANK=str(rank),
            HOROVOD_SIZE=str(size),
            HOROVOD_LOCAL_RANK=str(topo.local_rank),
            HOROVOD_LOCAL_SIZE=str(topo.local_size),
            HOROVOD_CROSS_RANK=str(topo.cross_rank),
            HOROVOD_CROSS_SIZE=str(topo.cross_size),
        )
        env.update(torch_env.rank_env(rank, size, topo, gathered, env))
        env.update(rank_threads_env(env))
        client.send(messages.rank_event(RankOp.JOINED))
        with open(job_path, "rb") as f, job_module.collector_paused():
            job = cloudpickle.load(f)  # imports the modules it names (the framework)
        spare.set_channel(client.send)
        probe = stall.Probe(client.send).start()
        if reserved is not None:
            reserved.close()  # the job may bind MASTER_PORT from now on
        try:
            result = job.run()
        except SystemExit as exit_:
            if exit_.code not in (None, 0):
                raise
            if isinstance(job, job_module.FunctionJob):  # a program's exit 0 is its success
                raise job_module.ResultError(_exited_early(rank, exit_)) from None
            result = None
        finally:
            probe.stop()
        state.shutdown()
        job_module.write_result(result, result_path, rank, limit)
    except BaseException as error:
        text = str(error) if isinstance(error, job_module.ResultError) else _user_traceback(error)
        # The traceback goes to the supervisor only: it is in the run's error and output file.
        client.send(messages.rank_failed(text))
        sys.stdout.flush()
        # Skip MPI_Finalize: it waits for peers that may be blocked on this rank forever.
        os._exit(1)
    sys.stdout.flush()
    client.finish()


def _exited_early(rank: int, exit_: SystemExit) -> str:
    """What a rank that called ``sys.exit(0)`` inside the launched function is told."""
    frames = traceback.extract_tb(exit_.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return (
        f"rank {rank} called sys.exit({exit_.code if exit_.code is not None else ''}){where} "
        f"inside the function it runs, so the function never returned its result. The "
        f"launcher gives back each rank's return value: return from the function instead of "
        f"exiting."
    )


def _user_traceback(error: BaseException) -> str:
    """The traceback from the first frame outside the bootstrap, so it starts in user code;
    an ``ExplainedError`` as its message alone."""
    if isinstance(error, ExplainedError):
        return f"{type(error).__name__}: {error}\n"
    tb = error.__traceback__
    ours = (__file__, job_module.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


if __name__ == "__main__":
    main()
