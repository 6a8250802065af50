"""``spark.python.daemon.module=flyte_hvd.spark.worker_daemon``, the name a Spark config may
already carry: the daemon is ``flyte_hvd.stage.worker_daemon``."""

from flyte_hvd.stage.worker_daemon import main

if __name__ == "__main__":
    main()
