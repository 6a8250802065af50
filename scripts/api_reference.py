"""Writes the API reference pages (docs/reference/) from the public packages' ``__all__``.

    python scripts/api_reference.py          write the pages
    python scripts/api_reference.py --check  exit 1 if a page differs from what it would write

One page per public package. A name the package defines (or that a module of its own
defines) gets a mkdocstrings entry rendered from its docstring (with its inherited members
for a class built from layers the package does not export, the Store); a name it re-exports
from another documented package links there; a constant is listed with its value. `make docs` runs
the check, so a public name added without its page fails the docs build.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import sys

PACKAGES = {
    "core": "Collectives, state and the rank launcher: `import flyte_hvd.core as hvd`.",
    "keras": "Horovod's Keras API on Keras 3: `import flyte_hvd.keras as hvd`.",
    "tensorflow": "Horovod's TensorFlow 2 API: `import flyte_hvd.tensorflow as hvd`.",
    "torch": "Horovod's PyTorch API: `import flyte_hvd.torch as hvd`.",
    "spark": "Ranks inside Spark: `run`, `HorovodRunner`, `TorchDistributor`, Horovod's paths.",
    "data": "Store, `prepare_data`, the dataset format and the loaders.",
    "estimators": "Spark ML estimators and models for Keras, PyTorch and Lightning.",
    "flyte": "The `HorovodSpark` flytekit task plugin.",
    "flyte2": "The `HorovodSpark` task plugin of Flyte 2 (the `flyte` SDK), and live fit reports.",
}
# Classes whose methods are defined in layers of their own that no page documents (the Store:
# layout, files, Horovod's methods): their entries show the inherited members too.
WITH_INHERITED_MEMBERS = {"flyte_hvd.data.store.base.Store"}
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reference"


def _home(package: str, obj: object, name: str) -> str | None:
    """The dotted path that defines ``obj`` (None for a plain value)."""
    if inspect.ismodule(obj):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    if (
        isinstance(module, str)
        and module.startswith("flyte_hvd")
        and (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj))
    ):
        return f"{module}.{getattr(obj, '__qualname__', name)}"
    return None


def _owner(path: str) -> str | None:
    """The documented package a dotted path belongs to."""
    parts = path.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def page(short: str) -> str:
    package = importlib.import_module(f"flyte_hvd.{short}")
    lines = [f"# `flyte_hvd.{short}`", "", PACKAGES[short], ""]
    documented, linked, values = [], [], []
    for name in package.__all__:
        obj = getattr(package, name)
        home = _home(short, obj, name)
        if home is None:
            values.append(f"| `{name}` | `{obj!r}` |")
        elif _owner(home) not in (short, None):
            linked.append(f"- `{name}`: from [`flyte_hvd.{_owner(home)}`]({_owner(home)}.md)")
        else:
            documented.append((name, home))
    if values:
        lines += ["## Constants", "", "| name | value |", "|---|---|", *values, ""]
    for name, home in documented:
        lines += [f"## `{name}`", "", f"::: {home}", "    options:", "      heading_level: 3",
                  "      show_root_heading: false"]  # fmt: skip
        if home in WITH_INHERITED_MEMBERS:
            lines.append("      inherited_members: true")
        lines.append("")
    if linked:
        lines += ["## Re-exported", "", *linked, ""]
    return "\n".join(lines)


def index() -> str:
    rows = [f"- [`flyte_hvd.{s}`]({s}.md): {text}" for s, text in PACKAGES.items()]
    return "\n".join(["# API reference", "", *rows, ""])


def pages() -> dict[str, str]:
    return {"index.md": index(), **{f"{s}.md": page(s) for s in PACKAGES}}


def main(argv: list[str]) -> int:
    wanted = pages()
    if "--check" in argv:
        stale = [n for n, text in wanted.items() if not (DOCS / n).is_file()
                 or (DOCS / n).read_text() != text]  # fmt: skip
        if stale:
            print(f"docs/reference is out of date ({', '.join(stale)}): run "
                  f"`python scripts/api_reference.py`.", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    DOCS.mkdir(parents=True, exist_ok=True)
    for name, text in wanted.items():
        (DOCS / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
