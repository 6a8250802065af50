# syntax=docker/dockerfile:1.7
# flyte-hvd's Spark image: the Flyte task container, the Spark driver and the Spark executors
# (where the ranks run) all use it.
#
#   docker build -t REGISTRY/flyte-hvd:TAG .                       CPU (tensorflow, torch CPU)
#   docker build -t REGISTRY/flyte-hvd:TAG-gpu --build-arg LOCK_FILE=lock/image-gpu.txt \
#       --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
#                                    GPU (tensorflow[and-cuda], PyPI's CUDA torch)
#
# Every Python package comes from a lock file in lock/ (`make lock` regenerates them):
# lock/image.txt is `.[tf,torch]` with the CPU build of torch from the PyTorch CPU index.
# lock/image-gpu.txt adds tensorflow[and-cuda] and takes PyPI's torch, which is the CUDA build
# (CUDA 13: nodes need an NVIDIA driver >= 580); the CUDA and cuDNN libraries of both come as
# nvidia-* wheels, so the base image needs no CUDA. The GPU build must not add the CPU index:
# `torch==2.13.0` also matches `2.13.0+cpu`, which pip would prefer.

# Where no registry is reachable, scripts/build_image.sh (`make image`) builds it with buildah
# from a base made here (BASE_IMAGE, scripts/build_base_image.sh: Debian 12 by debootstrap),
# the torch wheel from a local folder (FIND_LINKS, a volume) and no S3A jars (S3A_JARS=false).
#
# Debian 12: the last Debian with a Java 17 package (Spark 4 runs on 17 or 21). Another base
# must be Debian 12 with python3.11 (venv, pip) as `python` on PATH.
ARG BASE_IMAGE=python:3.11.14-slim-bookworm
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH


# -- jars: the S3A connector for s3a:// paths ------------------------------------------------
# hadoop-aws must be the version of the Hadoop client inside pyspark's jars
# (hadoop-client-api-<version>.jar; pyspark 4.3 ships 3.5.0), with the AWS SDK v2 bundle that
# Hadoop release was built against (hadoop-project's aws-java-sdk-v2.version).
# S3A_JARS=false leaves them out (where Maven Central cannot be reached): the image's entrypoint
# then says at start that Spark has no s3a://; flyte_hvd's Store still reaches s3:// (s3fs).
FROM base AS jars
ARG HADOOP_VERSION=3.5.0
ARG AWS_SDK_VERSION=2.35.4
ARG MAVEN_URL=https://repo1.maven.org/maven2
ARG S3A_JARS=true
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /jars
# hadolint ignore=DL3008
RUN if [ "${S3A_JARS}" = true ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends ca-certificates curl \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# Each jar is checked against the SHA-1 that Maven Central publishes beside it.
RUN [ "${S3A_JARS}" != true ] || for path in \
        "org/apache/hadoop/hadoop-aws/${HADOOP_VERSION}/hadoop-aws-${HADOOP_VERSION}.jar" \
        "software/amazon/awssdk/bundle/${AWS_SDK_VERSION}/bundle-${AWS_SDK_VERSION}.jar"; do \
        curl -fsSL -o "${path##*/}" "${MAVEN_URL}/${path}" \
        && echo "$(curl -fsSL "${MAVEN_URL}/${path}.sha1")  ${path##*/}" | sha1sum --check --strict; \
    done


# -- runtime ---------------------------------------------------------------------------------
FROM base AS runtime
# Java 17 for Spark; tini reaps rank processes (see docker/entrypoint.sh). Debian's security
# updates replace these package versions, so they are not pinned.
# hadolint ignore=DL3008
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini procps \
    && rm -rf /var/lib/apt/lists/*

# The virtual environment, from the lock file, in one step of this stage: the venv (~4 GB:
# TensorFlow, torch, Spark) is written once. A separate build stage would copy it into this
# one (a second 4 GB while the image is committed), and a uv cache mount keeps every wheel
# ever installed outside the image (13 GB after a few lock changes); uv's cache here is in
# the step's /tmp, hard-linked into the venv and deleted before the layer is committed.
ARG LOCK_FILE=lock/image.txt
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A folder of wheels inside the build (a volume: `buildah bud -v DIR:/wheels:ro --build-arg
# FIND_LINKS=/wheels`) that uv searches too; with it, TORCH_INDEX_URL may be empty (no index).
ARG FIND_LINKS=
# The installer: uv (lock/dev.txt's version), outside the venv and gone after the step; it
# installs the ~150 locked packages in about a minute where pip takes several. Like pip, it
# takes the best match across PyPI, TORCH_INDEX_URL and FIND_LINKS; a CA bundle that
# scripts/build_image.sh mounts for a proxy reaches it as SSL_CERT_FILE. Unlike pip, uv writes
# no bytecode unless asked (--compile-bytecode); without it every process of a pod (driver,
# executors, each rank) compiles the TensorFlow, torch and pyspark sources it imports anew,
# since the image sets PYTHONDONTWRITEBYTECODE and runs as a user who cannot write the venv.
ARG UV_VERSION=0.13.9
# Only the lock this build installs: a change to another lock keeps the installed layer.
COPY ${LOCK_FILE} /src/${LOCK_FILE}
RUN python -m venv /opt/venv \
    && python -m pip install --no-cache-dir --target /tmp/uv "uv==${UV_VERSION}" \
    && if [ -f /etc/ssl/flyte-hvd-build-ca.crt ]; then \
        export SSL_CERT_FILE=/etc/ssl/flyte-hvd-build-ca.crt; \
    fi \
    && UV_CACHE_DIR=/tmp/uv-cache /tmp/uv/bin/uv pip install --python /opt/venv/bin/python \
        --compile-bytecode --index-strategy unsafe-best-match ${FIND_LINKS:+--find-links "$FIND_LINKS"} \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -r "/src/${LOCK_FILE}" \
    && rm -rf /tmp/uv /tmp/uv-cache /src
COPY --from=jars /jars/ /opt/venv/lib/python3.11/site-packages/pyspark/jars/
COPY docker/entrypoint.sh /usr/local/bin/flyte-hvd-entrypoint
COPY docker/gpu-discovery.sh /opt/spark/gpu-discovery.sh

# Spark runs from the pyspark wheel: SPARK_HOME is the package, its bin/ has spark-submit and
# its jars/ the Spark, Hadoop, Kubernetes and S3A jars. Spark's Python workers, and so the
# ranks, use the same interpreter as the driver; the mpich wheel's mpiexec is in
# /opt/venv/bin, on PATH.
#
# flytekitplugins-spark conventions. A Spark task's SparkApplication gets
#   executor_path     = the task's python interpreter   -> /opt/venv/bin/python3
#   applications_path = local://<venv>/bin/entrypoint.py -> local:///opt/venv/bin/entrypoint.py
# (flytekit's defaults: SerializationSettings.python_interpreter is /opt/venv/bin/python3 and
# the entrypoint is bin/entrypoint.py of that venv, installed there by flytekit.) The venv is
# at /opt/venv so a task needs neither HorovodSpark(executor_path=..., applications_path=...)
# nor `pyflyte register --python-interpreter`.
ENV VIRTUAL_ENV=/opt/venv \
    SPARK_HOME=/opt/venv/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=/opt/venv/bin/python3 \
    PYSPARK_DRIVER_PYTHON=/opt/venv/bin/python3 \
    HOME=/home/spark

# The project alone: its dependencies, and setuptools that builds it, are in the lock file.
COPY pyproject.toml README.md /src/
COPY flyte_hvd/ /src/flyte_hvd/
RUN pip install --no-cache-dir --no-deps --no-build-isolation /src \
    && rm -rf /src

# Spark images run as uid 185. Fast-registered code is unpacked into the working directory.
RUN useradd --uid 185 --gid 0 --create-home --home-dir /home/spark spark \
    && test -x /opt/venv/bin/entrypoint.py \
    && test -x /opt/venv/bin/mpiexec
WORKDIR /home/spark
USER 185
ENTRYPOINT ["/usr/local/bin/flyte-hvd-entrypoint"]
CMD ["python"]
