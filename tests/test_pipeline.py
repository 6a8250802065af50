"""The launch pipeline's parts that need no Spark: the spec is checked once, the messages
between supervisor, ranks and driver are declared once and survive JSON."""

from __future__ import annotations

import json
import os

import pytest

from flyte_hvd.launch import messages
from flyte_hvd.launch.job import ResultError, write_result
from flyte_hvd.launch.messages import LinkKind, RankOp
from flyte_hvd.stage.pipeline import LaunchSpec


def test_a_spec_is_checked_once_with_each_default_resolved(monkeypatch):
    monkeypatch.delenv("HOROVOD_SPARK_START_TIMEOUT", raising=False)
    spec = LaunchSpec.of(print, args=(1,), default_num_proc=lambda: 3)
    assert (spec.num_proc, spec.start_timeout, spec.env) == (3, 600.0, None)
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "45")
    assert LaunchSpec.of(print, num_proc=2).start_timeout == 45.0
    with pytest.raises(AttributeError):  # frozen
        spec.num_proc = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fn": 3}, "`fn` must be callable"),
        ({"num_proc": 0}, "`num_proc` must be >= 1"),
        ({"num_proc": True}, "`num_proc` must be an int >= 1"),
        ({"start_timeout": -1}, "`start_timeout` must be seconds > 0"),
        ({"env": {"A": 1}}, "`env` must map str to str"),
        ({"args": {1}}, "`args` must be a tuple"),
        ({"max_result_bytes": 0}, "`max_result_bytes` must be a positive int"),
        ({"max_result_bytes": "1GB"}, "`max_result_bytes` must be a positive int"),
    ],
)
def test_a_bad_argument_is_refused_before_anything_starts(kwargs, match):
    args = {"fn": print, "num_proc": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        LaunchSpec.of(**args)


def test_a_bad_timeout_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"HOROVOD_SPARK_START_TIMEOUT='soon': expected seconds"):
        LaunchSpec.of(print, num_proc=1)


def test_the_result_limit_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("FLYTE_HVD_MAX_RESULT_BYTES", raising=False)
    assert LaunchSpec.of(print, num_proc=1).max_result_bytes == 2 << 30
    monkeypatch.setenv("FLYTE_HVD_MAX_RESULT_BYTES", "1000")
    assert LaunchSpec.of(print, num_proc=1).max_result_bytes == 1000
    assert LaunchSpec.of(print, num_proc=1, max_result_bytes=7).max_result_bytes == 7
    monkeypatch.setenv("FLYTE_HVD_MAX_RESULT_BYTES", "2GB")
    with pytest.raises(ValueError, match=r"FLYTE_HVD_MAX_RESULT_BYTES must be a positive whole "
                       r"number of bytes \(e.g. 2147483648 for 2 GiB\); found '2GB'"):  # fmt: skip
        LaunchSpec.of(print, num_proc=1)


def test_a_result_is_written_whole_or_refused_with_its_size(tmp_path):
    import threading

    import cloudpickle

    path = str(tmp_path / "result.pkl")
    write_result({"a": b"x" * 100}, path, 0, limit=1000)
    with open(path, "rb") as f:
        assert cloudpickle.load(f) == {"a": b"x" * 100}
    with pytest.raises(ResultError, match=r"rank 3's return value is 3.0 MiB pickled, above the "
                       r"limit of 1.0 MiB \(FLYTE_HVD_MAX_RESULT_BYTES\)"):  # fmt: skip
        write_result(b"x" * (3 << 20), path, 3, limit=1 << 20)
    with pytest.raises(ResultError, match=r"rank 1's return value \(type lock\) cannot be pickled"):
        write_result(threading.Lock(), path, 1, limit=None)
    assert os.listdir(tmp_path) == ["result.pkl"]  # the first one; no partial file is left


def test_messages_survive_json_and_name_their_kind():
    sent = [
        messages.hello(1, 42), messages.allgather("port"), messages.rank_event(RankOp.DONE),
        messages.rank_failed("tb"), messages.probe("grads", 1.23456, "where"),
        messages.gather(0, 2, "v"), messages.output(1, "stderr", "AAE="),
        messages.event(0, "task_started", 1.5), messages.link_failed(1, "tb"),
        messages.forwarded(LinkKind.ENDED, 1, {"how": "returned normally"}),
    ]  # fmt: skip
    received = [json.loads(json.dumps(m)) for m in sent]
    assert [m.get("op") or m.get("kind") for m in received] == [
        "hello", "allgather", "done", "failed", "probe", "gather", "out", "event", "failed",
        "ended",
    ]  # fmt: skip
    assert received[4]["age"] == 1.235 and received[9]["how"] == "returned normally"
    assert RankOp(received[0]["op"]) is RankOp.HELLO
    assert messages.round_reply(3, aborted="why") == {"round": 3, "aborted": "why"}
    assert messages.round_reply(3, ["a", "b"]) == {"round": 3, "values": ["a", "b"]}
