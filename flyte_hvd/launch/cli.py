"""``flyte-hvd-run -np N [--] python train.py ...``: a ``horovodrun``-style launcher.

Each rank is a process on this machine under its own ``mpiexec -n 1`` (the ``mpich`` wheel's),
joined into one communicator before the program starts; ``hvd.init()`` in the program picks
it up. Output lines carry a ``[rank]`` prefix. If a rank fails, the others are stopped and the
command exits 1 naming the rank (its full output kept in a file the message names). Ctrl-C
and SIGTERM stop every rank, remove the run's files and exit 130 / 143 with one line.
"""

from __future__ import annotations

import argparse
import signal
import sys

from flyte_hvd.core.errors import RanksFailedError, RendezvousTimeoutError
from flyte_hvd.launch.job import ProgramJob
from flyte_hvd.launch.supervisor import console_sink, launch_local, start_timeout_from_env

START_TIMEOUT_ENV = "HOROVOD_START_TIMEOUT"


def _default_start_timeout() -> float:
    try:
        return start_timeout_from_env(START_TIMEOUT_ENV, 60.0)
    except ValueError as error:
        sys.exit(f"flyte-hvd-run: {error}")


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
        default=_default_start_timeout(),
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
    if not args.start_timeout > 0:
        parser.error(f"--start-timeout must be seconds > 0; found {args.start_timeout:g}")
    return args


class _Signalled(BaseException):
    """SIGINT or SIGTERM arrived: unwinds the launcher, which stops the ranks."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame: object) -> None:
    # Later signals must not interrupt the cleanup the first one started.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Signalled(signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        job = ProgramJob.from_command(args.command)
    except ValueError as e:
        print(f"flyte-hvd-run: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        launch_local(
            job,
            args.np,
            start_timeout=args.start_timeout,
            output=console_sink(),
            timeout_hint=f"--start-timeout (or ${START_TIMEOUT_ENV})",
        )
    except (RanksFailedError, RendezvousTimeoutError, ValueError) as e:
        print(f"flyte-hvd-run: {e}", file=sys.stderr)
        return 1
    except _Signalled as stop:
        name = "interrupted (Ctrl-C)" if stop.signum == signal.SIGINT else "terminated (SIGTERM)"
        print(f"flyte-hvd-run: {name}; every rank was stopped.", file=sys.stderr)
        return 128 + stop.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
