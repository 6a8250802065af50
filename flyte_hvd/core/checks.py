"""Argument checks shared by every module: one wording for every "int >= N" error."""

from __future__ import annotations

import numbers
from typing import TypeVar

T = TypeVar("T")


def require_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int, or a ``ValueError`` naming ``name`` if it is not an int >= ``minimum``.

    ``bool`` is refused although it is an ``int`` subclass (``True`` is never meant as 1);
    numpy integers are ints.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`{name}` must be an int >= {minimum}; found {value!r} ({type(value).__name__})."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; found {value}.")
    return int(value)


def to_list(var: T | list[T] | tuple[T, ...] | None, length: int) -> list[T] | None:
    """``var`` as a list of ``length`` items (Horovod's ``util.to_list``): a single value (or a
    one-item list) repeated, a list of that length as it is; None stays None."""
    if var is None:
        return None
    items = list(var) if isinstance(var, list | tuple) else [var]
    if len(items) == 1:
        return items * length
    if len(items) != length:
        raise ValueError(
            f"expected {length} item(s) (one per column); found {len(items)}: {var!r}."
        )
    return items
