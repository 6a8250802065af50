"""A rank's partition of a run's ``data``: the spill file its task writes, and the rank's read
of it (the runs themselves are in tests/test_spark_run.py)."""

from __future__ import annotations

import os

import pytest


def test_get_partition_outside_a_run_given_data_says_how_to_give_it(monkeypatch):
    from flyte_hvd.spark import get_partition
    from flyte_hvd.stage.partition import PARTITION_ENV

    monkeypatch.delenv(PARTITION_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"Pass the DataFrame as `data`, or read the data"):
        get_partition()


def test_a_spilled_partition_reads_back_and_its_folder_goes_whatever_happens():
    import pyarrow as pa

    from flyte_hvd.stage.partition import spilled

    schema = pa.schema([("id", pa.int64()), ("x", pa.float64())])
    batches = [pa.record_batch([[i, i + 1], [0.5, 1.5]], schema=schema) for i in (0, 2)]
    with spilled(iter(batches), schema.serialize().to_pybytes()) as (path, rows):
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        assert rows == 4 and table.column("id").to_pylist() == [0, 1, 2, 3]
    assert not os.path.exists(os.path.dirname(path))
    with spilled(iter([]), schema.serialize().to_pybytes()) as (empty, rows):
        assert rows == 0 and pa.ipc.open_file(empty).read_all().schema == schema
    with pytest.raises(KeyError), spilled(iter(batches), b"") as (failed, _):
        raise KeyError("the rank failed")
    assert not os.path.exists(os.path.dirname(failed))
