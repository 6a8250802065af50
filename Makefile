# The commands the README names. `make test` and `make run` do all set-up on a fresh machine.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

# The project's own bytecode, written ahead (a second when nothing changed): where
# PYTHONDONTWRITEBYTECODE is set, every rank, Spark worker and task process would otherwise
# compile the flyte_hvd modules it imports (about 1 s each for the estimators' imports). The
# venv's packages are compiled when installed (scripts/install.sh).
BYTECODE = $(PY) -m compileall -q flyte_hvd workflows tests > /dev/null

.PHONY: setup lock test test-fast test-pythons check lint-checks types docs run run-flyte2 demo lint format bench cluster image

# lock/dev.txt pins every package of this install (`make lock` regenerates it from
# pyproject.toml). Its torch is the CPU build (2.13.0+cpu), which PyPI does not carry:
# scripts/install.sh takes it from a `find-links` folder pip is configured with when one holds
# it, else from the PyTorch CPU index (that one package); everything else comes from PyPI.
# The installer is uv (pinned in the lock; INSTALLER=pip for pip).
$(STAMP): pyproject.toml lock/dev.txt scripts/install.sh
	@scripts/check_java.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	scripts/install.sh $(PY)
	@touch $(STAMP)

setup: $(STAMP)

# Resolves without installing (uv): the locks of `make setup` and the image for CPython 3.11 on
# x86_64 Linux, and one per other Python of `make test-pythons`; see scripts/lock.sh. The pins
# stay where they still satisfy pyproject.toml: LOCK_ARGS="--upgrade-package NAME" (or
# "--upgrade") moves them.
lock:
	@test -x $(VENV)/bin/uv || { test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV); $(PY) -m pip install -q -c lock/dev.txt uv; }
	UV=$(VENV)/bin/uv scripts/lock.sh $(LOCK_ARGS)

# pytest ends within PYTEST_LIMIT (twice its usual 21 minutes on 2 cores): past it, an interrupt
# makes pytest print its summary and the running test, where a suite held by a JVM that stopped
# answering would otherwise run until CI's own limit and leave no summary.
PYTEST_LIMIT ?= 45m

# The lint checks first (seconds), then test-pythons: the small suite on the other supported
# Pythons (scripts/test_pythons.sh). Beside it run the type check and the docs (a minute on one
# core, where test-pythons leaves about half a core idle; their output follows test-pythons',
# from .cache/checks.log) and, as root, the build of the container test's image
# (scripts/build_image.sh --if-stale: it waits mostly on the disk and the network, and the
# container test then finds the image current; its output in .cache/image-build.log, and if
# it failed, the container test builds again and says why), and the class-data archive of
# Spark's classes that the suite's JVMs start from (tests/spark_class_archive.py: once per
# Spark installation, about 40 s; pytest waits for it if it is still being made).
test: setup lint-checks
	@mkdir -p .cache
	@if [ "$$(id -u)" = 0 ]; then \
	  { scripts/build_image.sh --if-stale > .cache/image-build.log 2>&1; \
	    echo "make test: image build (beside test-pythons): $$(tail -n 1 .cache/image-build.log)"; } & \
	fi; \
	{ echo "make test: Spark's class archive (beside test-pythons): $$($(PY) tests/spark_class_archive.py --build)"; } & \
	{ $(MAKE) --no-print-directory types docs > .cache/checks.log 2>&1; echo $$? > .cache/checks.status; } & \
	scripts/test_pythons.sh; status=$$?; wait; \
	echo "make test: the type check and the docs (beside test-pythons):"; cat .cache/checks.log; \
	if [ "$$(cat .cache/checks.status)" != 0 ]; then echo "make test: the type check or the docs failed (above)"; exit 1; fi; \
	exit $$status
	@$(BYTECODE)
	timeout --foreground --signal=INT --kill-after=60 $(PYTEST_LIMIT) $(PY) -m pytest

# The edit-test loop: every test that starts no Spark, no rank process and no Flyte execution
# (markers `spark`, `mpi`, `flyte`, `e2e`, `cluster`, `container` deselected; one that starts
# such a thing anyway fails, naming the marker it lacks).
test-fast: setup
	@$(BYTECODE)
	FLYTE_HVD_TEST_FAST=1 $(PY) -m pytest -m "not spark and not mpi and not flyte and not e2e and not cluster and not container"

# The Pythons the package supports beside this venv's 3.11 (3.12 and 3.13; on 3.13 without
# flytekit, which requires Python <3.13): for each, a venv (.cache/py3.X) from its lock
# (lock/test-py3.X.txt: TensorFlow's CPU build, Spark, the Flyte 2 SDK, pytest), made with uv
# and remade only when the lock changes, and a few minutes of tests: the fast ones that need no
# framework, tests/test_pythons.py, a KerasEstimator fit/transform, a Flyte 2 task
# (scripts/test_pythons.sh). PYTHONS="3.12 ..." names them; INSTALLER=pip installs with pip.
test-pythons: setup
	scripts/test_pythons.sh

# Static checks: lint, format, the layers (import-linter contracts in pyproject.toml: each
# layer imports only those below it, no import cycles) and the types the package promises
# (it ships py.typed).
check: lint-checks types

lint-checks: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

types: setup
	$(VENV)/bin/mypy

# The main job: the Rossmann workflow on the synthetic dataset, locally (Flyte local execution,
# a local SparkSession, 2 ranks). Prints the validation RMSPE against the naive baseline and
# where the model and submission were written.
run: setup
	@$(BYTECODE)
	TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/pyflyte run workflows/rossmann.py horovod_spark_wf

# The same job on Flyte 2 (the `flyte` SDK; workflows/rossmann_flyte2.py, tasks calling tasks,
# training in a HorovodSpark task), locally: the same data, model and printed lines.
run-flyte2: setup
	@$(BYTECODE)
	TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/flyte run --local workflows/rossmann_flyte2.py rossmann

# The smaller demos: 2 ranks by flyte-hvd-run, and ranks inside a Spark barrier stage.
demo: setup
	$(VENV)/bin/flyte-hvd-run -np 2 python examples/data_parallel_regression.py
	$(PY) examples/spark_data_parallel.py

# A Spark cluster of simulated hosts sharing only S3 (root, unshare), with a shell on its
# driver host; exiting the shell stops it. tests/cluster_harness.py says what is simulated.
cluster: setup
	PY=$(PY) scripts/cluster.sh

# The CPU image (Dockerfile) with buildah, as root, on a machine that reaches Debian's and PyPI's
# packages but no container registry: a Debian 12 base made by debootstrap, the torch wheel
# from pip's find-links folder, no S3A jars when Maven Central does not answer. Installs
# buildah, podman, runc and debootstrap with apt-get when missing. See scripts/build_image.sh.
image:
	scripts/build_image.sh

# The documentation site (docs/, mkdocs.yml) into site/, every warning an error; first a check
# that the API reference pages list every public name (scripts/api_reference.py writes them).
docs: setup
	TF_CPP_MIN_LOG_LEVEL=3 $(PY) scripts/api_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: setup
	$(PY) -m ruff check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: setup
	$(PY) -m benchmarks.allreduce
	$(PY) -m benchmarks.across_hosts
	$(PY) -m benchmarks.startup
	$(PY) -m benchmarks.keras_step
	$(PY) -m benchmarks.keras_epochs
	$(PY) -m benchmarks.data_path
	$(PY) -m benchmarks.dataframe_to_ranks
	$(PY) -m benchmarks.streamed_fit
	$(PY) -m benchmarks.estimator
	$(PY) -m benchmarks.torch_step
	$(PY) -m benchmarks.output
