"""Spark ML persistence of the estimators and models: ``save``/``load`` as one archive
through the Store (any scheme, Spark Connect too), with pyspark's ``metadata`` beside it so
that ``Pipeline``, ``PipelineModel`` and ``CrossValidatorModel`` save and load them as
stages."""

from __future__ import annotations

import io
import json
import posixpath
import time
import zipfile
from typing import TYPE_CHECKING, Any, ClassVar

import pyspark
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter


class Archived(MLWritable, MLReadable):
    """Saved as one archive through the Store (``ArchiveWriter``, ``ArchiveReader``):
    pyspark's MLWriter/MLReader go through the JVM; these work on any scheme, and on Spark
    Connect too, and keep pyspark's ``write().overwrite().save()`` shape."""

    _archive_name: ClassVar[str]
    if TYPE_CHECKING:  # of the Params it is mixed into
        uid: str

        def _resetUid(self, newUid: Any) -> Archived: ...

    def write(self) -> ArchiveWriter:  # type: ignore[override]
        return ArchiveWriter(self)

    @classmethod
    def read(cls) -> ArchiveReader:  # type: ignore[override]
        return ArchiveReader(cls)

    def _saved_files(self) -> dict[str, bytes]:
        raise NotImplementedError

    @classmethod
    def _from_saved(cls, files: dict[str, bytes]) -> Archived:
        raise NotImplementedError


PARAMS_FILE = "params.pkl"  # an archive's params (cloudpickle)
UID_FILE = "uid"  # an archive's uid, which a saved Pipeline names its stages by


class ArchiveWriter(MLWriter):
    """Saves an estimator or a model under ``path`` (local or a URL): one zip (its params, a
    model's bytes, its uid) and pyspark's ``metadata`` (the class to load it with), so that
    ``Pipeline``, ``PipelineModel`` and ``CrossValidatorModel`` save and load it as a stage."""

    def __init__(self, instance: Archived):
        super().__init__()
        self.instance = instance

    def overwrite(self) -> ArchiveWriter:
        self.shouldOverwrite = True
        return self

    def save(self, path: str) -> None:
        """Writes ``path/<archive>`` in one atomic step (local: write, then rename; object
        stores: one PUT), through the Store for ``path``'s scheme (S3 credentials and
        endpoint from the usual AWS environment variables), then ``path/metadata``. Nothing
        is written when the instance cannot be saved; a ``Pipeline`` being saved around it is
        then removed too (``_remove_unfinished_pipeline``)."""
        from flyte_hvd.data.store import Store, bounded, url_to_fs

        instance = self.instance
        fs, root = url_to_fs(path)
        if fs.exists(root) and not self.shouldOverwrite:
            raise ValueError(
                f"{path!r} already exists; use .write().overwrite().save(path) to replace it."
            )
        try:
            files = {**instance._saved_files(), UID_FILE: instance.uid.encode()}
        except Exception as error:
            _remove_unfinished_pipeline(fs, root, instance.uid)
            raise ValueError(
                f"cannot save {type(instance).__name__} `{instance.uid}` to {path!r}: a param "
                f"value cannot be pickled ({type(error).__name__}: {error}). Nothing was "
                f"written; give that param a value that pickles (or unset it) and save again."
            ) from error
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for name, data in files.items():
                archive.writestr(name, data)
        store = Store.create(path)  # fails here, naming the path, if it cannot be written
        target, data = store.join(store.prefix_path, instance._archive_name), buffer.getvalue()
        bounded(store, ("writing", "to"), target, len(data), store.write_bytes, target, data)
        # pyspark's metadata: ``DefaultParamsReader.loadParamsInstance`` reads the class from
        # it when the instance is a stage of a saved Pipeline or CrossValidatorModel.
        cls = type(instance)
        metadata = json.dumps(
            {
                "class": f"{cls.__module__}.{cls.__qualname__}",
                "timestamp": int(time.time() * 1000),
                "sparkVersion": pyspark.__version__,
                "uid": instance.uid,
                "paramMap": {},
                "defaultParamMap": {},
            }
        )
        target = store.join(store.prefix_path, "metadata", "part-00000")
        bounded(store, ("writing", "to"), target, len(metadata), store.write_text, target, metadata)


def _remove_unfinished_pipeline(fs: Any, root: str, uid: str) -> None:
    """When ``root`` is the folder of stage ``uid`` of a ``Pipeline`` or ``PipelineModel``
    being saved (``<pipeline>/stages/<index>_<uid>``, the pipeline's metadata naming the
    stage), remove what that save wrote: its ``metadata`` and ``stages`` folders, and the
    pipeline's folder if nothing else is left in it."""
    stages = posixpath.dirname(root.rstrip("/"))
    pipeline = posixpath.dirname(stages)
    if posixpath.basename(stages) != "stages" or not posixpath.basename(root).endswith(uid):
        return
    try:
        parts = fs.glob(f"{pipeline}/metadata/part-*")
        named = any(uid in json.loads(fs.cat_file(p))["paramMap"]["stageUids"] for p in parts)
    except (OSError, ValueError, KeyError, TypeError):
        return
    if named:
        for folder in (f"{pipeline}/metadata", stages):
            fs.rm(folder, recursive=True)
        if not fs.ls(pipeline):
            fs.rm(pipeline, recursive=True)


class ArchiveReader(MLReader):
    def __init__(self, cls: type[Archived]):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Archived:
        from flyte_hvd.data.store import url_to_fs

        cls = self.cls
        fs, root = url_to_fs(path)
        target = f"{root.rstrip('/')}/{cls._archive_name}"
        if not fs.exists(target):
            raise ValueError(f"{path!r} holds no saved {cls.__name__} (expected {target}).")
        with fs.open(target, "rb") as f, zipfile.ZipFile(io.BytesIO(f.read())) as archive:
            files = {name: archive.read(name) for name in archive.namelist()}
        instance = cls._from_saved(files)
        if UID_FILE in files:  # a Pipeline's or CrossValidator's params name it by uid
            instance._resetUid(files[UID_FILE].decode())
        return instance
