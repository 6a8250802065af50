"""What every supported Python runs (`make test-pythons`, one venv per Python from
lock/test-py*.txt; `make test` runs them on the main venv's Python too): the package imports
without its optional frameworks, and one end-to-end case per framework installed there."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent

# Installed by no extra: an environment without them is one without TensorFlow and PyTorch.
FRAMEWORKS = ("tensorflow", "keras", "tensorboard", "torch", "lightning", "pytorch_lightning")
# Not installed on Python 3.13 (every flytekit release requires Python <3.13).
FLYTEKIT = ("flytekit", "flytekitplugins")


# A finder ahead of the others: importing a blocked module (or one inside it) fails as it does
# where it is not installed, and `name in sys.modules` stays False, as there.
_BLOCK = """
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in BLOCKED):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Absent())
"""


def _without(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a Python where importing ``modules`` fails as it does where they are
    not installed."""
    block = f"BLOCKED = {modules!r}\n{_BLOCK}"
    return subprocess.run(
        [sys.executable, "-c", block + code], capture_output=True, text=True, timeout=120
    )


def _without_frameworks(code: str) -> subprocess.CompletedProcess:
    return _without(FRAMEWORKS, code)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_the_package_and_its_flyte_plugins_import_without_tensorflow_and_torch():
    modules = ["flyte_hvd", "flyte_hvd.core", "flyte_hvd.launch", "flyte_hvd.spark"]
    modules += ["flyte_hvd.data", "flyte_hvd.estimators"]
    if _installed("flytekit"):  # Python < 3.13
        modules.append("flyte_hvd.flyte")
    if _installed("flyte"):  # the [flyte2] extra
        modules.append("flyte_hvd.flyte2")
    result = _without_frameworks(
        "import importlib\n"
        f"for module in {modules!r}: importlib.import_module(module)\n"
        "import flyte_hvd.spark as spark\n"
        "assert callable(spark.run) and spark.Store is not None\n"
        "print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_package_and_the_flyte2_plugin_import_without_flytekit():
    # What Python 3.13 installs: no flytekit. The estimators load lazily, and run() and the
    # Flyte 2 plugin reach flytekit only in a process that already loaded it.
    modules = ["flyte_hvd", "flyte_hvd.core", "flyte_hvd.launch", "flyte_hvd.spark"]
    modules += ["flyte_hvd.data", "flyte_hvd.estimators", "flyte_hvd.launch.failures"]
    if _installed("flyte"):
        modules.append("flyte_hvd.flyte2")
    result = _without(
        FLYTEKIT,
        "import importlib, sys\n"
        f"for module in {modules!r}: importlib.import_module(module)\n"
        "from flyte_hvd.spark import KerasEstimator, run\n"
        "from flyte_hvd.estimators import report\n"
        "from flyte_hvd.launch import task_identity\n"
        "assert not report.in_flyte_task() and task_identity.current() is None\n"
        # (`flytekitplugins` alone may be a namespace package that a .pth file loads at start.)
        "assert not [m for m in sys.modules if m.split('.')[0] == 'flytekit'\n"
        "            or m.startswith('flytekitplugins.')]\n"
        "print('ok')",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("blocked", "missing"),
    [("flytekit", "flytekit"), ("flytekitplugins", "flytekitplugins.spark"), (None, "flytekit")],
    ids=["no-flytekit", "no-flytekitplugins-spark", "this-install"],
)
def test_the_flytekit_plugin_without_flytekit_says_why_and_what_to_use(blocked, missing):
    if blocked is None:  # this Python's own install (3.13: no flytekit)
        if _installed("flytekit"):
            pytest.skip("flytekit is installed here")
        result = _without((), "import flyte_hvd.flyte")
    else:
        if blocked != "flytekit" and not _installed("flytekit"):
            pytest.skip("flytekit is not installed here: it is the one named missing")
        result = _without((blocked,), "import flyte_hvd.flyte")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: `flyte_hvd.flyte` is the flytekit plugin"), last
    assert f"`{missing}` is not installed" in last, last
    if sys.version_info >= (3, 13):
        assert "flytekit's releases (to 1.16.31) require Python <3.13" in last, last
        assert "`flyte_hvd.flyte2` (`pip install flyte-hvd[flyte2]`)" in last, last
        assert "Python 3.11 or 3.12" in last, last
    else:
        assert "`pip install 'flytekit>=1.16' 'flytekitplugins-spark>=1.16'`" in last, last


@pytest.mark.parametrize(
    ("code", "extra"),
    [
        ("import flyte_hvd.tensorflow", "flyte-hvd[tf]"),
        ("import flyte_hvd.tensorflow.keras", "flyte-hvd[tf]"),
        ("import flyte_hvd.keras", "flyte-hvd[tf]"),
        ("from flyte_hvd.spark import KerasEstimator", "flyte-hvd[tf]"),
        ("from flyte_hvd.spark.keras import KerasModel", "flyte-hvd[tf]"),
        ("import flyte_hvd.torch", "flyte-hvd[torch]"),
        ("from flyte_hvd.estimators.torch_model import import_torch; import_torch()",
         "flyte-hvd[torch]"),
    ],
)  # fmt: skip
def test_a_framework_entry_point_without_its_framework_names_the_extra(code, extra):
    result = _without_frameworks(code)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and f"`pip install {extra}`" in last, last


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.skipif(not _installed("tensorflow"), reason="TensorFlow is not installed here")
def test_spark_run_averages_a_tensorflow_tensor_over_two_ranks(spark_local2, no_leftover_ranks):
    from flyte_hvd.spark import run

    def fn():
        import tensorflow as tf

        import flyte_hvd.tensorflow as hvd

        hvd.init()
        averaged = hvd.allreduce(tf.constant([float(hvd.rank()), 4.0]))
        return hvd.rank(), hvd.size(), averaged.numpy().tolist()

    assert run(fn, num_proc=2) == [(0, 2, [0.5, 4.0]), (1, 2, [0.5, 4.0])]


@pytest.mark.spark
@pytest.mark.mpi
@pytest.mark.skipif(
    not _installed("torch"),
    reason="PyTorch is not installed here (no CPU wheel of it for this Python on this machine)",
)
def test_spark_run_averages_a_torch_tensor_over_two_ranks(spark_local2, no_leftover_ranks):
    from flyte_hvd.spark import run

    def fn():
        import torch

        import flyte_hvd.torch as hvd

        hvd.init()
        averaged = hvd.allreduce(torch.tensor([float(hvd.rank()), 4.0]))
        return hvd.rank(), hvd.size(), averaged.tolist()

    assert run(fn, num_proc=2) == [(0, 2, [0.5, 4.0]), (1, 2, [0.5, 4.0])]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, version = line.strip().partition("==")
            pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("lock", sorted(p.name for p in (REPO / "lock").glob("test-py*.txt")))
def test_each_pythons_lock_pins_the_package_requirements_within_their_ranges(lock):
    version = lock.removeprefix("test-py").removesuffix(".txt")
    environment = {"python_version": version, "python_full_version": f"{version}.0"}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins(REPO / "lock" / lock)
    extras = project["optional-dependencies"]
    required = project["dependencies"] + extras["tf-cpu"] + extras["flyte2"]
    for requirement in map(Requirement, [*required, "pytest", "pytest-timeout", "pip"]):
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"lock/{lock} lacks `{requirement}`: run `make lock`"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
            f"lock/{lock} pins {name}=={pins[name]}, outside `{requirement}`: run `make lock`"
        )
    assert "torch" not in pins and not [n for n in pins if n.startswith("nvidia-")]
    # flytekit installs on no Python from 3.13 (its releases require <3.13).
    assert ("flytekit" in pins) == (Version(version) < Version("3.13")), lock


def test_a_build_prints_no_setuptools_warning_of_ours(tmp_path):
    # setuptools deprecates `project.license` as a table ("By 2027-Feb-18, you need to update
    # your project"); the SPDX string form gives none. Built with this venv's setuptools.
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    for warning in ("SetuptoolsDeprecationWarning", "project.license", "License classifiers"):
        assert warning not in output, output[-3000:]
    (wheel,) = tmp_path.glob("flyte_hvd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read("flyte_hvd-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Python: >=3.11\n" in metadata
