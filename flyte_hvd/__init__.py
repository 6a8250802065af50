"""flyte-hvd: data-parallel deep learning on Apache Spark with a Horovod-compatible API.

Import the layer you need: ``flyte_hvd.core`` (collectives on MPI), ``flyte_hvd.spark``
(launch ranks inside Spark), ``flyte_hvd.keras`` (Keras 3 integration). This module imports
nothing heavy.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def _modules(folder: str) -> set[str]:
    return {
        _os.path.relpath(_os.path.join(root, name), folder)
        for root, _, names in _os.walk(folder)
        for name in names
        if name.endswith(".py")
    }


def _refuse_a_partial_copy(here: str) -> None:
    """Refuse to be a partial copy that shadows a whole flyte_hvd later on the import path.

    A fast-registered code bundle is unpacked ahead of the image's packages: one made by
    ``pyflyte run --remote --copy auto`` from a checkout holds only the flyte_hvd modules that
    were loaded when the workflow file was imported, and the first module it lacks would fail
    to import deep inside a task or a rank."""
    entries = [_os.path.realpath(entry or ".") for entry in _sys.path]
    for entry in entries:
        other = _os.path.join(entry, "flyte_hvd")
        if other == here or not _os.path.isfile(_os.path.join(other, "__init__.py")):
            continue
        missing = sorted(_modules(other) - _modules(here))
        if missing:
            raise ImportError(
                f"flyte_hvd at {here} holds {len(_modules(here))} modules and shadows the "
                f"flyte_hvd at {other}, which has {len(missing)} more ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}). A code bundle of `pyflyte run --remote "
                f"--copy auto` from a checkout ships only the modules loaded when the workflow "
                f"file was imported: register or run with `--copy all` (its .flyteignore leaves "
                f"flyte_hvd out), so that the installed flyte_hvd is the one imported."
            )


if _os.path.isdir(__path__[0]):  # not from a zip
    _refuse_a_partial_copy(_os.path.realpath(__path__[0]))
