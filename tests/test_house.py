"""The code's shape, kept: rooms of a readable size, no private name used across modules, the
layout page naming every module, hand-packed lines rare."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "flyte_hvd"
MODULES = sorted(PACKAGE.rglob("*.py"))

MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 80
MAX_FMT_SKIPS = 40


def _trees() -> dict[pathlib.Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in MODULES}


TREES = _trees()


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO))


def test_no_module_class_or_function_is_too_long_to_read():
    too_long = []
    for path, tree in TREES.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{_name(path)}: {lines} lines (module, at most {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            limit = (
                MAX_CLASS_LINES
                if isinstance(node, ast.ClassDef)
                else MAX_FUNCTION_LINES
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                else None
            )
            if limit is not None:
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > limit:
                    too_long.append(f"{_name(path)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "split these:\n" + "\n".join(too_long)


def _module_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to flyte_hvd modules: ``from flyte_hvd.core import collectives``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flyte_hvd"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if (PACKAGE.parent / (full.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / full.replace(".", "/")
                ).is_dir():
                    aliases[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flyte_hvd") and alias.asname:
                    aliases[alias.asname] = alias.name
    return aliases


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_of_the_package_is_used_outside_its_module():
    crossings = []
    for path, tree in TREES.items():
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flyte_hvd"):
                crossings += [
                    f"{_name(path)}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names
                    if _private(a.name)
                ]
            elif (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                crossings.append(
                    f"{_name(path)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}"
                )
    assert not crossings, "make these public or keep them in their module:\n" + "\n".join(crossings)


def test_hand_packed_lines_stay_rare():
    skips = sum(path.read_text().count("# fmt: skip") for path in MODULES)
    assert skips <= MAX_FMT_SKIPS, f"{skips} `# fmt: skip` in flyte_hvd/ (at most {MAX_FMT_SKIPS})"


def _layout_blocks() -> dict[str, str]:
    """docs/layout.md's tree: each top folder's entry, by folder."""
    text = (REPO / "docs" / "layout.md").read_text()
    tree = text.split("```", 2)[1]
    blocks: dict[str, str] = {}
    folder = None
    for line in tree.splitlines():
        found = re.match(r"(flyte_hvd/\w+/)", line)
        if found:
            folder = found.group(1)
        elif line and not line.startswith(" "):
            folder = None
        if folder:
            blocks[folder] = blocks.get(folder, "") + line + "\n"
    return blocks


@pytest.mark.parametrize(
    "folder", sorted({p.relative_to(PACKAGE).parts[0] for p in MODULES if p.parent != PACKAGE})
)
def test_the_layout_page_names_every_module_under_its_folder(folder):
    entry = _layout_blocks().get(f"flyte_hvd/{folder}/")
    assert entry, f"docs/layout.md has no entry for flyte_hvd/{folder}/"
    missing = [
        _name(p)
        for p in MODULES
        if p.relative_to(REPO).parts[1] == folder
        and p.name != "__init__.py"
        and p.name not in entry
        and p.parent.name + "/" not in entry
    ]
    assert not missing, f"docs/layout.md's flyte_hvd/{folder}/ entry does not name: {missing}"
