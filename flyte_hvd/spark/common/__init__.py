"""Horovod's ``horovod.spark.common`` module paths: ``store``, ``backend`` and ``util``
re-export what ``flyte_hvd.data`` and ``flyte_hvd.estimators`` define, so code written for
Horovod migrates by changing ``horovod`` to ``flyte_hvd`` in its imports."""
