"""Reading checkpoints by path: ``load_checkpoint`` and friends, as in ``tf.train``."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..errors import NoCheckpointError, NotFoundError
from ..format.bundle_reader import BundleReader
from ..format.dtypes import DType
from ..format.naming import index_filename
from ..restoring import BundleSource, Read, read_one
from ..storage.base import FileSystem
from ..storage.location import Location
from ..storage.object_store import ObjectStore
from ..storage.registry import get_fs
from .state import clean_path, latest_checkpoint

__all__ = ["CheckpointReader", "load_checkpoint", "list_variables", "load_variable", "resolve_prefix", "open_bundle"]


def resolve_prefix(path: str) -> str:
    """Turn a checkpoint prefix, a checkpoint directory or a SavedModel directory into a prefix.

    A directory without a checkpoint raises :class:`~shardckpt.errors.NoCheckpointError` (a
    ``ValueError``, as TensorFlow's); a prefix without an index, ``NotFoundError``. Any spelling of
    a directory works (``./dir``, ``a/../dir``, ``dir/``, absolute): the state file's relative paths
    are joined to it.
    """
    path = clean_path(os.fspath(path))
    fs = get_fs(path)
    if isinstance(fs, ObjectStore) and fs.exists(index_filename(path)):  # object store: one lookup when a prefix
        return path
    if fs.isdir(path):
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
        saved_model = fs.join(path, "variables", "variables")
        if fs.exists(index_filename(saved_model)):
            return saved_model
        raise NoCheckpointError("no 'checkpoint' state file naming an existing checkpoint, and no "
                                "SavedModel variables, in this directory", path=path)
    if not fs.exists(index_filename(path)):
        raise NotFoundError("no checkpoint at this prefix (its .index file is missing)", path=path)
    return path


def open_bundle(path: str, fs: Optional[FileSystem] = None) -> BundleReader:
    """A reader of the checkpoint that ``path`` names, resolved as :func:`resolve_prefix` does
    (``fs``: the store to read, default chosen from the path).

    On object stores the path is first opened as a prefix: the reader's listing and
    index GET answer what the index lookup would have asked, one request fewer; only
    when no index is there is ``path`` resolved as a directory.
    """
    path = clean_path(os.fspath(path))
    store = fs if fs is not None else get_fs(path)
    if isinstance(store, ObjectStore):
        try:
            return BundleReader(path, fs=store)
        except NotFoundError:  # no index at this prefix: a directory, or nothing (said below)
            pass
    return BundleReader(Location.of(resolve_prefix(path), fs))


# TF's DataType enum names where they are not the dtype's name in capitals
_DT_NAMES = {"float32": "FLOAT", "float64": "DOUBLE", "float16": "HALF"}


def _name(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


class CheckpointReader:
    """What ``tf.train.load_checkpoint`` returns: the tensors of one checkpoint by key.

    Slice entries of partitioned tensors are hidden; their tensors are listed by
    their plain key and assembled by :meth:`get_tensor`.
    """

    def __init__(self, prefix: str, bundle: Optional[BundleReader] = None) -> None:
        self.bundle = bundle if bundle is not None else BundleReader(Location.of(prefix))
        self.prefix = self.bundle.prefix if bundle is not None else prefix

    def get_variable_to_shape_map(self) -> Dict[str, List[int]]:
        """Every key (partitioned tensors by their plain key) -> its full shape."""
        return {_name(k): list(self.bundle.shape(k)) for k in self.bundle.keys()}

    def get_variable_to_dtype_map(self) -> Dict[str, np.dtype]:
        """Keys to NumPy dtypes (``ml_dtypes`` for bfloat16/float8/int4; ``object`` for strings)."""
        return {_name(k): self.bundle.dtype(k).numpy for k in self.bundle.keys()}

    def get_variable_to_tf_dtype_map(self) -> Dict[str, DType]:
        """Keys to :class:`~shardckpt.format.dtypes.DType` (TensorFlow's dtype names and enums)."""
        return {_name(k): self.bundle.dtype(k) for k in self.bundle.keys()}

    def debug_string(self) -> bytes:
        """Every stored entry with its dtype and shape, one per line in index order, as TF's reader writes it
        (``b"dense/kernel/.ATTRIBUTES/VARIABLE_VALUE (DT_FLOAT) [3,4]\\n"``). As in TF, a partitioned
        tensor shows as its slice entries (raw keys, slice shapes), not under its plain key."""
        lines = []
        for kb in self.bundle.keys(include_slices=True):
            entry = self.bundle.entry(kb)
            if not kb or len(entry.slices):
                continue
            dtype = self.bundle.dtype(kb)
            dims = ",".join(str(int(n)) for n in self.bundle.shape(kb))
            name = _DT_NAMES.get(dtype.name, dtype.name.upper())
            lines.append(kb + f" (DT_{name}) [{dims}]\n".encode("ascii"))
        return b"".join(lines)

    def has_tensor(self, key: Union[str, bytes]) -> bool:
        """Whether ``key`` names a tensor of the checkpoint."""
        kb = key.encode("utf-8") if isinstance(key, str) else key
        return kb in self.bundle and not kb.startswith(b"\x00")

    def get_tensor(self, key: Union[str, bytes]) -> Any:
        """The whole tensor; strings come back as an object array of ``bytes``.

        Scalars come back as NumPy scalars (``np.float32(1.0)``; a scalar string as
        ``bytes``), as TensorFlow's reader returns them.
        """
        value = read_one(BundleSource(self.bundle, owned=False), Read(key))
        return value[()] if value.ndim == 0 else value

    def close(self) -> None:
        """Close the files (the reader cannot be used afterwards)."""
        self.bundle.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def load_checkpoint(ckpt_dir_or_file: str) -> CheckpointReader:
    """Open a checkpoint given its prefix or a directory holding a ``checkpoint`` file."""
    bundle = open_bundle(ckpt_dir_or_file)  # (object stores: no HEAD to tell a prefix from a directory)
    return CheckpointReader(bundle.prefix, bundle)


def list_variables(ckpt_dir_or_file: str) -> List[Tuple[str, List[int]]]:
    """``(key, shape)`` of every tensor, sorted by key."""
    with load_checkpoint(ckpt_dir_or_file) as reader:
        return sorted(reader.get_variable_to_shape_map().items())


def load_variable(ckpt_dir_or_file: str, name: str) -> Any:
    """One tensor. As in TF, a trailing ``:0`` in ``name`` is ignored."""
    if name.endswith(":0"):
        name = name[:-2]
    with load_checkpoint(ckpt_dir_or_file) as reader:
        return reader.get_tensor(name)
