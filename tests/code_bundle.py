"""The code bundles that fast registration uploads for this repository's workflows, built by
flytekit's own packaging functions, as a task pod unpacks them.

``register_bundle(output_dir)`` is what ``pyflyte register workflows/`` uploads (its default
``--copy all``, as ``pyflyte run --remote --copy all``): a ``.tar.gz`` that
``pyflyte-fast-execute`` unpacks into the task's working directory and puts on its import
path. ``run_bundle(...)`` is what ``pyflyte run --remote --copy auto`` uploads: the modules
under the project root that are loaded once the workflow file is imported.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def register_bundle(output_dir: Path, package: Path = REPO / "workflows") -> Path:
    """The tarball ``pyflyte register <package>`` uploads, written into ``output_dir``.

    flytekit's ``register`` packages the common root of the packages it is given (the first
    folder up without ``__init__.py``) with ``fast_package`` and ``--copy all``: every file
    there, less what ``.gitignore``, ``.dockerignore``, ``.flyteignore`` and its standard
    patterns ignore."""
    from flytekit.constants import CopyFileDetection
    from flytekit.tools.fast_registration import FastPackageOptions, fast_package
    from flytekit.tools.repo import find_common_root

    root = find_common_root([str(package)])
    options = FastPackageOptions([], copy_style=CopyFileDetection.ALL)
    return Path(fast_package(root, output_dir, options=options))


# Run in a fresh interpreter, as `pyflyte run --remote --copy auto <file> <entity>` does: load
# the CLI (and with it flytekit's plugins), import the workflow file from its project root
# then package the loaded modules.
_RUN_PACKAGE = """
import importlib
import sys
from pathlib import Path

from flytekit.clis.sdk_in_container import pyflyte  # noqa: F401
from flytekit.constants import CopyFileDetection
from flytekit.tools.fast_registration import FastPackageOptions, fast_package
from flytekit.tools.script_mode import _find_project_root

script, output_dir = Path(sys.argv[1]).resolve(), sys.argv[2]
root = _find_project_root(script)
module = ".".join(script.relative_to(root).with_suffix("").parts)
sys.path.insert(0, root)  # as pyflyte run's load_naive_entity does
importlib.import_module(module)
options = FastPackageOptions([], copy_style=CopyFileDetection.LOADED_MODULES)
print(fast_package(root, output_dir, options=options))
"""


def run_bundle(script: Path, output_dir: Path, pythonpath: str, cwd: Path | None = None) -> Path:
    """The tarball ``pyflyte run --remote --copy auto <script> ...`` uploads, written into
    ``output_dir`` by a fresh interpreter whose import path is ``pythonpath``."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN_PACKAGE, str(script), str(output_dir)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin", "HOME": str(output_dir)},
        cwd=cwd or script.parent,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return Path(result.stdout.strip().splitlines()[-1])


def bundle_files(tarball: Path) -> set[str]:
    """The paths of the files in a bundle."""
    with tarfile.open(tarball) as tar:
        return {member.name for member in tar.getmembers() if member.isfile()}
