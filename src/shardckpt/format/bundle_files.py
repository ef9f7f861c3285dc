"""The data files of an opened bundle: opened on first use, each held to the checkpoint that was opened.

A :class:`DataFiles` opens ``<prefix>.data-NNNNN-of-NNNNN`` when a read first needs it
and keeps it open until :meth:`DataFiles.close`. With a store that gives identities
(inode/size/mtime locally, size and ETag on object stores), a data file opened now must
still have the identity recorded when the index was opened (one deleted since then is a
replaced checkpoint, :class:`~shardckpt.errors.CheckpointReplacedError`, not a missing
file); where the store can, later reads of the handle are pinned to that identity (a
replaced object fails the read). Reads whose bytes no checksum covers ask
:meth:`DataFiles.check_unchanged` afterwards. :meth:`DataFiles.locate` checks, reading no
tensor bytes, that a stored piece lies inside its file and holds exactly its box.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import DataLossError, NotFoundError
from ..storage.base import FileSystem
from .bundle_index import BundleIndex, check_shape, replaced
from .bundle_pieces import StoredPiece
from .dtypes import DType
from .naming import data_filename
from .tensor_slice import box_shape, box_volume

__all__ = ["DataFiles"]


class DataFiles:
    """The data files of the bundle whose :class:`BundleIndex` is ``index``, on ``fs``. Safe to share
    between threads.

    ``fds``, ``sizes`` and ``paths`` map shard ids to the open handle, the file's size and
    its path (filled as files are opened); ``identities`` to the identity recorded.
    """

    def __init__(self, index: BundleIndex, fs: FileSystem, identity_of: Optional[Callable[..., Any]]) -> None:
        self._index = index
        self._fs = fs
        self._identity_of = identity_of
        self.prefix = index.prefix
        self.num_shards = index.num_shards
        self.fds: Dict[int, Any] = {}
        self.sizes: Dict[int, int] = {}
        self.paths: Dict[int, str] = {}
        self.identities: Dict[int, Any] = dict(index.data_identities)  # shard -> identity at open (None: missing)
        self._lock = threading.Lock()

    def path(self, shard_id: int) -> str:
        """The path of data file ``shard_id``."""
        path = self.paths.get(shard_id)
        if path is None:
            path = self.paths[shard_id] = data_filename(self.prefix, shard_id, self.num_shards)
        return path

    def open(self, shard_id: int) -> Tuple[Any, int]:
        """The open handle of data file ``shard_id`` and the file's size (opened and checked on first use)."""
        with self._lock:
            fd = self.fds.get(shard_id)
            if fd is None:
                fd, size = self._open(shard_id)
                self.fds[shard_id] = fd
                self.sizes[shard_id] = size
            return fd, self.sizes[shard_id]

    def _open(self, shard_id: int) -> Tuple[Any, int]:
        fs = self._fs
        path = self.path(shard_id)
        if self._identity_of is None:
            if not fs.exists(path):
                raise NotFoundError("data file of the checkpoint is missing", path=path)
            return fs.open_read(path), fs.size(path)
        known = shard_id in self.identities
        recorded = self.identities.get(shard_id)
        if known and recorded is None:
            if fs.exists(path):
                raise replaced(path, "the data file was missing when the index was opened and exists now")
            raise NotFoundError("data file of the checkpoint is missing", path=path)
        try:
            fd = fs.open_read(path)
        except NotFoundError:
            if known:  # it was there when the index was opened: the prefix was overwritten since
                raise replaced(path, "the data file was deleted after the index was opened") from None
            raise
        pinned = known and self._index.pin_handle(fd, recorded)  # then the identity costs no request
        try:
            now = self._identity_of(path, fd)
            if not pinned:
                self._index.pin_handle(fd, now)  # later reads see this version or fail
        except BaseException:
            fs.close(fd)
            raise
        if known and now != recorded:
            fs.close(fd)
            raise replaced(path, "the data file differs from the one present when the index "
                                 f"was opened (identity {now} != {recorded})")
        self.identities[shard_id] = now
        return fd, int(now[0])

    def check_unchanged(self, shard_id: int) -> None:
        """After a read no checksum covers: raise if the data file changed since it was opened."""
        if self._identity_of is None:
            return
        path = self.path(shard_id)
        with self._lock:
            fd = self.fds.get(shard_id)
            recorded = self.identities.get(shard_id)
        try:
            now = self._identity_of(path, fd)
        except NotFoundError:  # (a local descriptor is checked with fstat and never gets here)
            raise replaced(path, "the data file was deleted") from None
        if now != recorded:
            raise replaced(path, f"the data file changed while it was read (identity {now} != {recorded})")

    def locate(self, piece: StoredPiece, dt: DType) -> Tuple[Any, str]:
        """Open the piece's data file and check the entry fits in it and its size is right."""
        entry = piece.entry
        path = self.path(entry.shard_id)
        fd, file_size = self.open(entry.shard_id)
        if entry.offset + entry.size > file_size:
            raise DataLossError(f"entry points past the end of the data file (offset {entry.offset} + "
                                f"size {entry.size} > file size {file_size})", path=path, **piece.where())
        if dt.itemsize is not None:
            expected = box_volume(piece.box) * dt.itemsize
            if entry.size != expected:
                raise DataLossError(f"entry holds {entry.size} bytes, shape {list(box_shape(piece.box))} of "
                                    f"{dt.name} needs {expected}", path=path, **piece.where())
        elif entry.size < box_volume(piece.box):
            raise DataLossError(f"entry holds {entry.size} bytes, too few for "
                                f"{box_volume(piece.box)} elements", path=path, **piece.where())
        check_shape(entry, self._index.index_path, piece.tensor_key, dt.itemsize or 8)
        return fd, path

    def close(self) -> None:
        """Close every open data file (a later read opens it again)."""
        with self._lock:
            for fd in self.fds.values():
                self._fs.close(fd)
            self.fds.clear()
