"""Feature preparation for Rossmann in Spark, as in Horovod's Keras Rossmann example.

Joins store, store states, Google trend (per state and Germany-wide) and weather onto the daily
rows; expands dates; counts days before/after promotions and holidays; caps competition months
open at 24 and promo2 weeks at 25; fixes nulls; maps categorical columns to indices through a
vocabulary; casts continuous columns to float; takes the log of sales; flags the test period of
one year earlier as validation. Every join is checked not to lose rows.
"""

from __future__ import annotations

import datetime
import os

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from workflows.driver_csv import read_csv_on_driver
from workflows.rossmann_formats import DATE, FLAG, FORMATS, HOLIDAY, REAL, WHOLE

CATEGORICAL_COLS = [
    "Store", "State", "DayOfWeek", "Year", "Month", "Day", "Week", "CompetitionMonthsOpen",
    "Promo2Weeks", "StoreType", "Assortment", "PromoInterval", "CompetitionOpenSinceYear",
    "Promo2SinceYear", "Events", "Promo", "StateHoliday", "SchoolHoliday",
]  # fmt: skip
CONTINUOUS_COLS = [
    "CompetitionDistance", "Max_TemperatureC", "Mean_TemperatureC", "Min_TemperatureC",
    "Max_Humidity", "Mean_Humidity", "Min_Humidity", "Max_Wind_SpeedKm_h",
    "Mean_Wind_SpeedKm_h", "CloudCover", "trend", "trend_de", "BeforePromo", "AfterPromo",
    "AfterStateHoliday", "BeforeStateHoliday", "BeforeSchoolHoliday", "AfterSchoolHoliday",
]  # fmt: skip
FEATURE_COLS = CATEGORICAL_COLS + CONTINUOUS_COLS
ELAPSED_COLS = ["Promo", "StateHoliday", "SchoolHoliday"]
MISSING = "<missing>"  # vocabulary entry of an empty categorical value


class LostRowsError(RuntimeError):
    """A join dropped rows: a store, state, week or date has no match in the joined file."""


def read_csv(spark: SparkSession, directory: str, name: str) -> DataFrame:
    """A CSV file read as the tutorial reads it (header row, every value a string), then each
    column by its meaning (``typed``). Read on the driver, whose disk holds ``directory``
    (``driver_csv``): executors on other hosts cannot see it."""
    df = read_csv_on_driver(spark, os.path.join(directory, name))
    return typed(df, name)


def number(col: str | Column) -> Column:
    """``rossmann_formats.parse_number`` as a Spark expression: a double from ``1``, ``1.0`` or
    `` 1.0 ``; null from a blank. (``check_dataset`` has refused anything else before Spark.)"""
    return F.trim(F.col(col) if isinstance(col, str) else col).try_cast(T.DoubleType())


def typed(df: DataFrame, name: str) -> DataFrame:
    """The columns of file ``name`` by their ``FORMATS``, whatever their spelling: whole numbers
    as int, numbers as double, 0/1 flags as boolean, ``StateHoliday`` as boolean (a, b, c are
    holidays; 0 is none), dates as date; a blank is null. Other columns stay text."""
    columns: dict[str, Column] = {}
    for col, fmt in FORMATS[name].items():
        if fmt.kind is WHOLE:
            columns[col] = number(col).cast(T.IntegerType())
        elif fmt.kind is REAL:
            columns[col] = number(col)
        elif fmt.kind is FLAG:
            columns[col] = number(col) != 0
        elif fmt.kind is HOLIDAY:
            columns[col] = F.trim(col).isin("a", "b", "c")
        elif fmt.kind is DATE:
            columns[col] = F.to_date(F.trim(col), "yyyy-MM-dd")
    # One projection: Spark analyses the whole plan again for each withColumn.
    return df.withColumns(columns)


def prepare_frames(
    spark: SparkSession, directory: str, sample_rate: float = 1.0, seed: int = 0
) -> tuple[DataFrame, DataFrame, dict[str, list[str]], float, float]:
    """``(train, test, vocabulary, max_sales, mean_sales)`` from the CSV files in ``directory``.

    ``train`` has the feature columns, ``Sales`` (log), ``Date`` and a boolean ``Validation``;
    ``test`` the feature columns, ``Id``, ``Date`` and the boolean ``Open``. ``max_sales`` and
    ``mean_sales`` are the largest and mean log sale of the training (non-validation) rows,
    which set the model's output range and starting point."""
    train_csv = read_csv(spark, directory, "train.csv")
    test_csv = read_csv(spark, directory, "test.csv")
    if sample_rate < 1.0:
        train_csv = train_csv.sample(withReplacement=False, fraction=sample_rate, seed=seed)
    train_df = _joined(spark, directory, train_csv, "train.csv")
    test_df = _joined(spark, directory, test_csv, "test.csv")

    # Elapsed days around promotions and holidays, over training and test dates together.
    keys = ["Date", "Store", *ELAPSED_COLS]
    elapsed = _add_elapsed(train_df.select(*keys).unionByName(test_df.select(*keys)))
    extra = [f"{p}{c}" for p in ("Before", "After") for c in ELAPSED_COLS]
    elapsed = elapsed.select("Date", "Store", *extra)
    train_df = train_df.join(elapsed, ["Date", "Store"])
    test_df = test_df.join(elapsed, ["Date", "Store"])
    train_df = train_df.filter(F.col("Sales").cast("double") > 0)

    vocab = build_vocabulary(
        train_df.select(*CATEGORICAL_COLS).unionByName(test_df.select(*CATEGORICAL_COLS))
    )
    train_df = _lookup(_cast(train_df, [*CONTINUOUS_COLS, "Sales"]), vocab)
    test_df = _lookup(_cast(test_df, CONTINUOUS_COLS), vocab)

    # Validation: the test period, one year earlier.
    bounds = test_df.agg(F.min("Date"), F.max("Date")).first()
    one_year = datetime.timedelta(days=365)
    train_df = train_df.withColumn(
        "Validation",
        (F.col("Date") > F.lit(bounds[0] - one_year))
        & (F.col("Date") <= F.lit(bounds[1] - one_year)),
    )
    train_df = train_df.withColumn("Sales", F.log(F.col("Sales")).cast(T.FloatType()))
    max_sales, mean_sales = (
        train_df.filter(~F.col("Validation")).agg(F.max("Sales"), F.avg("Sales")).first()
    )
    train_df = train_df.select(*FEATURE_COLS, "Sales", "Date", "Validation")
    test_df = test_df.select(*FEATURE_COLS, F.col("Id").cast("int").alias("Id"), "Date", "Open")
    return train_df, test_df, vocab, float(max_sales), float(mean_sales)


def _joined(spark: SparkSession, directory: str, df: DataFrame, name: str) -> DataFrame:
    """Daily rows with store, state, trend and weather columns, cached; no row may be lost."""
    df = _expand_date(df)
    # A blank Open (11 rows of the real test.csv, all of one store) means open, the competition's
    # convention: only a store known to be closed that day gets 0 sales.
    df = df.withColumn("Open", F.coalesce(F.col("Open"), F.lit(True)))
    store = read_csv(spark, directory, "store.csv").join(
        read_csv(spark, directory, "store_states.csv"), "Store"
    )
    trend = _google_trend(spark, directory)
    trend_de = trend.filter(F.col("file") == "Rossmann_DE").select(
        "Year", "Week", F.col("trend").alias("trend_de")
    )
    weather = read_csv(spark, directory, "weather.csv").withColumn("Date", F.to_date("Date"))
    states = read_csv(spark, directory, "state_names.csv")
    weather = weather.join(states, weather.file == states.StateName).drop("file", "StateName")
    joins = [
        ("store.csv / store_states.csv", store, ["Store"]),
        ("googletrend.csv (per state)", trend.select("State", "Year", "Week", "trend"),
         ["State", "Year", "Week"]),
        ("googletrend.csv (DE)", trend_de, ["Year", "Week"]),
        ("weather.csv", weather, ["State", "Date"]),
    ]  # fmt: skip
    return _with_competition(_checked_joins(df, joins, name))


def _checked_joins(df: DataFrame, joins: list, name: str) -> DataFrame:
    """``df`` joined with each ``(label, right, keys)`` in turn, cached, checked in one Spark
    job that every row found exactly one match in each; otherwise ``LostRowsError`` naming the
    first join that lost (or multiplied) rows, found by counting after each join."""
    checked = df.withColumn("_row", F.monotonically_increasing_id())
    for i, (_, right, keys) in enumerate(joins):
        checked = checked.join(right.withColumn(f"_in{i}", F.lit(True)), keys, "left")
    checked = checked.cache()
    unmatched = F.lit(False)
    for i in range(len(joins)):
        unmatched = unmatched | F.col(f"_in{i}").isNull()
    rows, distinct, lost = checked.agg(
        F.count(F.lit(1)), F.count_distinct("_row"), F.sum(unmatched.cast("int"))
    ).first()
    if rows != distinct or lost:
        checked.unpersist()
        expected = df.count()
        for label, right, keys in joins:
            df = _check_rows(df.join(right, keys), expected, name, label)
    return checked.drop("_row", *(f"_in{i}" for i in range(len(joins))))


def _with_competition(df: DataFrame) -> DataFrame:
    """Months a competitor has been open and weeks of promo2, capped at 24 and 25."""
    df = df.withColumns({
        "CompetitionOpenSinceYear": F.coalesce("CompetitionOpenSinceYear", F.lit(1900)),
        "CompetitionOpenSinceMonth": F.coalesce("CompetitionOpenSinceMonth", F.lit(1)),
        "Promo2SinceYear": F.coalesce("Promo2SinceYear", F.lit(1900)),
        "Promo2SinceWeek": F.coalesce("Promo2SinceWeek", F.lit(1)),
    })  # fmt: skip
    competition_since = F.make_date(
        F.col("CompetitionOpenSinceYear").cast("int"),
        F.col("CompetitionOpenSinceMonth").cast("int"),
        F.lit(15),
    )
    competition_days = F.when(
        F.col("CompetitionOpenSinceYear").cast("int") > 1900,
        F.greatest(F.lit(0), F.least(F.lit(360 * 2), F.datediff("Date", competition_since))),
    ).otherwise(0)
    promo2_since = F.date_add(
        F.make_date(F.col("Promo2SinceYear").cast("int"), F.lit(1), F.lit(1)),
        (F.col("Promo2SinceWeek").cast("int") - 1) * 7,
    )
    promo2_days = F.when(
        F.col("Promo2SinceYear").cast("int") > 1900,
        F.greatest(F.lit(0), F.least(F.lit(25 * 7), F.datediff("Date", promo2_since))),
    ).otherwise(0)
    return df.withColumns({
        "CompetitionMonthsOpen": (competition_days / 30).cast(T.IntegerType()),
        "Promo2Weeks": (promo2_days / 7).cast(T.IntegerType()),
    })  # fmt: skip


def _check_rows(df: DataFrame, expected: int, name: str, joined: str) -> DataFrame:
    found = df.count()
    if found != expected:
        raise LostRowsError(
            f"joining {joined} onto {name} kept {found} of its {expected} rows: some rows have "
            f"no match (a store without a state or store entry, a state or week without a "
            f"trend, a state and date without weather). Complete {joined}."
        )
    return df


def _expand_date(df: DataFrame) -> DataFrame:
    return df.withColumns({
        "Year": F.year("Date"), "Month": F.month("Date"), "Week": F.weekofyear("Date"),
        "Day": F.dayofmonth("Date"),
    })  # fmt: skip


def _google_trend(spark: SparkSession, directory: str) -> DataFrame:
    """Weekly trend keyed by state, with ``Year``/``Week`` of the week's first day; the trend
    of ``Rossmann_DE_NI`` belongs to the stores listed as ``HB,NI``."""
    trend = read_csv(spark, directory, "googletrend.csv")
    trend = trend.withColumn("Date", F.to_date(F.regexp_extract("week", r"(.*?) -", 1)))
    state = F.regexp_extract("file", r"Rossmann_DE_(.*)", 1)
    trend = trend.withColumn("State", F.when(state == "NI", "HB,NI").otherwise(state))
    trend = _expand_date(trend).withColumn("trend", F.col("trend").cast("double") / 100)
    return trend


def _add_elapsed(df: DataFrame) -> DataFrame:
    """Days since the last and until the next day of each event, per store (``After<col>``
    >= 0, ``Before<col>`` <= 0); without an event so far, counted from the store's first (or
    to its last) day."""
    past = Window.partitionBy("Store").orderBy("Date").rowsBetween(Window.unboundedPreceding, 0)
    future = Window.partitionBy("Store").orderBy("Date").rowsBetween(0, Window.unboundedFollowing)
    store = Window.partitionBy("Store")
    columns: dict[str, Column] = {}
    for col in ELAPSED_COLS:
        event_date = F.when(F.col(col), F.col("Date"))
        last = F.coalesce(
            F.last(event_date, ignorenulls=True).over(past), F.min("Date").over(store)
        )
        upcoming = F.coalesce(
            F.first(event_date, ignorenulls=True).over(future), F.max("Date").over(store)
        )
        columns[f"After{col}"] = F.datediff("Date", last)
        columns[f"Before{col}"] = F.datediff("Date", upcoming)
    return df.withColumns(columns)


def build_vocabulary(df: DataFrame) -> dict[str, list[str]]:
    """Sorted distinct values of each column, as strings (empty values as ``MISSING``)."""
    as_text = df.select(
        *[F.coalesce(F.col(c).cast("string"), F.lit(MISSING)).alias(c) for c in df.columns]
    )
    values = as_text.select(*[F.collect_set(c).alias(c) for c in df.columns]).first()
    return {c: sorted(values[c], key=_natural) for c in df.columns}


def _natural(value: str) -> tuple:
    """Numbers in numeric order, then text."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def _lookup(df: DataFrame, vocab: dict[str, list[str]]) -> DataFrame:
    """Categorical values replaced by their index in the vocabulary."""
    columns = {}
    for col, values in vocab.items():
        mapping = F.create_map(*[F.lit(x) for pair in enumerate(values) for x in pair[::-1]])
        text = F.coalesce(F.col(col).cast("string"), F.lit(MISSING))
        columns[col] = mapping[text].cast(T.IntegerType())
    return df.withColumns(columns)


def _cast(df: DataFrame, cols: list[str]) -> DataFrame:
    return df.withColumns(
        {col: F.coalesce(F.col(col).cast(T.FloatType()), F.lit(0.0)) for col in cols}
    )


def submission_sales(open_col: str = "Open", predicted: str = "Predicted") -> Column:
    """The sale to submit: exactly 0 where the store is closed, else the model's sale (the exp
    of its log-sales prediction, so always > 0). A null ``Open`` counts as open, the
    convention for test.csv's blanks."""
    return F.when(~F.col(open_col), F.lit(0.0)).otherwise(F.exp(F.col(predicted)))


def baseline_rmspe(train_df: DataFrame) -> float:
    """RMSPE on the validation rows of the naive forecast: each store's median sales on that
    day of week over the training period (the non-validation rows)."""
    sales = F.exp(F.col("Sales"))
    history = train_df.filter(~F.col("Validation"))
    medians = history.groupBy("Store", "DayOfWeek").agg(
        F.percentile_approx(sales, 0.5, 10_000).alias("Forecast")
    )
    overall = history.agg(F.percentile_approx(sales, 0.5, 10_000)).first()[0]
    validation = train_df.filter(F.col("Validation")).join(medians, ["Store", "DayOfWeek"], "left")
    validation = validation.withColumn("Forecast", F.coalesce("Forecast", F.lit(overall)))
    return rmspe(validation.withColumn("Actual", sales), "Actual", "Forecast")


def rmspe(df: DataFrame, actual: str, forecast: str) -> float:
    """Root mean square percentage error, Kaggle's Rossmann metric, over rows with sales."""
    error = ((F.col(actual) - F.col(forecast)) / F.col(actual)) ** 2
    value = df.filter(F.col(actual) > 0).agg(F.sqrt(F.avg(error))).first()[0]
    if value is None:
        raise ValueError("no rows with sales to score: the validation split is empty.")
    return float(value)
