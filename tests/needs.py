"""What some tests need of the machine beyond the venv (root, namespaces, buildah or apt-get,
npm), and what such a test does when it is missing: on a contributor's machine it is skipped
with the reason (the summary at the end of the run counts them), under CI (``CI=true``, what
``.ci/run`` sets) it fails, so CI never silently drops a test."""

from __future__ import annotations

import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(missing: str | None) -> None:
    """Skips (outside CI) or fails (under CI) the calling test when ``missing`` names what the
    machine lacks; returns when it is None."""
    if missing is None:
        return
    if IN_CI:
        pytest.fail(f"CI must run this test, but the machine lacks it: {missing}", pytrace=False)
    pytest.skip(f"needs {missing}")


def root() -> str | None:
    """None as root, else what is missing."""
    return None if os.geteuid() == 0 else f"root (it runs as uid {os.geteuid()})"


def image_tools() -> str | None:
    """What building and running the image lacks: root, and buildah, podman, runc and
    debootstrap or an apt-get to install them (scripts/build_image.sh does)."""
    if missing := root():
        return f"{missing}: buildah and podman build and run the image as root"
    absent = [t for t in ("buildah", "podman", "runc", "debootstrap") if not shutil.which(t)]
    if absent and not shutil.which("apt-get"):
        return f"{', '.join(absent)}, and no apt-get to install them"
    return None
