"""The package's shape as users meet it: public names, lazy imports, library logging."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_horovod_spark_names_resolve_to_the_layers_that_define_them():
    import flyte_hvd.spark as spark
    from flyte_hvd.data.store import Store
    from flyte_hvd.estimators.torch_model import TorchModel

    assert spark.Store is Store and spark.TorchModel is TorchModel
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        _ = spark.NoSuchName


def _type_checking_imports(module: str) -> dict[str, str]:
    """``{name: module}`` of what ``module`` imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    found.update({a.asname or a.name: stmt.module for a in stmt.names})
    return found


@pytest.mark.parametrize(
    ("package", "expected"),
    [
        ("flyte_hvd.data", None),  # its _LAZY table
        ("flyte_hvd.estimators", None),
        ("flyte_hvd.spark", {"flyte_hvd.data", "flyte_hvd.estimators"}),  # Horovod's names
    ],
)
def test_a_type_checker_sees_every_lazy_name_from_where_it_is_loaded(package, expected):
    # A name loaded by a module `__getattr__` is `Any` to a type checker unless the package
    # also imports it under TYPE_CHECKING; a lazy name added without one would go unnoticed.
    seen = _type_checking_imports(package)
    pkg = importlib.import_module(package)
    if expected is None:
        assert seen == pkg._LAZY
    else:
        lazy = {n for p in expected for n in importlib.import_module(p).__all__}
        assert set(seen) == lazy and set(seen.values()) == expected
    for name, module in seen.items():
        assert getattr(pkg, name) is getattr(importlib.import_module(module), name)


def test_importing_the_launcher_loads_no_framework_and_no_data_layer():
    result = _python(
        "import sys, flyte_hvd.spark, flyte_hvd.data, flyte_hvd.estimators\n"
        "heavy = {'tensorflow', 'torch', 'pyarrow', 'pyspark', 'flyte_hvd.data.store'}\n"
        "print(sorted(heavy & set(sys.modules)))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_library_messages_go_to_stderr_until_the_program_configures_logging():
    emit = "from flyte_hvd.core.log import get_logger; get_logger('flyte_hvd.x').info('hello')"
    plain = _python(emit)
    assert plain.stderr.strip() == "flyte-hvd: hello" and plain.stdout == ""

    configured = _python(
        "import logging, sys; logging.basicConfig(stream=sys.stdout, format='app %(message)s')\n"
        + emit
    )
    assert configured.stdout.strip() == "app hello"  # once, through the program's handler
    assert "flyte-hvd: hello" not in configured.stderr

    silenced = _python(
        "import logging; logging.getLogger('flyte_hvd').setLevel(logging.WARNING)\n" + emit
    )
    assert silenced.stderr.strip() == ""
