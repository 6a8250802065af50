#!/usr/bin/env bash
# The image's ENTRYPOINT: the contract Spark on Kubernetes (and so the Spark operator) expects
# of a Spark image, for a Spark that comes from the pyspark wheel rather than a distribution.
#
#   entrypoint.sh driver ARGS...    spark-submit in client mode inside the driver pod. ARGS
#       end with the application file and its arguments; for a Flyte task those are
#       local:///opt/venv/bin/entrypoint.py pyflyte-execute ... (or pyflyte-fast-execute).
#   entrypoint.sh executor          a Spark executor; its settings come from the SPARK_*
#       variables Spark sets on executor pods.
#   entrypoint.sh CMD ARGS...       runs CMD as it is: a plain Flyte task (pyflyte-execute),
#       flyte-hvd-run, python.
#
# Under tini (as in the image) the command is not PID 1: rank processes and the mpiexec
# around each are reaped, and a SIGTERM reaches the whole process group.
set -euo pipefail

if [ -z "${SPARK_HOME:-}" ]; then
  unset SPARK_HOME
  SPARK_HOME=$(find_spark_home.py)
fi
export SPARK_HOME
java="${JAVA_HOME:+$JAVA_HOME/bin/}java"

classpath="${SPARK_CONF_DIR:-$SPARK_HOME/conf}:${SPARK_HOME}/jars/*"
if [ -n "${HADOOP_CONF_DIR:-}" ]; then
  classpath="${HADOOP_CONF_DIR}:${classpath}"
fi
if [ -n "${SPARK_EXTRA_CLASSPATH:-}" ]; then
  classpath="${classpath}:${SPARK_EXTRA_CLASSPATH}"
fi

# An image built with S3A_JARS=false has no S3A connector beside Spark's jars.
if [ -n "${1:-}" ] && ! compgen -G "${SPARK_HOME}/jars/hadoop-aws-*.jar" >/dev/null; then
  echo "flyte-hvd: no S3A connector in ${SPARK_HOME}/jars (an image built with" \
    "S3A_JARS=false): Spark cannot read or write s3a:// paths; flyte_hvd's Store still" \
    "reaches s3:// through s3fs" >&2
fi

case "${1:-}" in
  driver)
    shift
    command=("$SPARK_HOME/bin/spark-submit" --deploy-mode client)
    if [ -n "${SPARK_DRIVER_BIND_ADDRESS:-}" ]; then
      command+=(--conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS}")
    fi
    command+=("$@")
    ;;
  executor)
    shift
    # Spark passes the executor's JVM options as SPARK_JAVA_OPT_0, SPARK_JAVA_OPT_1, ...
    java_opts=()
    while IFS='=' read -r name _; do
      java_opts+=("${!name}")
    done < <(env | grep -o '^SPARK_JAVA_OPT_[0-9]*=' | sort -t_ -k4 -n)
    command=(
      "$java" "${java_opts[@]}"
      "-Xms${SPARK_EXECUTOR_MEMORY}" "-Xmx${SPARK_EXECUTOR_MEMORY}"
      -cp "${classpath}${SPARK_DIST_CLASSPATH:+:$SPARK_DIST_CLASSPATH}"
      org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend
      --driver-url "$SPARK_DRIVER_URL"
      --executor-id "$SPARK_EXECUTOR_ID"
      --cores "$SPARK_EXECUTOR_CORES"
      --app-id "$SPARK_APPLICATION_ID"
      --hostname "$SPARK_EXECUTOR_POD_IP"
      --resourceProfileId "$SPARK_RESOURCE_PROFILE_ID"
      --podName "$SPARK_EXECUTOR_POD_NAME"
      "$@"
    )
    ;;
  "")
    echo "usage: entrypoint.sh driver|executor|COMMAND [ARGS...]" >&2
    exit 2
    ;;
  *)
    command=("$@")
    ;;
esac

tini="${TINI:-/usr/bin/tini}"
if [ -x "$tini" ]; then
  exec "$tini" -s -g -- "${command[@]}"
fi
exec "${command[@]}"
