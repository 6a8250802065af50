"""Exceptions shared by every launcher: they name the failing rank and survive pickling."""

from __future__ import annotations


class RanksFailedError(RuntimeError):
    """One or more ranks failed; carries ``{rank: remote traceback or cause}``.

    Raised on the driver (the ``flyte-hvd-run`` CLI, ``HorovodRunner``, ``flyte_hvd.spark.run``)
    so the user sees which rank failed and why, not an exit code.
    """

    # Lines of each rank's text in the message; the rest is in the output file it names.
    SHOWN_LINES = 20

    def __init__(
        self, failures: dict[int, str], summary: str | None = None, output_log: str | None = None
    ):
        self.failures = dict(sorted(failures.items()))
        self.summary = summary or self._default_summary()
        self.output_log = output_log
        super().__init__(self._message())

    def _default_summary(self) -> str:
        ranks = ", ".join(str(r) for r in self.failures)
        noun = "rank" if len(self.failures) == 1 else "ranks"
        return f"{noun} {ranks} failed"

    def _message(self) -> str:
        parts = [self.summary]
        for rank, text in self.failures.items():
            lines = text.rstrip().splitlines()
            if len(lines) > self.SHOWN_LINES and self.output_log:
                hidden = len(lines) - self.SHOWN_LINES
                lines = [f"... ({hidden} lines before these)", *lines[hidden:]]
            parts.append(f"--- rank {rank} ---\n" + "\n".join(lines))
        if self.output_log:
            parts.append(f"full output of every rank: {self.output_log}")
        return "\n".join(parts)

    @property
    def ranks(self) -> list[int]:
        return list(self.failures)

    def __reduce__(self):
        return (type(self), (self.failures, self.summary, self.output_log))


class ExplainedError(RuntimeError):
    """An error whose message says all a user needs (what failed, where, what to do): a rank
    reports it as its one line, without the traceback of the library calls beneath it."""


class RendezvousTimeoutError(TimeoutError):
    """The ranks did not all start and join within ``start_timeout``."""

    def __reduce__(self):
        return (type(self), self.args)


class HorovodInternalError(RuntimeError):
    """A collective could not complete on this rank (an earlier one failed, the communicator
    was shut down while it was in flight): Horovod's name, so ``except hvd.HorovodInternalError``
    in elastic-style retry loops works unchanged."""


class CollectiveMismatchError(RuntimeError, ValueError):
    """Ranks called a collective with different shapes, dtypes or arguments, or one that cannot
    run while some ranks have joined (``hvd.join()``).

    A ``RuntimeError``, as Horovod raises for these; also a ``ValueError``, as earlier releases
    of flyte-hvd raised, so existing ``except ValueError`` handlers keep working.
    """
