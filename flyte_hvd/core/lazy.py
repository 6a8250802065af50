"""Lazy public names for packages whose modules import heavy libraries (pyarrow, TensorFlow,
torch): ``from flyte_hvd.data import Store`` loads only the module that defines it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeAlias

# Whatever the named module defines under that name: a class, a function, a constant.
Exported: TypeAlias = Any


def lazy_attributes(package: str, names: dict[str, str]) -> Callable[[str], Exported]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` (a module path)
    on first use of ``name``."""

    def __getattr__(name: str) -> Exported:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
