"""Which store serves a path, and the stores' options.

:func:`get_fs` picks a store from the path's URL scheme: none or ``file://`` is the
local filesystem, anything else goes to fsspec (the optional extra
``shardckpt[s3]``; the core imports without it). Front doors resolve a path once
(:meth:`shardckpt.storage.location.Location.of`) and hand the store down.

Options of a store (endpoint, credentials, retries, part size) are set once per
scheme with :func:`configure`, or through the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, fsspec's ``FSSPEC_S3_*``), which
also reaches other client processes. Stores are created once per scheme, under a lock.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, Optional

from .base import FileSystem, split_scheme
from .local import local_fs

__all__ = ["get_fs", "configure", "reset", "mounted"]

_LOCK = threading.Lock()
_OPTIONS: Dict[str, Dict[str, Any]] = {}
_INSTANCES: Dict[str, FileSystem] = {}
_MOUNTED: Dict[str, FileSystem] = {}


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
    scheme, _ = split_scheme(str(path)) if path is not None else ("", "")
    if scheme == "file":
        scheme = ""
    with _LOCK:
        mounted_fs = _MOUNTED.get(scheme)
    if mounted_fs is not None:
        return mounted_fs
    if scheme == "":
        return local_fs
    with _LOCK:
        fs = _INSTANCES.get(scheme)
        if fs is None:
            from .fsspec_fs import FsspecFileSystem  # the optional extra: imported only when used

            fs = FsspecFileSystem.for_scheme(scheme, dict(_OPTIONS.get(scheme, {})))
            _INSTANCES[scheme] = fs
        return fs




@contextlib.contextmanager
def mounted(fs: FileSystem, scheme: str = "") -> Iterator[FileSystem]:
    """Serve paths of ``scheme`` (``""``: plain local paths) with ``fs`` inside the block.

    For wrappers (fault injection, recording; :mod:`shardckpt.storage.wrappers`) in tests
    and tools; process-wide while the block runs.
    """
    scheme = scheme.lower()
    with _LOCK:
        previous = _MOUNTED.get(scheme)
        _MOUNTED[scheme] = fs
    try:
        yield fs
    finally:
        with _LOCK:
            if previous is None:
                _MOUNTED.pop(scheme, None)
            else:
                _MOUNTED[scheme] = previous
