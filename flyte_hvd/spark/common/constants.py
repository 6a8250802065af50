"""Horovod's ``horovod.spark.common.constants``: the names code written for Horovod reads.

The column kinds are those of a prepared dataset's metadata (``flyte_hvd.data.dataset``:
``ColumnInfo.kind``). Horovod's Petastorm formats (``NOCHANGE``, ``CUSTOM_SPARSE``) name how it
wrote a column into Parquet; flyte_hvd writes every column as Spark has it, so they are kept
as names only. ``TOTAL_BUFFER_MEMORY_CAP_GIB`` was Horovod's cap on a rank's shuffle buffer;
here a rank's loader keeps its shard in memory up to ``inmemory_cache_all``'s bound instead.
"""

ARRAY = "array"
DENSE_VECTOR = "dense_vector"
SPARSE_VECTOR = "sparse_vector"
MIXED_SPARSE_DENSE_VECTOR = "vector"  # a vector column holding both kinds
NOCHANGE = "nochange"
CUSTOM_SPARSE = "custom_sparse_format"

TOTAL_BUFFER_MEMORY_CAP_GIB = 4
BYTES_PER_GIB = 1 << 30
