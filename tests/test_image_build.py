"""The image build scripts' refusals (scripts/build_image.sh, scripts/build_base_image.sh) and
the entrypoint's word on a missing S3A connector: each says what is missing before any work
starts. The build itself runs in tests/test_container_cluster.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from needs import IN_CI

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "scripts" / "build_image.sh"
BASE = REPO / "scripts" / "build_base_image.sh"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
TOOLS = ("buildah", "podman", "runc", "debootstrap")

# Outside CI only: under CI a test that needs root runs (and fails without it), never skips.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 and not IN_CI, reason="needs root: the scripts go past the root check"
)


def run(script: Path, *args: str, env: dict | None = None, user: int | None = None):
    command = [str(script), *args]
    if user is not None and os.geteuid() == 0:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
    started = time.monotonic()
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    return result, time.monotonic() - started


@pytest.fixture
def stub_tools(tmp_path):
    """buildah, podman, runc, debootstrap and apt-get that only record being called."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in (*TOOLS, "apt-get"):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        stub.chmod(0o755)
    return bin_dir, calls


@pytest.mark.parametrize("script", [BUILD, BASE], ids=["image", "base"])
def test_a_build_as_another_user_than_root_is_refused(script):
    result, seconds = run(script, user=65534)
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    assert result.returncode == 1
    assert f"root (running as uid {uid})" in result.stderr, result.stderr
    assert seconds < 10


@needs_root
def test_missing_tools_without_apt_get_are_named(tmp_path):
    """No buildah, podman, runc, debootstrap and no apt-get to install them: the error names
    each."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "dirname", "id"):
        (bin_dir / name).symlink_to(shutil.which(name))
    result, seconds = run(BUILD, env={"PATH": str(bin_dir)})
    assert result.returncode == 1
    assert (
        "build_image: buildah podman runc debootstrap not found, and no apt-get to install them"
        in result.stderr
    ), result.stderr
    assert seconds < 10
    base, _ = run(BASE, env={"PATH": str(bin_dir)})
    assert base.returncode == 1
    assert "debootstrap not found: apt-get install -y debootstrap" in base.stderr, base.stderr


@needs_root
def test_missing_tools_are_installed_with_apt_get(stub_tools, tmp_path):
    """A tool that is missing is installed with apt-get (here a stub that records the call and
    fails), and a failed install stops the build with what failed."""
    bin_dir, calls = stub_tools
    (bin_dir / "runc").unlink()
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "apt-get $*" >> {calls}\nexit 100\n')
    for name in ("bash", "dirname", "id"):
        (bin_dir / name).symlink_to(shutil.which(name))
    path = str(bin_dir)
    result, _ = run(BUILD, env={"PATH": path})
    assert result.returncode == 1
    assert "build_image: installing runc with apt-get" in result.stderr, result.stderr
    assert "build_image: apt-get install runc failed (see above)" in result.stderr
    assert calls.read_text().splitlines()[0] == "apt-get update -qq"
    called = calls.read_text().splitlines()
    assert not any(line.startswith(("buildah", "podman")) for line in called), called


@needs_root
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PIP_CERT": "/nonexistent/ca.crt"},
         "pip's certificate bundle /nonexistent/ca.crt (PIP_CERT or pip's global.cert) is not "
         "readable"),
        ({"S3A_JARS": "yes"},
         "S3A_JARS must be true or false (or unset: true when Maven Central answers), not 'yes'"),
        ({"S3A_JARS": "false", "FLYTE_HVD_IMAGE_FREE_GB": "16GB"},
         "FLYTE_HVD_IMAGE_FREE_GB must be a number of GB, not '16GB'"),
    ],
    ids=["cert", "s3a_jars", "free_gb"],
)  # fmt: skip
def test_bad_settings_are_refused_before_anything_is_built(stub_tools, env, message):
    bin_dir, calls = stub_tools
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("flyte-hvd-pip.*"))
    result, seconds = run(BUILD, env={"PATH": f"{bin_dir}:{os.environ['PATH']}", **env})
    assert result.returncode == 1
    assert f"build_image: {message}" in result.stderr, result.stderr
    assert seconds < 20
    assert not calls.exists(), calls.read_text()  # no tool ran: nothing built, nothing installed
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("flyte-hvd-pip.*")) == before


@needs_root
def test_a_build_without_the_disk_space_it_needs_is_refused_before_it_starts(stub_tools):
    """Where podman keeps images has less free space than a build needs: the build stops
    before the base or any layer is built, saying how much is needed, how much is free, and
    what to do."""
    bin_dir, calls = stub_tools
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "S3A_JARS": "false",
           "FLYTE_HVD_IMAGE_FREE_GB": "999999"}  # fmt: skip
    free_before = shutil.disk_usage("/var/lib/containers").free / 10**9
    result, seconds = run(BUILD, env=env)
    free_after = shutil.disk_usage("/var/lib/containers").free / 10**9
    assert result.returncode == 1
    # The stub podman names no storage folder: podman's default is the one checked.
    said = re.search(
        r"build_image: building localhost/flyte-hvd:latest needs about 999999 GB free in "
        r"/var/lib/containers; (\d+) GB are free\. Free space there", result.stderr
    )  # fmt: skip
    assert said, result.stderr
    # In GB of 10^9 bytes, as the script says; other processes may write meanwhile.
    low, high = sorted((free_before, free_after))
    assert low - 1 <= int(said[1]) <= high, (said[1], free_before, free_after)
    assert "FLYTE_HVD_IMAGE_FREE_GB" in result.stderr
    called = calls.read_text().splitlines() if calls.exists() else []
    assert called == ["podman info --format {{.Store.GraphRoot}}"], called
    assert seconds < 20


@pytest.mark.parametrize("has_s3a", [False, True], ids=["without", "with"])
def test_the_entrypoint_says_when_spark_has_no_s3a_connector(tmp_path, has_s3a):
    spark_home = tmp_path / "spark"
    (spark_home / "jars").mkdir(parents=True)
    if has_s3a:
        (spark_home / "jars" / "hadoop-aws-3.5.0.jar").write_bytes(b"")
    result = subprocess.run(
        [str(ENTRYPOINT), "sh", "-c", "echo started"], capture_output=True, text=True,
        timeout=30, env={**os.environ, "SPARK_HOME": str(spark_home), "TINI": "/nonexistent"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "started\n"
    said = "no S3A connector in" in result.stderr
    assert said != has_s3a, result.stderr
    if not has_s3a:
        assert "Spark cannot read or write s3a:// paths" in result.stderr


def test_a_rank_keeps_mpichs_settings_but_not_an_enclosing_launchs(monkeypatch):
    """MPIR_CVAR_* (MPICH's netmod, as between pods) reach the rank; an enclosing launch's
    variables do not."""
    from flyte_hvd.launch.supervisor import rank_start

    monkeypatch.setenv("MPIR_CVAR_CH4_NETMOD", "ofi")
    monkeypatch.setenv("FI_PROVIDER", "tcp")
    for name in ("PMI_RANK", "HYDRA_CONTROL_FD", "MPIR_OTHER", "MPI_LOCALNRANKS"):
        monkeypatch.setenv(name, "1")
    env, command = rank_start({}, single_host=False)
    assert env["MPIR_CVAR_CH4_NETMOD"] == "ofi" and env["FI_PROVIDER"] == "tcp"
    assert not {"PMI_RANK", "HYDRA_CONTROL_FD", "MPIR_OTHER", "MPI_LOCALNRANKS"} & set(env)
    assert command[-2:] == ["-m", "flyte_hvd.launch.bootstrap"]
