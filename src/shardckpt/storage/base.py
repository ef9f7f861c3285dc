"""The storage interface under the format and saving rooms, and the choice of store by path.

Two implementations: :class:`~shardckpt.storage.local.LocalFileSystem` (POSIX files,
handles are int descriptors, atomic rename) and
:class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem` (any fsspec store: ``s3://``
through s3fs, ``gs://`` through gcsfs, ``memory://`` for tests; no rename, objects
appear whole when their upload completes). :func:`get_fs` picks one from the path's
URL scheme: none or ``file://`` is local, anything else goes to fsspec (the
optional extra ``shardckpt[s3]``; the core imports without it).

Options of a store (endpoint, credentials, retries, part size) are set once per
scheme with :func:`configure`, or through the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, fsspec's ``FSSPEC_S3_*``), which
also reaches other client processes.
"""

from __future__ import annotations

import posixpath
import re
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["FileSystem", "RunBatch", "get_fs", "configure", "split_scheme", "is_local_path", "normalize", "reset"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class FileSystem:
    """What the engine needs from a store. Handles are opaque (int descriptors locally).

    Writers: ``open_write`` -> ``write_all``* -> ``fsync`` -> ``close`` (on an object
    store ``close`` completes the upload and raises if it fails); ``discard`` drops
    a handle without publishing anything it wrote where the store allows that.
    """

    #: Whether ``rename`` is atomic and cheap. Object stores: False (the engine then
    #: writes data in place and commits by writing the index last).
    supports_rename: bool = True
    #: Preferred size of one read request (``None``: the reader's own defaults).
    read_step: Optional[int] = None

    # reading
    def open_read(self, path: str) -> Any: raise NotImplementedError
    def pread_into(self, handle: Any, buf: memoryview, offset: int, path: str = "") -> None:
        raise NotImplementedError
    def pread_batch(self, handle: Any, requests: Sequence[Tuple[int, memoryview]], path: str = "") -> None:
        """Fill every ``(offset, buffer)`` of ``requests`` from ``handle``.

        The default serves them one by one with :meth:`pread_into`; stores override it
        to coalesce nearby ranges or keep several requests in flight. ``requests`` may
        be a :class:`RunBatch` (many equal runs), which a store may serve in bulk.
        """
        for offset, buf in requests:
            self.pread_into(handle, buf, offset, path)

    def size(self, path: str) -> int: raise NotImplementedError
    def read_bytes(self, path: str) -> bytes: raise NotImplementedError

    # writing
    def open_write(self, path: str) -> Any: raise NotImplementedError
    def write_all(self, handle: Any, buf: memoryview, path: str = "") -> None: raise NotImplementedError
    def fsync(self, handle: Any, path: str = "") -> None: raise NotImplementedError
    def close(self, handle: Any) -> None: raise NotImplementedError

    def discard(self, handle: Any) -> None:
        """Drop a write handle after a failure (default: close it)."""
        self.close(handle)

    def fsync_dir(self, path: str) -> None: raise NotImplementedError
    def temp_name(self, path: str) -> str: raise NotImplementedError
    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None: raise NotImplementedError

    # names
    def rename(self, src: str, dst: str) -> None: raise NotImplementedError
    def remove(self, path: str) -> None: raise NotImplementedError
    def remove_tree(self, path: str) -> None: raise NotImplementedError
    def rmdir_if_empty(self, path: str) -> bool: raise NotImplementedError
    def exists(self, path: str) -> bool: raise NotImplementedError
    def isdir(self, path: str) -> bool: raise NotImplementedError
    def isfile(self, path: str) -> bool: raise NotImplementedError
    def makedirs(self, path: str) -> None: raise NotImplementedError
    def listdir(self, path: str) -> List[str]: raise NotImplementedError

    # path arithmetic
    def join(self, *parts: str) -> str: raise NotImplementedError
    def dirname(self, path: str) -> str: raise NotImplementedError
    def basename(self, path: str) -> str: raise NotImplementedError
    def isabs(self, path: str) -> bool: raise NotImplementedError
    def normpath(self, path: str) -> str: raise NotImplementedError


class RunBatch(Sequence[Tuple[int, memoryview]]):
    """Requests of :meth:`FileSystem.pread_batch` in bulk: ``len(offsets)`` runs of ``run_bytes`` each.

    Run ``i`` is read from file offset ``offsets[i]`` (an int64 array, ascending) into
    ``dest[i * run_bytes:(i + 1) * run_bytes]``. As a sequence it yields the usual
    ``(offset, buffer)`` pairs, so any store can serve it one by one. ``cover``, when
    given, is a ``(start, length)`` range holding every run (e.g. whole rows) that a
    store for which requests cost more than bytes may read whole instead.
    """

    def __init__(self, offsets: Any, run_bytes: int, dest: memoryview,
                 cover: Optional[Tuple[int, int]] = None) -> None:
        self.offsets = offsets
        self.run_bytes = int(run_bytes)
        self.dest = dest
        self.cover = cover

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        rb = self.run_bytes
        return int(self.offsets[i]), self.dest[i * rb:(i + 1) * rb]


def split_scheme(path: str) -> Tuple[str, str]:
    """``("s3", "bucket/key")`` for ``s3://bucket/key``; ``("", path)`` without a scheme."""
    m = _SCHEME.match(path)
    if m is None:
        return "", path
    return m.group(1).lower(), path[m.end():]


def normalize(path: Any) -> str:
    """``path`` as a string; ``file:///x`` becomes ``/x`` (served by the local filesystem)."""
    import os

    path = os.fspath(path)
    if path[:7].lower() == "file://":
        return path[7:]
    return path


def is_local_path(path: str) -> bool:
    scheme, _ = split_scheme(path)
    return scheme in ("", "file")


_LOCK = threading.Lock()
_OPTIONS: Dict[str, Dict[str, Any]] = {}
_INSTANCES: Dict[str, FileSystem] = {}


def configure(scheme: str, **options: Any) -> None:
    """Set the options of the store behind ``scheme`` (``"s3"``, ``"gs"``, ...), replacing earlier ones.

    Options that shardckpt itself reads: ``retries`` (attempts per request, default 6),
    ``backoff`` (first wait in seconds, doubled per attempt, default 0.2),
    ``max_backoff`` (default 10), ``part_size`` (multipart upload part and read
    request size, default 32 MiB), ``max_concurrency`` (parts in flight per object,
    default 8). Everything else goes to the fsspec filesystem, e.g. for S3::

        shardckpt.storage.configure("s3", endpoint_url="http://127.0.0.1:9000",
                                    key="...", secret="...")

    ``endpoint_url`` is a shortcut for ``client_kwargs={"endpoint_url": ...}``.
    Call with no options to go back to the environment's defaults.
    """
    scheme = scheme.lower()
    with _LOCK:
        _OPTIONS[scheme] = dict(options)
        _INSTANCES.pop(scheme, None)


def reset() -> None:
    """Forget every configured option and cached store (tests)."""
    with _LOCK:
        _OPTIONS.clear()
        _INSTANCES.clear()


def get_fs(path: Optional[str] = None) -> FileSystem:
    """The store that serves ``path``: local for plain paths and ``file://``, fsspec otherwise."""
    from .local import local_fs

    if path is None:
        return local_fs
    scheme, _ = split_scheme(str(path))
    if scheme in ("", "file"):
        return local_fs
    with _LOCK:
        fs = _INSTANCES.get(scheme)
        if fs is None:
            from .fsspec_fs import FsspecFileSystem

            fs = FsspecFileSystem.for_scheme(scheme, dict(_OPTIONS.get(scheme, {})))
            _INSTANCES[scheme] = fs
        return fs


def posix_dirname(path: str) -> str:
    """``posixpath.dirname`` that never climbs above ``scheme://bucket``."""
    scheme, rest = split_scheme(path)
    if not scheme:
        return posixpath.dirname(path)
    parent = posixpath.dirname(rest.rstrip("/"))
    return f"{scheme}://{parent}" if parent else f"{scheme}://{rest.split('/', 1)[0]}"
