"""How the Rossmann files write their values, and what the values mean.

The Kaggle files and the fast.ai external files write one kind of value in several ways: a
number as ``1``, ``1.0`` or blank (``test.csv`` writes ``Open`` as ``1.0``/``0.0`` and leaves it
blank on a few rows; ``weather.csv`` writes ``CloudCover`` as ``6.0`` or blank), fields quoted or
not (``"0"`` and ``0``), ``StateHoliday`` as ``0``, ``a``, ``b`` or ``c``. So every column is read
by its meaning, never by its spelling:

- ``FORMATS`` gives each file's columns, what each means (its ``Kind``) and whether it may be
  blank. ``rossmann_data.check_dataset`` checks every value against it before Spark starts.
- ``parse_number`` is the one parser of numbers; ``rossmann_features.number`` is the same rule
  as a Spark expression (a test holds the two to the same answers).

Quoting is the CSV reader's business (pandas and Spark both unquote), so a value is checked
and parsed after unquoting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"  # 1, -3, 1.0, 1., .5, 5.08 (no exponent, no grouping)


@dataclass(frozen=True)
class Kind:
    """What a column's values mean: ``pattern`` matches a written (non-blank) value in full,
    ``expected`` says how to write one."""

    name: str
    pattern: str
    expected: str


WHOLE = Kind("whole", r"[+-]?\d+(?:\.0*)?", "a whole number written like 7 or 7.0")
REAL = Kind("number", NUMBER, "a number written like 7, 7.0 or 5.08")
FLAG = Kind("flag", r"[01](?:\.0*)?", "0 or 1 (also written 0.0 or 1.0)")
HOLIDAY = Kind("holiday", r"0(?:\.0*)?|[abc]", "0 (none), a (public), b (Easter) or c (Christmas)")
DATE = Kind("date", r"\d{4}-\d\d-\d\d", "a date written YYYY-MM-DD")
WEEK = Kind("week", r"\d{4}-\d\d-\d\d - \d{4}-\d\d-\d\d", "a week written 2015-08-02 - 2015-08-08")
TEXT = Kind("text", r"(?s).*", "text")


@dataclass(frozen=True)
class Format:
    kind: Kind
    blank: bool = False  # whether a blank value is allowed (it reads as missing)


def _f(kind: Kind, blank: bool = False) -> Format:
    return Format(kind, blank)


_WEATHER_NUMBERS = [
    "Max_TemperatureC", "Mean_TemperatureC", "Min_TemperatureC", "Dew_PointC", "MeanDew_PointC",
    "Min_DewpointC", "Max_Humidity", "Mean_Humidity", "Min_Humidity", "Max_Sea_Level_PressurehPa",
    "Mean_Sea_Level_PressurehPa", "Min_Sea_Level_PressurehPa", "Max_VisibilityKm",
    "Mean_VisibilityKm", "Min_VisibilitykM", "Max_Wind_SpeedKm_h", "Mean_Wind_SpeedKm_h",
    "Max_Gust_SpeedKm_h", "Precipitationmm", "CloudCover",
]  # fmt: skip

# Each file's columns (in the file's order), what they mean and where a blank is allowed.
FORMATS: dict[str, dict[str, Format]] = {
    "train.csv": {
        "Store": _f(WHOLE), "DayOfWeek": _f(WHOLE), "Date": _f(DATE), "Sales": _f(WHOLE),
        "Customers": _f(WHOLE), "Open": _f(FLAG), "Promo": _f(FLAG),
        "StateHoliday": _f(HOLIDAY), "SchoolHoliday": _f(FLAG),
    },
    "test.csv": {
        "Id": _f(WHOLE), "Store": _f(WHOLE), "DayOfWeek": _f(WHOLE), "Date": _f(DATE),
        # Blank on a few rows of the real file; a blank Open means open (see rossmann_features).
        "Open": _f(FLAG, blank=True),
        "Promo": _f(FLAG), "StateHoliday": _f(HOLIDAY), "SchoolHoliday": _f(FLAG),
    },
    "store.csv": {
        "Store": _f(WHOLE), "StoreType": _f(TEXT), "Assortment": _f(TEXT),
        "CompetitionDistance": _f(REAL, blank=True),
        "CompetitionOpenSinceMonth": _f(WHOLE, blank=True),
        "CompetitionOpenSinceYear": _f(WHOLE, blank=True), "Promo2": _f(FLAG),
        "Promo2SinceWeek": _f(WHOLE, blank=True), "Promo2SinceYear": _f(WHOLE, blank=True),
        "PromoInterval": _f(TEXT, blank=True),
    },
    "store_states.csv": {"Store": _f(WHOLE), "State": _f(TEXT)},
    "state_names.csv": {"StateName": _f(TEXT), "State": _f(TEXT)},
    "googletrend.csv": {"file": _f(TEXT), "week": _f(WEEK), "trend": _f(REAL)},
    "weather.csv": {
        "file": _f(TEXT), "Date": _f(DATE),
        **{c: _f(REAL, blank=True) for c in _WEATHER_NUMBERS},
        "Events": _f(TEXT, blank=True), "WindDirDegrees": _f(REAL, blank=True),
    },
}  # fmt: skip


def parse_number(text: str | None) -> float | None:
    """A number as the files write it: ``"1"``, ``"1.0"``, ``" 1.0 "`` -> 1.0; blank or None ->
    None. Raises ``ValueError`` for anything else (``"yes"``, ``"1,0"``, ``"nan"``)."""
    if text is None or not text.strip():
        return None
    if not re.fullmatch(NUMBER, text.strip()):
        raise ValueError(f"{text!r} is not a number written like 7, 7.0 or 5.08 (or blank).")
    return float(text)


def unreadable(values: pd.Series, fmt: Format) -> pd.Series:
    """Which of ``values`` (strings as the CSV reader unquoted them) ``fmt`` cannot read."""
    text = values.str.strip()
    blank = text == ""
    bad = ~text.str.fullmatch(fmt.kind.pattern) & ~blank
    if fmt.kind is DATE:  # the pattern lets 2015-02-30 through
        bad |= pd.to_datetime(text.where(~bad & ~blank), format="%Y-%m-%d", errors="coerce").isna()
        bad &= ~blank
    if not fmt.blank:
        bad |= blank
    return bad
