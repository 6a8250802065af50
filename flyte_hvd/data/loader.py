"""Data loaders: one rank's batches of a Parquet dataset, epoch after epoch.

``BaseDataLoader`` is what an estimator calls; ``ArrowDataLoader`` (the default) reads with
``pyarrow.dataset``. Every rank yields the same number of batches per epoch, computed from
the dataset's total row count alone (``ceil(rows / (size * batch_size))``), so ranks agree
without talking and no rank waits in an allreduce that another rank never joins.

Runs on ranks: imports neither pyspark nor flyte_hvd.core, and TensorFlow only inside
``to_tf_dataset``.
"""

from __future__ import annotations

import abc
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flyte_hvd.core.checks import require_int
from flyte_hvd.data.dataset import (
    DatasetMetadata,
    decode_column,
    read_metadata_fs,
)
from flyte_hvd.data.parquet import FileSystem, as_arrow_filesystem, open_parquet_dataset
from flyte_hvd.data.store import RemoteStore, Store

if TYPE_CHECKING:
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs
    import tensorflow as tf
    from numpy.typing import DTypeLike

Batch = dict[str, np.ndarray]
# (row-group fragment or in-memory table, first row, end row): the part a rank reads.
Piece = tuple["ds.ParquetFileFragment | pa.Table", int, int]
# Rows per piece of a loader over a table (``table=``): as a row group of prepared Parquet.
_TABLE_PIECE_ROWS = 65_536
T = TypeVar("T")
# Pipeline of an epoch: a reader thread decodes pieces (pyarrow, without the GIL) up to
# _READ_AHEAD ahead; a shuffling thread joins and permutes them (Arrow's take, without the
# GIL) up to _BLOCKS_AHEAD runs of batches ahead; the caller only slices batches off runs.
_READ_AHEAD = 2
_BLOCKS_AHEAD = 2


TF_GROUP_BATCHES = 16  # batches per crossing from a per-batch loader into tf.data
_CACHED_BLOCK_BATCHES = 64  # batches per crossing from the in-memory shard
# ``inmemory_cache_all=None`` keeps a shard in memory when it decodes to at most this. Read
# from memory, an epoch needs no reading thread beside the training threads: on 2 cores that
# thread slowed a PyTorch epoch 1.2-1.7x against the same shard cached.
AUTO_CACHE_MAX_BYTES = 256 << 20


def _float_dtype(arg: str, value: DTypeLike) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind != "f":
        raise ValueError(
            f"`{arg}` must be a floating-point dtype such as 'float32'; found {value!r}."
        )
    return dtype


class BaseDataLoader(abc.ABC):
    """One rank's batches: ``len(loader)`` batches per epoch, a new epoch per ``iter``.

    Subclasses implement ``__len__`` (the same on every rank), ``_iterate(epoch)`` and
    ``output_specs``. An estimator's ``data_loader`` param takes such a class in place of
    ``ArrowDataLoader`` and builds one per rank and split as ``ArrowDataLoader`` is built:
    ``cls(path, batch_size, rank=, size=, store=, columns=, metadata=, shuffle=,
    shuffle_buffer_size=, seed=, inmemory_cache_all=, steps_per_epoch=)`` -- subclassing
    ``ArrowDataLoader`` keeps that signature.
    """

    def __init__(self) -> None:
        self._epoch = 0

    @abc.abstractmethod
    def __len__(self) -> int:
        """Batches per epoch; must be equal on every rank."""

    @abc.abstractmethod
    def _iterate(self, epoch: int) -> Iterator[Batch]:
        """Yield exactly ``len(self)`` batches for ``epoch``."""

    @property
    @abc.abstractmethod
    def output_specs(self) -> dict[str, tuple[np.dtype, tuple[int | None, ...]]]:
        """Per column: (dtype, batch shape); the batch dimension may be None."""

    def __iter__(self) -> Iterator[Batch]:
        """The next epoch (each ``iter`` reshuffles with a new epoch number)."""
        epoch = self._epoch
        self._epoch += 1
        return self._iterate(epoch)

    def iter_epoch(self, epoch: int) -> Iterator[Batch]:
        """The batches of a given epoch (e.g. when resuming from a checkpoint)."""
        return self._iterate(epoch)

    def _next_groups(self) -> Iterator[Batch]:
        """The next epoch (as ``iter`` starts it) in groups of batches (see ``_groups``)."""
        epoch = self._epoch
        self._epoch += 1
        return self._groups(epoch)

    def _groups(self, epoch: int) -> Iterator[Batch]:
        """The batches of ``epoch`` in order, stacked in groups along a new first axis
        (``(batches, rows, *shape)``); consecutive batches of one length share a group. This
        default stacks up to ``TF_GROUP_BATCHES`` batches of ``_iterate``; a loader that
        decodes many batches at once yields those blocks as they are, with no Python step
        per batch."""
        group: list[Batch] = []
        for batch in self._iterate(epoch):
            # Only batches of one length stack (a user's loader may end on a short one).
            if group and _rows(batch) != _rows(group[0]):
                yield _stack(group)
                group = []
            group.append(batch)
            if len(group) == TF_GROUP_BATCHES:
                yield _stack(group)
                group = []
        if group:
            yield _stack(group)

    def to_tf_dataset(
        self,
        feature_columns: str | Sequence[str],
        label_columns: str | Sequence[str] | None = None,
        sample_weight_col: str | None = None,
        prefetch: int | None = 2,
        float64_as: str | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of ``x``, ``(x, y)`` or ``(x, y, w)`` for ``model.fit``.

        One column gives a tensor, several a tuple in the order given. Each time Keras starts
        an epoch it iterates the dataset again, which starts the loader's next epoch; the
        dataset has a known cardinality of ``len(self)``. ``float64_as`` (e.g. ``"float32"``,
        what Keras computes in; Spark's doubles arrive as float64) casts the float64 columns,
        a group of batches at a time on the way in rather than batch by batch in the graph.
        ``shapes`` gives columns another shape per row with as many values (a flat vector of
        784 for a model input of 28 x 28 x 1), as Horovod shapes features to the model.
        """
        import tensorflow as tf

        # Per column: dtype and batch shape; and a row's shape, where reshaped.
        specs, rows = _reshaped(dict(self.output_specs), shapes or {})
        if float64_as is not None:
            cast_to = _float_dtype("float64_as", float64_as)
            specs = {
                c: (cast_to if dtype == np.float64 else dtype, shape)
                for c, (dtype, shape) in specs.items()
            }
        parts = [_column_list("feature_columns", feature_columns, specs)]
        if label_columns is not None:
            parts.append(_column_list("label_columns", label_columns, specs))
        if sample_weight_col is not None:
            parts.append(_column_list("sample_weight_col", sample_weight_col, specs))

        # A column's value, or a tuple of them: numpy arrays, or their ``tf.TensorSpec``s.
        def pack(values: dict[str, T], names: list[str]) -> T | tuple[T, ...]:
            return values[names[0]] if len(names) == 1 else tuple(values[n] for n in names)

        columns = [c for names in parts for c in names]
        # The generator yields groups of batches stacked along a new first axis, and unbatch
        # (in C++) splits them again: one Python-to-tensor crossing per group of batches
        # instead of one per batch (see ``_groups``).
        signature_by_col = {
            c: tf.TensorSpec(shape=(None, *specs[c][1]), dtype=tf.as_dtype(specs[c][0]))
            for c in columns
        }
        signature = tuple(pack(signature_by_col, names) for names in parts)
        single = len(parts) == 1

        def generate() -> Iterator[tuple | np.ndarray]:
            for group in self._next_groups():
                values = {c: np.asarray(group[c], specs[c][0]) for c in columns}
                for c, row in rows.items():
                    values[c] = values[c].reshape(*values[c].shape[:2], *row)
                out = tuple(pack(values, names) for names in parts)
                yield out[0] if single else out

        # The next group is made while the current one is trained on, so that the Python
        # step (and its wait for the GIL) stays off the training's path.
        dataset = (
            tf.data.Dataset.from_generator(
                generate, output_signature=signature[0] if single else signature
            )
            .prefetch(1)
            .unbatch()
        )
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(self)))
        options = tf.data.Options()  # the loader shards by rank already
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        # Nothing here for tf.data to tune (the buffers are fixed), and its tuning thread made the
        # first step after each new iterator (Keras makes one per epoch and per validation) wait
        # 3-9 s with the CPU idle: 4 of the Rossmann model's 10 s epochs.
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
        return dataset.prefetch(prefetch) if prefetch else dataset


def _reshaped(
    specs: dict[str, tuple[np.dtype, tuple[int | None, ...]]], shapes: Mapping[str, Sequence[int]]
) -> tuple[dict[str, tuple[np.dtype, tuple[int | None, ...]]], dict[str, tuple[int, ...]]]:
    """``specs`` (per column: dtype and batch shape) with the rows of the columns in
    ``shapes`` given those shapes, and those rows' shapes; a ValueError for a shape that does
    not hold a row's values."""
    rows: dict[str, tuple[int, ...]] = {}
    for c, shape in shapes.items():
        if c not in specs:
            continue
        batch, *row = specs[c][1]
        per_row = math.prod(d or 1 for d in row)
        if math.prod(shape) != per_row:
            raise ValueError(
                f"column `{c}` holds {per_row} value(s) per row (shape {tuple(row)}); it "
                f"cannot take the shape {tuple(shape)}."
            )
        rows[c] = tuple(shape)
        specs[c] = (specs[c][0], (batch, *shape))
    return specs, rows


class TransformedLoader(BaseDataLoader):
    """``loader`` with ``fn(batch) -> batch`` applied to every batch (Horovod's
    ``transformation_fn``); ``fn`` must keep each column's dtype and shape."""

    def __init__(self, loader: BaseDataLoader, fn: Callable[[Batch], Batch]):
        super().__init__()
        self.loader, self.fn = loader, fn

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def output_specs(self) -> dict[str, tuple[np.dtype, tuple[int | None, ...]]]:
        return self.loader.output_specs

    def _iterate(self, epoch: int) -> Iterator[Batch]:
        for batch in self.loader.iter_epoch(epoch):
            yield self.fn(batch)


class ArrowDataLoader(BaseDataLoader):
    """Batches of a Parquet dataset for one rank, read with ``pyarrow.dataset``.

    The dataset's rows (files sorted by path, then row groups) are cut into ``size``
    contiguous ranges of ``rows // size`` or one more; rank ``r`` reads only the row groups
    that overlap range ``r``, so shards are disjoint and within one row of each other. Each
    epoch reads the shard's row groups in a seeded shuffled order through a shuffle buffer
    and yields ``len(self)`` full batches (dicts of numpy arrays shaped ``(batch_size,
    *shape)``), reading the shard again when it runs short. The arrays may be read-only views
    of Arrow memory: copy one before writing to it.

    Args:
        path: the dataset directory (e.g. ``store.get_train_data_path(idx)``).
        batch_size: rows per batch on this rank.
        rank: this rank (a plain int).
        size: the number of ranks (a plain int).
        store: the Store (or ``RemoteStore``) whose filesystem holds ``path``.
        filesystem: otherwise a pyarrow or fsspec filesystem; otherwise inferred from
            ``path``.
        columns: columns to read (default: all that the metadata describes).
        metadata: the dataset's metadata (default: ``read_metadata``).
        shuffle: read the row groups in a new random order each epoch and permute each one's
            rows together with the rows carried over from earlier ones; ``False`` reads the
            shard in order (faster: no permutation, and batches are views of what was read).
        shuffle_buffer_size: rows carried over from one row group to the next, so that a
            batch mixes rows of several row groups. Memory per epoch stays near one row
            group plus this many rows, plus up to two row groups read ahead.
        seed: the epoch's shuffle is seeded by (seed, epoch, rank): reruns repeat it.
        inmemory_cache_all: decode the shard once and keep it in memory, for data that fits;
            ``None`` does so when the shard decodes to at most ``AUTO_CACHE_MAX_BYTES``
            (256 MiB), as the estimators do by default.
        steps_per_epoch: override the batches per epoch (it must be equal on every rank).
        table: this rank's rows already in memory, in the stored layout (a streamed fit's
            partition, ``dataset.partition_splits``): read instead of ``path``, which then
            only names them; needs ``metadata``. Its batches per epoch default to the
            table's rows over ``batch_size``: ranks of unequal tables pass
            ``steps_per_epoch``.
        float64_as: decode float64 columns as this floating-point dtype (the estimators pass
            ``"float32"``, what the models compute in: the in-memory shard then holds half the
            bytes, and batches go to the model without a conversion each step).
    """

    def __init__(
        self,
        path: str,
        batch_size: int,
        *,
        rank: int = 0,
        size: int = 1,
        store: Store | RemoteStore | None = None,
        filesystem: FileSystem | None = None,
        columns: Sequence[str] | None = None,
        metadata: DatasetMetadata | None = None,
        shuffle: bool = True,
        shuffle_buffer_size: int = 10_000,
        seed: int = 0,
        inmemory_cache_all: bool | None = False,
        steps_per_epoch: int | None = None,
        float64_as: str | None = None,
        table: pa.Table | None = None,
    ):
        super().__init__()
        require_int("batch_size", batch_size, 1)
        require_int("size", size, 1)
        require_int("rank", rank, 0)
        require_int("shuffle_buffer_size", shuffle_buffer_size, 0)
        if rank >= size:
            raise ValueError(f"`rank`={rank} must be below `size`={size}.")
        if steps_per_epoch is not None:
            require_int("steps_per_epoch", steps_per_epoch, 1)
        self.path = path
        self.batch_size = batch_size
        self.rank = rank
        self.size = size
        self.shuffle = bool(shuffle)
        self.shuffle_buffer_size = shuffle_buffer_size if self.shuffle else 0
        self.seed = seed
        if table is not None and metadata is None:
            raise ValueError(f"a loader over a `table` ({path}) needs its `metadata`.")
        if metadata is not None:
            self.metadata = metadata
        else:
            fs, fs_path = _resolve_filesystem(path, store, filesystem)
            self.metadata = read_metadata_fs(fs, fs_path)
        names = list(columns) if columns is not None else self.metadata.column_names
        self._infos = {n: self.metadata.column(n) for n in names}
        self.columns = names
        cast_to = _float_dtype("float64_as", float64_as) if float64_as is not None else None
        self._dtypes = {
            n: cast_to if cast_to is not None and i.dtype == "float64" else np.dtype(i.dtype)
            for n, i in self._infos.items()
        }

        if table is not None:
            self._pieces, self.shard_rows = _table_pieces(table, path, rank), table.num_rows
            self.total_rows = self.shard_rows  # all this rank knows of
            default_steps = math.ceil(self.shard_rows / batch_size)
        else:
            fs, fs_path = _resolve_filesystem(path, store, filesystem)
            self._pieces, self.total_rows = self._parquet_pieces(fs, fs_path)
            self.shard_rows = self._pieces_rows()
            default_steps = math.ceil(self.total_rows / (size * batch_size))
        self._steps = steps_per_epoch or default_steps
        self._keep = min(self.shuffle_buffer_size, self.shard_rows // 2)
        self._cache: Batch | None = None
        if inmemory_cache_all is None:
            inmemory_cache_all = self.shard_bytes <= AUTO_CACHE_MAX_BYTES
        self.inmemory_cache_all = bool(inmemory_cache_all)

    def _parquet_pieces(self, fs: pafs.FileSystem, fs_path: str) -> tuple[list[Piece], int]:
        """This rank's pieces of the Parquet dataset, and the dataset's rows."""
        fragments = list(open_parquet_dataset(fs, fs_path).get_fragments())
        total = sum(f.metadata.num_rows for f in fragments)
        size = self.size
        if total < size:
            raise ValueError(
                f"the dataset at `{self.path}` has {total} rows, fewer than the {size} "
                f"ranks; every rank needs at least one row. Use fewer ranks or more data."
            )
        lo, hi = self.rank * total // size, (self.rank + 1) * total // size
        return _shard_pieces(fragments, lo, hi), total

    def _pieces_rows(self) -> int:
        return sum(stop - start for _, start, stop in self._pieces)

    @property
    def shard_bytes(self) -> int:
        """This rank's shard's size once decoded (what ``inmemory_cache_all`` keeps)."""
        row = sum(self._dtypes[n].itemsize * i.size for n, i in self._infos.items())
        return self.shard_rows * row

    def __len__(self) -> int:
        return self._steps

    @property
    def output_specs(self) -> dict[str, tuple[np.dtype, tuple[int | None, ...]]]:
        return {n: (self._dtypes[n], (self.batch_size, *i.shape)) for n, i in self._infos.items()}

    def _iterate(self, epoch: int) -> Iterator[Batch]:
        entropy = [self.seed, epoch, self.rank]
        if self.inmemory_cache_all:
            return self._iterate_cached(np.random.default_rng(entropy))
        return self._iterate_streaming(entropy)

    def _groups(self, epoch: int) -> Iterator[Batch]:
        if type(self)._iterate is not ArrowDataLoader._iterate:
            return super()._groups(epoch)  # a subclass's own batches
        # The same batches as ``_iterate``, as the decoded blocks they are cut from.
        return self._block_groups(epoch)

    def _block_groups(self, epoch: int) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        if self.inmemory_cache_all:
            blocks = self._cached_blocks(rng, _CACHED_BLOCK_BATCHES)
        else:
            blocks = _in_background(self._blocks(rng), _BLOCKS_AHEAD, "flyte-hvd-shuffle")
        try:
            for block in blocks:
                yield _as_groups(block, self.batch_size)
        finally:
            blocks.close()  # type: ignore[attr-defined]

    def _read_piece(self, piece: Piece) -> pa.Table:
        source, start, stop = piece
        if isinstance(source, pa.Table):
            return source.select(self.columns).slice(start, stop - start)
        return source.to_table(columns=self.columns).slice(start, stop - start)

    def _decode(self, table: pa.Table) -> Batch:
        batch = {}
        for n, info in self._infos.items():
            values = decode_column(table.column(n), info)
            batch[n] = values if values.dtype == self._dtypes[n] else values.astype(self._dtypes[n])
        return batch

    def _passes(self, rng: np.random.Generator) -> Iterator[pa.Table | None]:
        """The shard's pieces, in a new shuffled order each pass, pass after pass (None ends
        a pass), read ``_READ_AHEAD`` pieces ahead by a reader thread."""
        # Rows the epoch can use: its batches plus the rows held back to mix with the next
        # piece; reading further ahead would be wasted.
        useful = self._steps * self.batch_size + self._keep

        def plan() -> Iterator[int | None]:
            order = np.arange(len(self._pieces))
            planned = 0
            while True:
                if self.shuffle:
                    rng.shuffle(order)
                for i in order.tolist():
                    yield i
                    _, start, stop = self._pieces[i]
                    planned += stop - start
                    if planned >= useful:
                        yield None  # the epoch has all it can use: batch what is left
                        return
                yield None

        reader = ThreadPoolExecutor(1, thread_name_prefix="flyte-hvd-read")
        ahead: deque[Future | None] = deque()
        try:
            for item in plan():
                ahead.append(
                    None if item is None else reader.submit(self._read_piece, self._pieces[item])
                )
                if len(ahead) > _READ_AHEAD:
                    done = ahead.popleft()
                    yield None if done is None else done.result()
            while ahead:
                done = ahead.popleft()
                yield None if done is None else done.result()
        finally:
            reader.shutdown(wait=True, cancel_futures=True)

    def _blocks(self, rng: np.random.Generator) -> Iterator[Batch]:
        """Runs of whole batches. Each piece joins the rows not yet batched (``rest``); when
        shuffling, all of them are permuted together, except that rows left over from the end
        of a pass stay first (so an epoch of at least ``shard_rows`` rows yields every row of
        the shard). The leading whole batches go out; ``_keep`` rows stay behind to mix with
        the next piece, except at the end of a pass.

        The rows stay in Arrow until they go out: joining copies nothing (``concat_tables``
        keeps the chunks), and Arrow's ``take`` gathers each column once, straight from both
        chunks, without the GIL, into memory that Arrow's allocator reuses (fresh numpy arrays
        per piece cost a page fault every 4 KiB)."""
        bs, budget = self.batch_size, self._steps
        rest: Any = None  # a pa.Table once the first piece is in
        carry = 0  # rows from the end of a pass, at rest[:carry]
        for chunk in self._passes(rng):
            if chunk is None:  # the end of a pass: batch all that is left
                pool, reserve = rest, 0
            else:
                pool = chunk if rest is None else pa.concat_tables([rest, chunk])
                reserve = self._keep
            runs = min((pool.num_rows - reserve) // bs, budget)
            if chunk is not None and self.shuffle:
                order = np.arange(pool.num_rows)
                rng.shuffle(order[carry:])
                if runs == budget:  # the epoch's last batches: later rows would go unused
                    order = order[: runs * bs]
                # A permutation of the pool's rows is in bounds: skip Arrow's check.
                pool = pc.take(pool, order, boundscheck=False)
            if runs > 0:
                # Unshuffled, the pool is `rest` then the piece: the batches that join the two
                # go out apart, so that the others decode as views of the piece, not copies.
                joined = 0 if rest is None or self.shuffle else -(-rest.num_rows // bs) * bs
                cut = min(joined, runs * bs)
                for lo, hi in ((0, cut), (cut, runs * bs)):
                    if hi > lo:
                        yield self._decode(pool.slice(lo, hi - lo))
                carry = max(0, carry - runs * bs)
                budget -= runs
                if budget == 0:
                    return
            rest = pool.slice(max(runs, 0) * bs)
            if chunk is None:
                carry = rest.num_rows
        raise RuntimeError(
            f"flyte-hvd loader bug: {budget} batches short at the end of an epoch of {self.path}."
        )

    def _iterate_streaming(self, entropy: list[int]) -> Iterator[Batch]:
        rng = np.random.default_rng(entropy)
        bs = self.batch_size
        for run in _in_background(self._blocks(rng), _BLOCKS_AHEAD, "flyte-hvd-shuffle"):
            for start in range(0, _rows(run), bs):
                yield _slice(run, start, start + bs)

    def _iterate_cached(self, rng: np.random.Generator) -> Iterator[Batch]:
        return self._cached_blocks(rng, 1)

    def _cached_blocks(self, rng: np.random.Generator, batches: int) -> Iterator[Batch]:
        """The epoch's batches from the in-memory shard, ``batches`` at a time."""
        if self._cache is None:
            self._cache = self._decode(
                pa.concat_tables([self._read_piece(p) for p in self._pieces])
            )
        data, n, bs = self._cache, self.shard_rows, self.batch_size
        need = self._steps * bs
        passes = -(-need // n)
        order = (
            np.concatenate([rng.permutation(n) for _ in range(passes)])
            if self.shuffle
            else np.tile(np.arange(n), passes)
        )
        for step in range(0, self._steps, batches):
            yield _take(data, order[step * bs : min(step + batches, self._steps) * bs])


class AsyncDataLoaderMixin:
    """Reads batches in a background thread into a bounded queue, so that reading and
    decoding overlap training. An error in the thread is raised in the training loop (with
    its traceback); stopping early stops the thread.

    ``class MyLoader(AsyncDataLoaderMixin, ArrowDataLoader)``; ``async_loader_queue_size=0``
    reads in the caller's thread.
    """

    # ``*args``, ``**kwargs``: the arguments of the loader this is mixed into, passed on.
    def __init__(self, *args: Any, async_loader_queue_size: int = 8, **kwargs: Any):
        require_int("async_loader_queue_size", async_loader_queue_size, 0)
        self.async_loader_queue_size = async_loader_queue_size
        self._stop_events: set[threading.Event] = set()
        super().__init__(*args, **kwargs)

    def close_async_loader(self) -> None:
        """Stop background readers that are still running."""
        for event in list(self._stop_events):
            event.set()

    def _iterate(self, epoch: int) -> Iterator[Batch]:
        inner = super()._iterate(epoch)  # type: ignore[misc]
        if self.async_loader_queue_size == 0:
            return inner
        return self._background(inner)

    def _background(self, inner: Iterator[Batch]) -> Iterator[Batch]:
        stop = threading.Event()
        self._stop_events.add(stop)
        try:
            yield from _in_background(inner, self.async_loader_queue_size, "flyte-hvd-loader", stop)
        finally:
            self._stop_events.discard(stop)


class AsyncArrowDataLoader(AsyncDataLoaderMixin, ArrowDataLoader):
    """``ArrowDataLoader`` that prefetches in a background thread."""


_DONE = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _in_background(
    inner: Iterator[T], maxsize: int, name: str, stop: threading.Event | None = None
) -> Iterator[T]:
    """Run ``inner`` in a thread that stays at most ``maxsize`` items ahead; its error is
    raised here, with its traceback, and closing this generator (or setting ``stop``) ends
    the thread."""
    q: queue.Queue = queue.Queue(maxsize=maxsize)
    stop = stop or threading.Event()

    def put(item: T | object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in inner:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as error:
            put(_Failure(error))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                if stop.is_set():
                    return
                continue
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join(timeout=10)
        if not thread.is_alive() and hasattr(inner, "close"):
            inner.close()


def _column_list(arg: str, value: str | Sequence[str], specs: Mapping[str, object]) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    missing = [n for n in names if n not in specs]
    if not names or missing:
        raise ValueError(
            f"`{arg}`={value!r}: the loader reads only {list(specs)}; name columns it reads "
            f"(pass them in `columns`)."
        )
    return names


def _resolve_filesystem(
    path: str, store: Store | RemoteStore | None, filesystem: FileSystem | None
) -> tuple[pafs.FileSystem, str]:
    import pyarrow.fs as pafs

    fs, fs_path = _arrow_filesystem(path, store, filesystem)
    if isinstance(fs, pafs.LocalFileSystem):
        # Local files are memory-mapped: Parquet pages are decoded straight from the page
        # cache instead of being copied out of it by read() first.
        fs = pafs.LocalFileSystem(use_mmap=True)
    return fs, fs_path


def _arrow_filesystem(
    path: str, store: Store | RemoteStore | None, filesystem: FileSystem | None
) -> tuple[pafs.FileSystem, str]:
    import os

    import fsspec

    if store is not None:
        return as_arrow_filesystem(store.arrow_filesystem), store.fs_path(path)
    if filesystem is not None:
        if isinstance(filesystem, fsspec.AbstractFileSystem):
            return as_arrow_filesystem(filesystem), filesystem._strip_protocol(path)
        return as_arrow_filesystem(filesystem), path
    if "://" not in path or path.startswith("file://"):
        import pyarrow.fs

        local = path[len("file://") :] if path.startswith("file://") else path
        return pyarrow.fs.LocalFileSystem(), os.path.abspath(local)
    from flyte_hvd.data.store import url_to_fs

    fs, fs_path = url_to_fs(path)
    return as_arrow_filesystem(fs), fs_path


def _shard_pieces(fragments: list[ds.ParquetFileFragment], lo: int, hi: int) -> list[Piece]:
    """(row-group fragment, first row, end row) of every row group overlapping [lo, hi)."""
    pieces = []
    offset = 0
    for fragment in fragments:
        md = fragment.metadata
        for i in range(md.num_row_groups):
            n = md.row_group(i).num_rows
            start, stop = max(lo - offset, 0), min(hi - offset, n)
            if start < stop:
                pieces.append((fragment.subset(row_group_ids=[i]), start, stop))
            offset += n
            if offset >= hi:
                return pieces
    return pieces


def _table_pieces(table: pa.Table, path: str, rank: int) -> list[Piece]:
    """An in-memory table cut into pieces of ``_TABLE_PIECE_ROWS`` rows."""
    if table.num_rows == 0:
        raise ValueError(
            f"rank {rank} has no rows of `{path}`; every rank needs at least one row. Use "
            f"fewer ranks or more data."
        )
    rows = table.num_rows
    return [
        (table, lo, min(lo + _TABLE_PIECE_ROWS, rows)) for lo in range(0, rows, _TABLE_PIECE_ROWS)
    ]


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _stack(group: list[Batch]) -> Batch:
    return {k: np.stack([batch[k] for batch in group]) for k in group[0]}


def _as_groups(block: Batch, batch_size: int) -> Batch:
    """A block of whole batches as ``(batches, batch_size, *shape)`` views."""
    return {k: v.reshape(-1, batch_size, *v.shape[1:]) for k, v in block.items()}


def _take(batch: Batch, index: np.ndarray) -> Batch:
    return {k: np.take(v, index, axis=0) for k, v in batch.items()}


def _slice(batch: Batch, start: int, stop: int | None) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}
