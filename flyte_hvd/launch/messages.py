"""What the supervisor, its ranks and the Spark driver say to each other, declared once.

Two channels carry JSON lines:
- a rank's **control socket** (rank -> its supervisor, an ``AF_UNIX`` socket in the
  supervisor's private folder): ``RankOp`` messages, each ``{"op": ..., ...}``; the supervisor
  answers ``hello`` with the run's secret and ``allgather`` with every rank's value;
- a Spark task's **driver link** (task -> driver, TCP): the driver's first line is a fresh
  challenge, the task's first line answers it with a proof of the run's secret, then come
  ``LinkKind`` messages, each ``{"kind": ..., "rank": ..., ...}``; the driver answers a
  ``gather`` round with every task's value (or why it was aborted), a ``failed`` report
  with its verdict and a ``result`` with the id it keeps the result under.

Each builder below returns one message; the fields it names are the message's whole content.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeAlias

# One message on either channel: field name -> JSON value (the builders below say which).
Message: TypeAlias = dict[str, Any]


class RankOp(StrEnum):
    """A rank's messages to its supervisor."""

    HELLO = "hello"  # rank, pid: the rank connected; the reply carries the run's secret
    ALLGATHER = "allgather"  # value: a rendezvous round; the reply carries every rank's value
    JOINED = "joined"  # the rank is in the run's communicator
    WARM = "warm"  # the rank imported what it needs: start the next run's spare now
    FAILED = "failed"  # traceback: the rank's error, from its first frame in user code
    PROBE = "probe"  # coll, age, where, doing: what the rank waits in (``stall``)
    SHM = "shm"  # names: the shared-memory segments MPI created for the rank (``/dev/shm``)
    DONE = "done"  # the rank returned normally; its result is in its result file


class LinkKind(StrEnum):
    """A Spark task's messages to the driver."""

    GATHER = "gather"  # round, value: a rendezvous round of the tasks
    OUT = "out"  # stream, data (base64): the rank's output bytes, in order
    EVENT = "event"  # name, time: a start-up event of the task or its rank
    PROBE = "probe"  # a rank's probe report, forwarded for the driver's stall watch
    ENDED = "ended"  # how: the rank ended (for the stall watch)
    FAILED = "failed"  # traceback: the rank failed; the reply is the driver's verdict
    RESULT = "result"  # size: the rank's pickled result follows as ``size`` raw bytes


# -- the control socket ------------------------------------------------------------------------


def hello(rank: int, pid: int) -> Message:
    return {"op": RankOp.HELLO, "rank": rank, "pid": pid}


def allgather(value: str) -> Message:
    return {"op": RankOp.ALLGATHER, "value": value}


def rank_event(op: RankOp) -> Message:
    """``joined``, ``warm`` or ``done``: messages without fields."""
    return {"op": op}


def rank_failed(traceback: str) -> Message:
    return {"op": RankOp.FAILED, "traceback": traceback}


def probe(
    coll: str | None, age: float, where: str, doing: str | None = None, given: str | None = None
) -> Message:
    """``doing``: what the rank has been busy with outside collectives for a while (e.g.
    "uploading runs/x/checkpoint.keras to s3://b/p"; ``stall.activity``), else None;
    ``given``: what the collective it waits in was given (e.g. "float32 shape (3,)")."""
    return {
        "op": RankOp.PROBE,
        "coll": coll,
        "age": round(age, 3),
        "where": where,
        "doing": doing,
        "given": given,
    }


def shm(names: list[str]) -> Message:
    return {"op": RankOp.SHM, "names": names}


def secret_reply(secret: str) -> Message:
    return {"secret": secret}


def values_reply(values: list[str]) -> Message:
    return {"values": values}


# -- the driver link ---------------------------------------------------------------------------


def link_challenge(nonce: str) -> Message:
    """The driver's first line on a new connection: a nonce used for this connection only."""
    return {"nonce": nonce}


def link_hello(role: str, rank: int, proof: str) -> Message:
    """The task's first line: who it is and its proof, an HMAC of the nonce, role and rank."""
    return {"role": role, "rank": rank, "proof": proof}


def gather(rank: int, round_: int, value: str) -> Message:
    return {"kind": LinkKind.GATHER, "rank": rank, "round": round_, "value": value}


def output(rank: int, stream: str, data_base64: str) -> Message:
    return {"kind": LinkKind.OUT, "rank": rank, "stream": stream, "data": data_base64}


def event(rank: int, name: str, at: float) -> Message:
    return {"kind": LinkKind.EVENT, "rank": rank, "name": name, "time": at}


def forwarded(kind: LinkKind, rank: int, message: Message) -> Message:
    """A rank's ``probe`` report or its ``ended`` notice, passed on to the driver."""
    return {**message, "kind": kind, "rank": rank}


def link_failed(rank: int, traceback: str) -> Message:
    return {"kind": LinkKind.FAILED, "rank": rank, "traceback": traceback}


def result(rank: int, size: int) -> Message:
    return {"kind": LinkKind.RESULT, "rank": rank, "size": size}


def round_reply(
    round_: int, values: list[str] | None = None, aborted: str | None = None
) -> Message:
    """The driver's answer to a ``gather`` round: every task's value, or why it was aborted."""
    if aborted is not None:
        return {"round": round_, "aborted": aborted}
    return {"round": round_, "values": values}


def verdict_reply(final: bool) -> Message:
    """The driver's answer to ``failed``: whether the run ends here (else Spark retries)."""
    return {"final": final}


def stored_reply(result_id: str) -> Message:
    """The driver's answer to ``result``: the id it keeps the result under."""
    return {"stored": result_id}
