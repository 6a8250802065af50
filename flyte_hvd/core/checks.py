"""Argument checks shared by every module: one wording for every "int >= N" error."""

from __future__ import annotations

import numbers
from typing import Any


def require_int(name: str, value: Any, minimum: int) -> int:
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
