"""``flyte-hvd-run -np N [--] python train.py ...``: a ``horovodrun``-style launcher.

Each rank is a process on this machine under its own ``mpiexec -n 1`` (the ``mpich`` wheel's),
joined into one communicator before the program starts; ``hvd.init()`` in the program picks
it up. Output lines carry a ``[rank]`` prefix. If a rank fails, the others are stopped and the
command exits non-zero naming the rank.
"""

from __future__ import annotations

import argparse
import os
import sys

from flyte_hvd.core.errors import RanksFailedError, RendezvousTimeoutError
from flyte_hvd.core.job import ProgramJob
from flyte_hvd.core.launcher import console_sink, launch_local

START_TIMEOUT_ENV = "HOROVOD_START_TIMEOUT"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="flyte-hvd-run",
        description="Run a Python training program on N ranks of this machine.",
        usage="flyte-hvd-run -np N [--start-timeout S] [--] python train.py [args...]",
    )
    parser.add_argument(
        "-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks"
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=float(os.environ.get(START_TIMEOUT_ENV, 60)),
        help=f"seconds for all ranks to start and join (default 60, or ${START_TIMEOUT_ENV})",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the program: python script.py | python -m mod | python -c code",
    )
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.np < 1:
        parser.error(f"-np must be >= 1; found {args.np}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        job = ProgramJob.from_command(args.command)
    except ValueError as e:
        print(f"flyte-hvd-run: {e}", file=sys.stderr)
        return 2
    try:
        launch_local(job, args.np, start_timeout=args.start_timeout, output=console_sink())
    except (RanksFailedError, RendezvousTimeoutError) as e:
        print(f"flyte-hvd-run: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
