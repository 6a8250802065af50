"""What is in the columns ``prepare_data`` stores, and whether a model can take it: rows,
validation rows and, per column, nulls, NaN or infinite values, array and vector lengths and
sparse or dense vectors, from one Spark aggregation (in the JVM: no rows cross to Python); a
ValueError for data a model cannot take. The column records (``ColumnInfo``) follow from them.

pyspark is imported only inside the functions that run Spark jobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

from flyte_hvd.data.columns import Kind, quoted
from flyte_hvd.data.dataset import ColumnInfo
from flyte_hvd.data.split import SPLIT_COL

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# What one aggregation found: "rows", "val_rows" and per column ("cols") counts and lengths
# (see ``_collect_stats``); ints, or None where a column has no rows.
Stats: TypeAlias = dict[str, Any]


def inspect_columns(
    sel: DataFrame,
    kinds: dict[str, Kind],
    nan_checked: set[str],
    has_split: bool,
    features: set[str],
    compress_sparse: bool,
) -> tuple[Stats, list[ColumnInfo]]:
    """The statistics of ``sel``'s columns (``_collect_stats``) and the column records they
    give."""
    stats = _collect_stats(sel, kinds, nan_checked, has_split, features)
    return stats, _column_infos(list(kinds), kinds, stats, compress_sparse)


def _non_finite(x: Column) -> Column:
    """Whether a number is NaN or infinite, as a Spark expression."""
    from pyspark.sql import functions as F

    return F.isnan(x) | (F.abs(x) == float("inf"))


def _column_stats(c: str, kind: str, dtype: str, check_nan: bool) -> dict[str, Column]:
    """Spark aggregate expressions of one column's statistics (see ``_collect_stats``)."""
    from pyspark.sql import functions as F

    col = F.col(quoted(c))

    def count(condition: Column) -> Column:
        return F.sum(F.when(condition, 1).otherwise(0))

    exprs: dict[str, Column] = {"nulls": count(col.isNull())}
    values = col
    if kind == "vector":
        from pyspark.ml.functions import array_to_vector, vector_to_array

        values = vector_to_array(col, "float64")
        # SQL cannot read a vector's type field. A dense vector equals the dense vector made
        # from its own values (NaN equals NaN in Spark's comparisons); a sparse one does not.
        # Half the cost of testing its text form, which formats every value (measured).
        sparse = col != array_to_vector(values)
        exprs["sparse"] = count(col.isNotNull() & sparse)
        exprs["dense"] = count(col.isNotNull() & ~sparse)
    if kind != "scalar":
        length = F.when(col.isNotNull(), F.size(values))
        exprs["min_len"], exprs["max_len"] = F.min(length), F.max(length)
    if check_nan and dtype.startswith("float"):
        if kind == "scalar":
            exprs["nans"] = count(_non_finite(col))
        else:
            # Rows holding a NaN or an infinity, by the row's greatest and least value (NaN
            # sorts above every number): compiled code, where a per-value lambda is
            # interpreted (measured: 0.4 s of a cold 200 k-row pass). The values themselves
            # are counted only when there are some (`count_non_finite`).
            top, bottom = F.array_max(values), F.array_min(values)
            exprs["nan_rows"] = count(
                F.isnan(top) | (top == float("inf")) | (bottom == float("-inf"))
            )
    return exprs


def count_non_finite(sel: DataFrame, c: str, kind: str) -> int:
    """The NaN or infinite values of an array or vector column, for the error message."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    col = F.col(quoted(c))
    values = vector_to_array(col, "float64") if kind == "vector" else col
    bad = F.aggregate(values, F.lit(0), lambda n, x: n + F.when(_non_finite(x), 1).otherwise(0))
    return int(sel.agg(F.sum(bad)).collect()[0][0] or 0)


def _collect_stats(
    sel: DataFrame,
    kinds: dict[str, Kind],
    nan_checked: set[str],
    has_split: bool,
    features: set[str] = frozenset(),  # type: ignore[assignment]
) -> Stats:
    """Rows, validation rows and, per column, nulls, NaN or infinite values, the least and
    greatest array or vector length and the sparse and dense vector counts, in one Spark
    aggregation (in the JVM: no rows cross to Python; a second one counts the NaN values of a
    column that has some, for the message); a ValueError for data a model cannot take."""
    from pyspark.sql import functions as F

    named = [F.count(F.lit(1)).alias("rows")]
    if has_split:
        named.append(F.sum(F.col(SPLIT_COL).cast("int")).alias("val_rows"))
    per_column: dict[str, dict[str, str]] = {}
    for i, (c, (kind, dtype)) in enumerate(kinds.items()):
        exprs = _column_stats(c, kind, dtype, c in nan_checked)
        per_column[c] = {stat: f"s{i}_{stat}" for stat in exprs}
        named.extend(expr.alias(per_column[c][stat]) for stat, expr in exprs.items())
    row = sel.agg(*named).collect()[0].asDict()
    total: Stats = {"rows": row["rows"], "val_rows": row.get("val_rows") or 0, "cols": {}}
    for c, aliases in per_column.items():
        st = {"nulls": 0, "nans": 0, "min_len": None, "max_len": None, "sparse": 0, "dense": 0}
        st.update({stat: row[alias] for stat, alias in aliases.items()})
        for stat in ("nulls", "nans", "sparse", "dense"):
            st[stat] = int(st[stat] or 0)  # a sum over no rows is null
        total["cols"][c] = st
    if total["rows"] == 0:
        raise ValueError(
            "the DataFrame has no rows; there is nothing to train on. Check the "
            "filters that produced it."
        )
    for c, st in total["cols"].items():
        if st["nulls"]:
            raise ValueError(
                f"column `{c}` has {st['nulls']} null values; the model needs a "
                f"value in every row. Drop or fill them first (df.na.drop / "
                f"df.na.fill)."
            )
        if st.pop("nan_rows", None):
            st["nans"] = count_non_finite(sel, c, kinds[c][0])
        if st["nans"]:
            allow = (
                "; or pass `allow_non_finite_features=True` to prepare_data if the model "
                "handles them"
                if c in features
                else ""
            )
            raise ValueError(
                f"column `{c}` has {st['nans']} NaN or infinite values; they make the loss "
                f"NaN. Drop or fix those rows first (e.g. df.na.drop(subset=['{c}']) for NaN)"
                f"{allow}."
            )
        if st["min_len"] is not None and st["min_len"] != st["max_len"]:
            raise ValueError(
                f"column `{c}` has rows of different lengths ({st['min_len']} to "
                f"{st['max_len']}); every row must have the same length. Pad or "
                f"truncate it first."
            )
        if st["min_len"] == 0:
            raise ValueError(
                f"column `{c}` holds empty arrays or vectors; a model input needs "
                f"at least one value per row."
            )
    return total


def _column_infos(
    selected: list[str],
    kinds: dict[str, Kind],
    stats: Stats,
    compress_sparse: bool,
) -> list[ColumnInfo]:
    infos = []
    for c in selected:
        kind, dtype = kinds[c]
        st = stats["cols"][c]
        shape: tuple[int, ...] = () if kind == "scalar" else (st["max_len"],)
        encoding = "plain" if kind == "scalar" else "list"
        if kind == "vector":
            if st["dense"] == 0:
                kind = "sparse_vector"
                encoding = "sparse" if compress_sparse else "list"
            elif st["sparse"] == 0:
                kind = "dense_vector"
        infos.append(ColumnInfo(c, kind, dtype, shape, encoding))
    return infos


def check_split_rows(stats: Stats, validation: float | str | None, num_processes: int) -> None:
    """Each split has a row for every process."""
    if validation is None:
        return
    val_rows, rows = stats["val_rows"], stats["rows"]
    for split, n in (("validation", val_rows), ("training", rows - val_rows)):
        if n < num_processes:
            raise ValueError(
                f"`validation`={validation!r} puts {n} of {rows} rows into the {split} split, "
                f"fewer than `num_processes`={num_processes}; every process needs rows. "
                f"Change `validation` or use more data."
            )


def split_rows(stats: Stats, split: str, validation: float | str | None) -> int:
    """The rows of ``split`` ("train" or "val"), from the statistics."""
    if validation is None:
        return int(stats["rows"])
    val_rows = int(stats["val_rows"])
    return val_rows if split == "val" else int(stats["rows"]) - val_rows
