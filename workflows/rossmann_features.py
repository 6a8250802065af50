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
    for col, fmt in FORMATS[name].items():
        if fmt.kind is WHOLE:
            value = number(col).cast(T.IntegerType())
        elif fmt.kind is REAL:
            value = number(col)
        elif fmt.kind is FLAG:
            value = number(col) != 0
        elif fmt.kind is HOLIDAY:
            value = F.trim(col).isin("a", "b", "c")
        elif fmt.kind is DATE:
            value = F.to_date(F.trim(col), "yyyy-MM-dd")
        else:
            continue
        df = df.withColumn(col, value)
    return df


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
    train_df = _joined(spark, directory, train_csv, "train.csv").cache()
    test_df = _joined(spark, directory, test_csv, "test.csv").cache()

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
    """Daily rows with store, state, trend and weather columns; no row may be lost."""
    expected = df.count()
    df = _expand_date(df)
    # A blank Open (11 rows of the real test.csv, all of one store) means open, the competition's
    # convention: only a store known to be closed that day gets 0 sales.
    df = df.withColumn("Open", F.coalesce(F.col("Open"), F.lit(True)))
    store = read_csv(spark, directory, "store.csv").join(
        read_csv(spark, directory, "store_states.csv"), "Store"
    )
    df = _check_rows(df.join(store, "Store"), expected, name, "store.csv / store_states.csv")

    trend = _google_trend(spark, directory)
    df = df.join(trend.select("State", "Year", "Week", "trend"), ["State", "Year", "Week"])
    df = _check_rows(df, expected, name, "googletrend.csv (per state)")
    trend_de = trend.filter(F.col("file") == "Rossmann_DE").select(
        "Year", "Week", F.col("trend").alias("trend_de")
    )
    df = _check_rows(df.join(trend_de, ["Year", "Week"]), expected, name, "googletrend.csv (DE)")

    weather = read_csv(spark, directory, "weather.csv").withColumn("Date", F.to_date("Date"))
    states = read_csv(spark, directory, "state_names.csv")
    weather = weather.join(states, weather.file == states.StateName).drop("file", "StateName")
    df = _check_rows(df.join(weather, ["State", "Date"]), expected, name, "weather.csv")

    df = (
        df.withColumn(
            "CompetitionOpenSinceYear", F.coalesce("CompetitionOpenSinceYear", F.lit(1900))
        )
        .withColumn("CompetitionOpenSinceMonth", F.coalesce("CompetitionOpenSinceMonth", F.lit(1)))
        .withColumn("Promo2SinceYear", F.coalesce("Promo2SinceYear", F.lit(1900)))
        .withColumn("Promo2SinceWeek", F.coalesce("Promo2SinceWeek", F.lit(1)))
    )
    # Months a competitor has been open and weeks of promo2, capped at 24 and 25.
    competition_since = F.make_date(
        F.col("CompetitionOpenSinceYear").cast("int"),
        F.col("CompetitionOpenSinceMonth").cast("int"),
        F.lit(15),
    )
    competition_days = F.when(
        F.col("CompetitionOpenSinceYear").cast("int") > 1900,
        F.greatest(F.lit(0), F.least(F.lit(360 * 2), F.datediff("Date", competition_since))),
    ).otherwise(0)
    df = df.withColumn("CompetitionMonthsOpen", (competition_days / 30).cast(T.IntegerType()))
    promo2_since = F.date_add(
        F.make_date(F.col("Promo2SinceYear").cast("int"), F.lit(1), F.lit(1)),
        (F.col("Promo2SinceWeek").cast("int") - 1) * 7,
    )
    promo2_days = F.when(
        F.col("Promo2SinceYear").cast("int") > 1900,
        F.greatest(F.lit(0), F.least(F.lit(25 * 7), F.datediff("Date", promo2_since))),
    ).otherwise(0)
    return df.withColumn("Promo2Weeks", (promo2_days / 7).cast(T.IntegerType()))


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
    return (
        df.withColumn("Year", F.year("Date"))
        .withColumn("Month", F.month("Date"))
        .withColumn("Week", F.weekofyear("Date"))
        .withColumn("Day", F.dayofmonth("Date"))
    )


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
    for col in ELAPSED_COLS:
        event_date = F.when(F.col(col), F.col("Date"))
        last = F.coalesce(
            F.last(event_date, ignorenulls=True).over(past), F.min("Date").over(store)
        )
        upcoming = F.coalesce(
            F.first(event_date, ignorenulls=True).over(future), F.max("Date").over(store)
        )
        df = df.withColumn(f"After{col}", F.datediff("Date", last))
        df = df.withColumn(f"Before{col}", F.datediff("Date", upcoming))
    return df


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
    for col, values in vocab.items():
        mapping = F.create_map(*[F.lit(x) for pair in enumerate(values) for x in pair[::-1]])
        text = F.coalesce(F.col(col).cast("string"), F.lit(MISSING))
        df = df.withColumn(col, mapping[text].cast(T.IntegerType()))
    return df


def _cast(df: DataFrame, cols: list[str]) -> DataFrame:
    for col in cols:
        df = df.withColumn(col, F.coalesce(F.col(col).cast(T.FloatType()), F.lit(0.0)))
    return df


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
