"""flyte-hvd: data-parallel deep learning on Apache Spark with a Horovod-compatible API.

Import the layer you need: ``flyte_hvd.core`` (collectives on MPI), ``flyte_hvd.spark``
(launch ranks inside Spark), ``flyte_hvd.keras`` (Keras 3 integration). This module imports
nothing heavy.
"""

__version__ = "0.1.0"
