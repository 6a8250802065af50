"""Which rows of a DataFrame are for validation: a seeded random fraction, or the rows a
column flags; ``prepare_data`` and ``train_val_split`` split the same way.

pyspark is imported only inside the functions that build Spark expressions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flyte_hvd.data.columns import check_validation, quoted

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

SPLIT_SEED = 20230612  # random validation split: the same rows on every prepare
# The column that flags a row as validation while the split is being made (never stored).
SPLIT_COL = "__flyte_hvd_is_val"


def validation_flag(validation: float | str) -> Column:
    """True for the rows of the validation split: a seeded random fraction for a float, the
    true or non-zero rows of the named column (null: training) for a string."""
    from pyspark.sql import functions as F

    check_validation(validation)
    if isinstance(validation, str):
        return F.coalesce(F.col(quoted(validation)).cast("boolean"), F.lit(False))
    return F.rand(SPLIT_SEED) < float(validation)


def train_val_split(
    df: DataFrame, validation: float | str | None
) -> tuple[DataFrame, DataFrame | None, float]:
    """``(train_df, val_df, validation_ratio)``: ``df`` split the way ``prepare_data`` splits
    it (a validation column is dropped from both); ``val_df`` is None without ``validation``.
    The ratio is ``validation`` itself for a fraction, the share of validation rows (one
    count) for a column."""
    from pyspark.sql import functions as F

    if validation is None:
        return df, None, 0.0
    if isinstance(validation, str) and validation not in df.columns:
        raise ValueError(
            f"`validation` column `{validation}` is not in the DataFrame; it has {df.columns}."
        )
    flagged = df.withColumn(SPLIT_COL, validation_flag(validation))
    if isinstance(validation, str):
        flagged = flagged.drop(validation)
    is_val = F.col(SPLIT_COL)
    train = flagged.filter(~is_val).drop(SPLIT_COL)
    val = flagged.filter(is_val).drop(SPLIT_COL)
    if not isinstance(validation, str):
        return train, val, float(validation)
    counts = flagged.agg(F.count(F.lit(1)), F.sum(is_val.cast("int"))).collect()[0]
    return train, val, (counts[1] or 0) / counts[0] if counts[0] else 0.0


def split_part(df: DataFrame, split: str, validation: float | str | None) -> DataFrame:
    """The rows of ``split`` ("train" or "val") of ``df``, which carries ``SPLIT_COL`` when
    there is a ``validation``; without the flag column."""
    if validation is None:
        return df
    from pyspark.sql import functions as F

    is_val = F.col(SPLIT_COL)
    return df.filter(is_val if split == "val" else ~is_val).drop(SPLIT_COL)
