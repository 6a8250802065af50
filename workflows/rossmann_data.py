"""The Rossmann store sales dataset: its seven CSV files, fetching them, and a synthetic twin.

``fetch_dataset(source, dest)`` puts the seven files of the Kaggle competition (plus the
external state, trend and weather files of the fast.ai preparation) into ``dest`` from an
``http(s)://``, ``s3://`` or ``file://`` URL of a ``.tgz``/``.tar.gz``/``.zip`` archive, or from a
local directory, and checks each file's columns against ``SCHEMA``.

``write_synthetic(dest)`` writes the same files, columns and value formats with a learnable
structure, for machines without the real data: sales depend on a per-store level, the store
type and assortment, the day of week, promotions, state and school holidays, competition, a
yearly season, the state's weather and a trend, with multiplicative noise.
"""

from __future__ import annotations

import csv
import os
import shutil
import tarfile
import tempfile
import zipfile

import numpy as np
import pandas as pd

from workflows.rossmann_formats import FORMATS, unreadable

# Each file's columns, in the file's order (their formats: ``rossmann_formats.FORMATS``).
SCHEMA: dict[str, list[str]] = {name: list(columns) for name, columns in FORMATS.items()}

TRAIN_START, TRAIN_END = "2013-01-01", "2015-07-31"
TEST_START, TEST_END = "2015-08-01", "2015-09-17"

# State name -> code, as in the external data (Bremen's stores are listed with Lower Saxony).
STATES: dict[str, str] = {
    "BadenWuerttemberg": "BW", "Bayern": "BY", "Berlin": "BE", "Brandenburg": "BB",
    "Bremen": "HB", "Hamburg": "HH", "Hessen": "HE", "MecklenburgVorpommern": "MV",
    "Niedersachsen": "HB,NI", "NordrheinWestfalen": "NW", "RheinlandPfalz": "RP",
    "Saarland": "SL", "Sachsen": "SN", "SachsenAnhalt": "ST", "SchleswigHolstein": "SH",
    "Thueringen": "TH",
}  # fmt: skip
STORE_STATES = ["BE", "BW", "BY", "HB,NI", "HE", "HH", "NW", "RP", "SH", "SN", "ST", "TH"]
PROMO_INTERVALS = ["Jan,Apr,Jul,Oct", "Feb,May,Aug,Nov", "Mar,Jun,Sept,Dec"]
ARCHIVE_SUFFIXES = (".tgz", ".tar.gz", ".zip")


class DatasetError(ValueError):
    """The dataset source is missing, not an archive, or its files do not match ``SCHEMA``."""


# -- fetching and checking ---------------------------------------------------------------------


def fetch_dataset(source: str, dest: str) -> str:
    """Put the dataset's files from ``source`` into ``dest`` and check them; returns ``dest``."""
    import fsspec

    os.makedirs(dest, exist_ok=True)
    path = source[len("file://") :] if source.startswith("file://") else source
    if "://" not in path and os.path.isdir(path):
        for name in SCHEMA:
            if os.path.exists(os.path.join(path, name)):
                shutil.copyfile(os.path.join(path, name), os.path.join(dest, name))
    else:
        if not source.lower().endswith(ARCHIVE_SUFFIXES):
            raise DatasetError(
                f"dataset {source!r} is neither a local directory nor a "
                f"{'/'.join(ARCHIVE_SUFFIXES)} archive. Pass 'synthetic', a directory holding "
                f"{', '.join(SCHEMA)}, or the URL of an archive of them."
            )
        with tempfile.TemporaryDirectory() as tmp:
            archive = os.path.join(tmp, os.path.basename(source.rstrip("/")))
            try:
                with fsspec.open(source, "rb") as src, open(archive, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 20)
            except (FileNotFoundError, OSError) as error:
                raise DatasetError(
                    f"cannot read dataset archive {source!r}: {type(error).__name__}: {error}. "
                    f"Check the URL (and credentials for s3://)."
                ) from error
            _extract(archive, source, dest)
    check_dataset(dest)
    return dest


def _extract(archive: str, source: str, dest: str) -> None:
    """Extract the schema's files wherever they sit in the archive (often under a folder)."""
    try:
        if archive.lower().endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                members = {os.path.basename(n): n for n in zf.namelist()}
                for name in SCHEMA.keys() & members.keys():
                    with zf.open(members[name]) as src, open(os.path.join(dest, name), "wb") as out:
                        shutil.copyfileobj(src, out)
        else:
            with tarfile.open(archive, "r:gz") as tf:
                members = {os.path.basename(m.name): m for m in tf.getmembers() if m.isfile()}
                for name in SCHEMA.keys() & members.keys():
                    with (
                        tf.extractfile(members[name]) as src,
                        open(os.path.join(dest, name), "wb") as out,
                    ):
                        shutil.copyfileobj(src, out)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as error:
        raise DatasetError(
            f"dataset {source!r} is not a readable archive ({type(error).__name__}: {error})."
        ) from error


def check_dataset(directory: str) -> None:
    """Every file of ``SCHEMA`` exists in ``directory`` with (at least) its columns, and every
    value of those columns reads as its ``FORMATS`` entry says (quoted or not)."""
    missing = [name for name in SCHEMA if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise DatasetError(
            f"the dataset lacks {', '.join(missing)} (expected all of {', '.join(SCHEMA)}); "
            f"found {sorted(os.listdir(directory)) or 'no files'}."
        )
    for name, columns in SCHEMA.items():
        with open(os.path.join(directory, name), newline="") as f:
            header = next(csv.reader(f), [])
        absent = [c for c in columns if c not in header]
        if absent:
            raise DatasetError(
                f"{name} lacks the column(s) {absent}; it has {header}. The file must have "
                f"the columns {columns}."
            )
        check_values(directory, name)


def check_values(directory: str, name: str) -> None:
    """Fail on the first value of ``name`` that its column's format cannot read, naming the
    file, the column, the row and the value."""
    formats = FORMATS[name]
    frame = pd.read_csv(
        os.path.join(directory, name), dtype=str, keep_default_na=False, usecols=list(formats)
    )
    for column, fmt in formats.items():
        bad = unreadable(frame[column], fmt)
        if not bad.any():
            continue
        index = int(bad.to_numpy().argmax())
        others = int(bad.sum()) - 1
        blank = " or blank" if fmt.blank else ""
        raise DatasetError(
            f"{name}, column `{column}`, row {index + 1} (the header is row 0): cannot read "
            f"{frame[column].iloc[index]!r}; expected {fmt.kind.expected}{blank}"
            + (f" ({others} more value(s) in this column cannot be read either)" if others else "")
            + f". Correct {name} and run again."
        )


# -- the synthetic dataset ---------------------------------------------------------------------


def write_synthetic(dest: str, stores: int = 45, seed: int = 0) -> str:
    """Write a Rossmann-format dataset of ``stores`` stores into ``dest``; returns ``dest``."""
    rng = np.random.default_rng(seed)
    os.makedirs(dest, exist_ok=True)
    store = _stores(rng, stores)
    states = pd.DataFrame({"Store": store.Store, "State": rng.choice(STORE_STATES, size=stores)})
    weather = _weather(rng)
    trend = _trend(rng)
    days = pd.date_range(TRAIN_START, TEST_END, freq="D")
    frame = _daily(rng, store, states, weather, trend, days)
    train = frame[frame.Date <= pd.Timestamp(TRAIN_END)].copy()
    test = frame[frame.Date >= pd.Timestamp(TEST_START)].reset_index(drop=True)
    test = test.assign(Id=np.arange(1, len(test) + 1))
    # The real test.csv leaves Open blank on 11 days of one store (store 622), days it was open.
    gaps = test[(test.Store == rng.integers(1, stores + 1)) & (test.Open == 1)].index[:11]
    test["Open"] = test.Open.astype(float).mask(test.index.isin(gaps))
    for df in (train, test):
        df["Date"] = df.Date.dt.strftime("%Y-%m-%d")
    train = train.sort_values(["Date", "Store"], ascending=[False, True])
    years = [c for c in store.columns if c.endswith(("Month", "Year", "Week", "Distance"))]

    # Each file as the real one writes it: the Kaggle files quote their header and their text
    # values (train.csv also its holiday columns: "0", "a"), test.csv writes Open as 1.0, 0.0
    # or blank and StateHoliday unquoted (0, a), the fast.ai files quote only what holds a comma.
    def write(name: str, df: pd.DataFrame, quoted: tuple[str, ...] = (), kaggle: bool = True):
        _write_csv(os.path.join(dest, name), df[SCHEMA[name]], quoted, quote_header=kaggle)

    write("train.csv", train, quoted=("StateHoliday", "SchoolHoliday"))
    write("test.csv", test)
    texts = ("StoreType", "Assortment", "PromoInterval")
    write("store.csv", store.astype(dict.fromkeys(years, "Int64")), quoted=texts)
    write("store_states.csv", states, kaggle=False)
    names = pd.DataFrame({"StateName": list(STATES), "State": list(STATES.values())})
    write("state_names.csv", names, kaggle=False)
    write("googletrend.csv", trend.assign(week=trend.week_label), kaggle=False)
    write("weather.csv", weather.assign(Date=weather.Date.dt.strftime("%Y-%m-%d")), kaggle=False)
    check_dataset(dest)
    return dest


def _write_csv(path: str, df: pd.DataFrame, quoted: tuple[str, ...], quote_header: bool) -> None:
    """``df`` as CSV: whole numbers as 7, floats as 7.0 or 5.08 (never -0.0), missing values
    blank; the ``quoted`` columns (and the header when ``quote_header``) in double quotes, any
    other value only when it holds a comma or a quote."""

    def quote(text: pd.Series, always: bool) -> pd.Series:
        needs = text.str.contains('[,"\n]') | always
        return text.where(~needs, '"' + text.str.replace('"', '""') + '"')

    columns = []
    for name in df.columns:
        values = df[name]
        if pd.api.types.is_float_dtype(values):
            text = values.map(lambda v: "" if pd.isna(v) else repr(float(v) + 0.0))
        else:
            text = values.astype(object).where(values.notna(), "").astype(str)
        columns.append(quote(text, name in quoted))
    header = quote(pd.Series(list(df.columns)), quote_header)
    with open(path, "w", newline="") as f:
        f.write(",".join(header) + "\n")
        if len(df):
            lines = columns[0].str.cat(columns[1:], sep=",")
            f.write("\n".join(lines) + "\n")


def _stores(rng: np.random.Generator, n: int) -> pd.DataFrame:
    has_competition = rng.random(n) < 0.7
    has_promo2 = rng.random(n) < 0.5
    return pd.DataFrame(
        {
            "Store": np.arange(1, n + 1),
            "StoreType": rng.choice(list("abcd"), size=n, p=[0.5, 0.1, 0.15, 0.25]),
            "Assortment": rng.choice(list("abc"), size=n, p=[0.5, 0.05, 0.45]),
            "CompetitionDistance": np.where(
                rng.random(n) < 0.98, np.round(rng.lognormal(7.5, 1.2, n), -1), np.nan
            ),
            "CompetitionOpenSinceMonth": np.where(has_competition, rng.integers(1, 13, n), np.nan),
            "CompetitionOpenSinceYear": np.where(
                has_competition, rng.integers(2005, 2016, n), np.nan
            ),
            "Promo2": has_promo2.astype(int),
            "Promo2SinceWeek": np.where(has_promo2, rng.integers(1, 50, n), np.nan),
            "Promo2SinceYear": np.where(has_promo2, rng.integers(2010, 2016, n), np.nan),
            "PromoInterval": np.where(has_promo2, rng.choice(PROMO_INTERVALS, size=n), ""),
        }
    )


def _weather(rng: np.random.Generator) -> pd.DataFrame:
    days = pd.date_range(TRAIN_START, TEST_END, freq="D")
    season = np.cos(2 * np.pi * (days.dayofyear.to_numpy() - 200) / 365.25)
    frames = []
    for name in STATES:
        # Whole degrees, percent and km/h as in the real file; gusts, cloud cover (both with
        # gaps), visibility and rain are written as floats.
        mean = np.round(10 + 9 * season + rng.normal(0, 3, len(days))).astype(int)
        humidity = np.clip(np.round(75 - 10 * season + rng.normal(0, 8, len(days))), 20, 100)
        humidity = humidity.astype(int)
        rain = np.round(np.maximum(0, rng.normal(0, 4, len(days))), 2)
        cloud = np.clip(np.round(4 + rain / 2 + rng.normal(0, 1.5, len(days))), 0, 8)
        events = np.select(
            [rain > 6, rain > 2, (mean < 0) & (rain > 0)],
            ["Rain-Thunderstorm", "Rain", "Snow"],
            "",
        )
        wind = np.round(np.abs(rng.normal(12, 5, len(days)))).astype(int)
        frames.append(
            pd.DataFrame(
                {
                    "file": name,
                    "Date": days,
                    "Max_TemperatureC": mean + 5,
                    "Mean_TemperatureC": mean,
                    "Min_TemperatureC": mean - 5,
                    "Dew_PointC": mean - 4,
                    "MeanDew_PointC": mean - 5,
                    "Min_DewpointC": mean - 7,
                    "Max_Humidity": np.minimum(100, humidity + 12),
                    "Mean_Humidity": humidity,
                    "Min_Humidity": np.maximum(5, humidity - 25),
                    "Max_Sea_Level_PressurehPa": 1020,
                    "Mean_Sea_Level_PressurehPa": 1015,
                    "Min_Sea_Level_PressurehPa": 1010,
                    "Max_VisibilityKm": 31.0,
                    "Mean_VisibilityKm": 12.0,
                    "Min_VisibilitykM": 4.0,
                    "Max_Wind_SpeedKm_h": wind + 10,
                    "Mean_Wind_SpeedKm_h": wind,
                    "Max_Gust_SpeedKm_h": np.where(wind > 15, wind + 25, np.nan),
                    "Precipitationmm": rain,
                    "CloudCover": cloud,
                    "Events": events,
                    "WindDirDegrees": rng.integers(0, 360, len(days)),
                }
            )
        )
    weather = pd.concat(frames, ignore_index=True)
    weather["CloudCover"] = weather.CloudCover.mask(rng.random(len(weather)) < 0.05)
    return weather


def _trend(rng: np.random.Generator) -> pd.DataFrame:
    """Weekly Google trend per state (``Rossmann_DE_<code>``) and Germany-wide
    (``Rossmann_DE``), weeks Sunday to Saturday as in the real file."""
    sundays = pd.date_range("2012-12-02", "2015-09-27", freq="W-SUN")
    labels = [f"{d:%Y-%m-%d} - {d + pd.Timedelta(days=6):%Y-%m-%d}" for d in sundays]
    codes = sorted({code.split(",")[-1] for code in STATES.values()})
    frames = []
    for file in ["Rossmann_DE"] + [f"Rossmann_DE_{code}" for code in codes]:
        level = 55 + 10 * np.sin(np.arange(len(sundays)) / 8) + rng.normal(0, 4, len(sundays))
        frames.append(
            pd.DataFrame(
                {
                    "file": file,
                    "week_label": labels,
                    "Sunday": sundays,
                    "trend": np.clip(np.round(level), 0, 100).astype(int),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def _daily(
    rng: np.random.Generator,
    store: pd.DataFrame,
    states: pd.DataFrame,
    weather: pd.DataFrame,
    trend: pd.DataFrame,
    days: pd.DatetimeIndex,
) -> pd.DataFrame:
    n, d = len(store), len(days)
    grid = (
        pd.DataFrame({"Store": np.repeat(store.Store.to_numpy(), d), "Date": np.tile(days, n)})
        .merge(store, on="Store")
        .merge(states, on="Store")
    )
    dow = grid.Date.dt.dayofweek.to_numpy() + 1  # 1 = Monday, as in the real data
    grid["DayOfWeek"] = dow
    # Promo runs in alternate weeks, Monday to Friday; holidays are shared by state.
    week = grid.Date.dt.isocalendar().week.to_numpy().astype(int)
    grid["Promo"] = ((week % 2 == 0) & (dow <= 5)).astype(int)
    holiday_days = rng.choice(days, size=30, replace=False)
    kinds = rng.choice(["a", "a", "a", "b", "c"], size=len(holiday_days))
    # One public holiday falls in the test period, as 2015-08-15 does in some states.
    holiday_days[0], kinds[0] = rng.choice(days[days >= pd.Timestamp(TEST_START)]), "a"
    grid["StateHoliday"] = (
        grid.Date.map(dict(zip(holiday_days, kinds, strict=True))).fillna("0").astype(str)
    )
    school = (
        np.isin(grid.Date.dt.month.to_numpy(), [7, 8])
        | ((grid.Date.dt.month == 12) & (grid.Date.dt.day > 22)).to_numpy()
    )
    grid["SchoolHoliday"] = school.astype(int)
    grid["Open"] = ((dow != 7) & (grid.StateHoliday == "0")).astype(int)
    closed = rng.random(len(grid)) < 0.01  # refurbishments
    grid.loc[closed, "Open"] = 0

    name_of = {code: name for name, code in STATES.items() if name != "Bremen"}
    wx = weather.assign(StateName=weather.file)[
        ["StateName", "Date", "Mean_TemperatureC", "Precipitationmm"]
    ]
    grid = grid.assign(StateName=grid.State.map(name_of)).merge(wx, on=["StateName", "Date"])
    sunday = grid.Date - pd.to_timedelta(grid.Date.dt.dayofweek + 1, unit="D")
    de = trend[trend.file == "Rossmann_DE"].set_index("Sunday").trend
    grid["trend_de"] = sunday.map(de).fillna(55).to_numpy()

    level = dict(zip(store.Store, rng.lognormal(8.6, 0.35, n), strict=True))
    type_effect = {"a": 1.0, "b": 1.6, "c": 1.05, "d": 0.95}
    assortment_effect = {"a": 1.0, "b": 0.85, "c": 1.1}
    dow_effect = np.array([1.15, 1.0, 0.97, 0.98, 1.05, 0.9, 0.6])[dow - 1]
    competition = np.where(
        (
            grid.CompetitionOpenSinceYear.fillna(2100).to_numpy() * 12
            + grid.CompetitionOpenSinceMonth.fillna(1).to_numpy()
        )
        <= grid.Date.dt.year.to_numpy() * 12 + grid.Date.dt.month.to_numpy(),
        1 - 0.12 * np.exp(-grid.CompetitionDistance.fillna(1e5).to_numpy() / 3000),
        1.0,
    )
    doy = grid.Date.dt.dayofyear.to_numpy()
    season = (
        1
        + 0.08 * np.cos(2 * np.pi * (doy - 355) / 365.25)
        + 0.25 * ((grid.Date.dt.month == 12) & (grid.Date.dt.day.between(14, 23))).to_numpy()
    )
    years = (grid.Date - pd.Timestamp(TRAIN_START)).dt.days.to_numpy() / 365.25
    sales = (
        grid.Store.map(level).to_numpy()
        * grid.StoreType.map(type_effect).to_numpy()
        * grid.Assortment.map(assortment_effect).to_numpy()
        * dow_effect
        * (1 + 0.3 * grid.Promo.to_numpy())
        * (1 + 0.06 * grid.SchoolHoliday.to_numpy())
        * competition
        * season
        * (1 + 0.04 * years)
        * (1 - 0.01 * np.clip(grid.Precipitationmm.to_numpy(), 0, 10))
        * (1 + 0.004 * (grid.trend_de.to_numpy() - 55))
        * rng.lognormal(0, 0.05, len(grid))
    )
    grid["Sales"] = np.where(grid.Open == 1, np.round(sales), 0).astype(int)
    grid["Customers"] = np.where(grid.Open == 1, np.round(sales / 9.5), 0).astype(int)
    return grid.sort_values(["Date", "Store"], ignore_index=True)
