"""Which columns ``prepare_data`` reads, and whether a model can take them: the checks of its
arguments against the DataFrame's columns and Spark types, before any Spark job runs.

pyspark is imported only inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType

# A column's kind ("scalar", "array" or "vector") and numpy dtype, as ``spark_kind`` gives it.
Kind = tuple[str, str]


@dataclass(frozen=True)
class Selection:
    """The checked columns of a ``prepare_data`` call: each one's role, and the kind of each
    column that is stored."""

    features: list[str]
    labels: list[str]
    weight: str | None  # the sample weight column
    validation: float | str | None  # a fraction, or the column that flags validation rows
    kinds: dict[str, Kind]  # of the stored columns: features, labels, weight

    @property
    def weights(self) -> list[str]:
        """The sample weight column, as a list of zero or one name."""
        return [self.weight] if self.weight is not None else []

    @property
    def stored(self) -> list[str]:
        """The columns written, in order: features, labels, then the weight (each once)."""
        return list(dict.fromkeys([*self.features, *self.labels, *self.weights]))


def select_columns(
    df: DataFrame,
    label_columns: Sequence[str],
    feature_columns: Sequence[str] | None,
    validation: float | str | None,
    sample_weight_col: str | None,
) -> Selection:
    """The columns ``prepare_data`` stores, checked against ``df``: each named column exists,
    the features default to every other column, and the weight and validation columns are
    numeric scalars; a ValueError says what to fix."""
    labels = column_names("label_columns", label_columns)
    if not labels:
        raise ValueError("`label_columns` is empty; name at least one label column.")
    val_col = validation if isinstance(validation, str) else None
    check_validation(validation)
    if sample_weight_col is not None and not isinstance(sample_weight_col, str):
        raise ValueError(f"`sample_weight_col` must be a column name; found {sample_weight_col!r}.")
    weight = [sample_weight_col] if sample_weight_col is not None else []
    available = list(df.columns)
    for arg, names in (
        ("label_columns", labels),
        ("sample_weight_col", weight),
        ("validation", [val_col] if val_col else []),
    ):
        check_exist(arg, names, available)
    features = _features(feature_columns, available, {*labels, *weight, val_col})
    types = {f.name: f.dataType for f in df.schema.fields}
    stored = list(dict.fromkeys([*features, *labels, *weight]))
    kinds = {c: spark_kind(c, types[c]) for c in stored}
    for c in weight:
        if kinds[c][0] != "scalar":
            raise ValueError(
                f"`sample_weight_col` `{c}` must be a numeric scalar column; it "
                f"has type {types[c].simpleString()}."
            )
    if val_col is not None:
        _check_validation_column(val_col, types[val_col])
    return Selection(features, labels, sample_weight_col, validation, kinds)


def _features(
    feature_columns: Sequence[str] | None, available: list[str], others: set[str | None]
) -> list[str]:
    """The named feature columns, or by default every column without another role."""
    if feature_columns is not None:
        features = column_names("feature_columns", feature_columns)
        check_exist("feature_columns", features, available)
        return features
    features = [c for c in available if c not in others]
    if not features:
        raise ValueError(
            f"no feature columns: the DataFrame has only {available}; pass "
            f"`feature_columns` or add features."
        )
    return features


def _check_validation_column(name: str, dtype: DataType) -> None:
    try:
        kind = spark_kind(name, dtype)[0]
    except ValueError:
        kind = None
    if kind != "scalar":
        raise ValueError(
            f"`validation` column `{name}` must be boolean or numeric; it "
            f"has type {dtype.simpleString()}."
        )


def check_count(name: str, value: object) -> None:
    """``value`` is an int >= 1, or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1; found {value!r}.")


def column_names(arg: str, value: str | Iterable[str]) -> list[str]:
    """A column name or a list of them, as a list; a ValueError for anything else."""
    if isinstance(value, str):
        return [value]
    try:
        names = list(value)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise ValueError(f"`{arg}` must be a column name or a list of them; found {value!r}.")
    return names


def check_exist(arg: str, names: list[str], available: list[str]) -> None:
    """Every one of ``names`` (given as ``arg``) is among the DataFrame's columns."""
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(
            f"`{arg}` names {', '.join(f'`{m}`' for m in missing)}, which the DataFrame does "
            f"not have; available columns: {', '.join(f'`{a}`' for a in available)}. Fix the "
            f"name or add the column."
        )


def check_spark_dataframe(df: object, what: str) -> None:
    """``df`` is a Spark DataFrame (classic or Connect), or a ValueError saying what it is
    and how to make one from it."""
    if hasattr(df, "schema") and hasattr(df, "mapInArrow"):
        return
    kind = type(df)
    module = kind.__module__.split(".")[0]
    if kind.__module__.startswith("pyspark.pandas"):
        found, fix = "a pandas-on-Spark DataFrame", "convert it with `psdf.to_spark()`"
    elif module == "pandas":
        found, fix = "a pandas DataFrame", "convert it with `spark.createDataFrame(pdf)`"
    elif module in ("polars", "pyarrow"):
        found = f"a {module} {kind.__name__}"
        fix = "convert it with `spark.createDataFrame(table.to_pandas())`"
    else:
        found = f"{kind.__module__}.{kind.__name__}"
        fix = "read or create one with the SparkSession (`spark.read...`, `spark.createDataFrame`)"
    raise ValueError(f"{what} must be a Spark DataFrame; found {found}: {fix}.")


def check_validation(validation: object) -> None:
    """``validation`` is None, a column name or a fraction strictly between 0 and 1."""
    if validation is None or isinstance(validation, str):
        return
    if isinstance(validation, bool) or not isinstance(validation, float | int):
        raise ValueError(
            f"`validation` must be a float in (0, 1), a column name or None; found {validation!r}."
        )
    if not 0 < validation < 1:
        raise ValueError(
            f"`validation` must be a fraction strictly between 0 and 1 (e.g. "
            f"0.2); found {validation!r}."
        )


def spark_kind(name: str, dtype: DataType) -> Kind:
    """(kind, numpy dtype) of a Spark column type, or a ValueError naming it."""
    from pyspark.sql import types as T

    scalars: dict[type, str] = {
        T.BooleanType: "bool",
        T.ByteType: "int8",
        T.ShortType: "int16",
        T.IntegerType: "int32",
        T.LongType: "int64",
        T.FloatType: "float32",
        T.DoubleType: "float64",
    }
    kind = type(dtype)
    if kind in scalars:
        return "scalar", scalars[kind]
    if isinstance(dtype, T.ArrayType) and type(dtype.elementType) in scalars:
        return "array", scalars[type(dtype.elementType)]
    if isinstance(dtype, T.UserDefinedType) and type(dtype).__name__ == "VectorUDT":
        return "vector", "float64"
    if isinstance(dtype, T.DecimalType):
        raise ValueError(
            f"column `{name}` has type {dtype.simpleString()}, which cannot be fed to a model "
            f"as it is: cast it to double first, e.g. "
            f"df.withColumn({name!r}, df[{name!r}].cast('double'))."
        )
    raise ValueError(
        f"column `{name}` has type {dtype.simpleString()}, which cannot be fed to a model; "
        f"supported: boolean and numeric scalars, arrays of them, and pyspark.ml.linalg "
        f"vectors. Convert it first (e.g. StringIndexer, VectorAssembler, a cast) or leave it "
        f"out of the columns."
    )


def quoted(name: str) -> str:
    """A column name quoted for Spark SQL (backticks, doubled inside)."""
    return "`" + name.replace("`", "``") + "`"
