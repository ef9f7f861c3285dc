"""Write-behind for durable local writes: start the device write of bytes already written.

A durable save writes a data file and fsyncs it before the commit. Without a hint the
kernel holds the written pages dirty until that fsync (far below the dirty-memory
thresholds at checkpoint sizes), so the whole file reaches the device only after the
last byte was copied: writing and writing back run one after the other. A writer that
knows it will fsync calls :func:`start` for each range it has finished (the bundle
writer does so every :data:`STEP` bytes); the range's write-back then begins at once,
while the next bytes are copied in, and the final fsync only waits for the tail.

On Linux :func:`start` is ``sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)``,
issued on a helper thread so that the writer never blocks on a busy device queue.
It promises nothing about durability: the writer still fsyncs the file (and the
commit protocol its folder) exactly as without it. Where the call does not exist
or fails (other systems, filesystems that refuse it) it is a no-op.

Descriptors: a pending request names a file descriptor, so the owner calls
:func:`drain` before it fsyncs or closes it (``LocalFileSystem.fsync`` / ``close``
do): no request outlives its descriptor, and none can reach a file that reuses the
number. A forked child starts with no helper thread and no pending requests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

__all__ = ["STEP", "available", "start", "drain"]

#: bytes a writer accumulates before it starts their write-back
STEP = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2

_log = logging.getLogger("shardckpt")
_lock = threading.Lock()
_pending: Dict[int, List["Future[None]"]] = {}
_executor: Optional[ThreadPoolExecutor] = None
_disabled = False


def _load() -> Optional[Callable[..., int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range  # CDLL calls release the GIL
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sync_file_range = _load()


def available() -> bool:
    """Whether :func:`start` does anything on this system."""
    return _sync_file_range is not None and not _disabled


def _run(fd: int, offset: int, length: int) -> None:
    global _disabled
    assert _sync_file_range is not None
    if _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        if not _disabled:  # a hint only: the writer's fsync does the work instead
            _disabled = True
            _log.info("sync_file_range is refused here (errno %d): write-behind off", err)


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-writeback")
    return _executor


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's helper threads: start afresh (a pool whose thread
    is gone would never run a request, and ``drain`` would wait forever)."""
    global _executor, _lock, _pending
    _executor = None
    _lock = threading.Lock()
    _pending = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def start(fd: int, offset: int, length: int) -> None:
    """Begin writing ``length`` bytes of ``fd`` from ``offset`` to the device; returns at once."""
    if _sync_file_range is None or _disabled or length <= 0:
        return
    with _lock:
        try:
            future = _pool().submit(_run, fd, offset, length)
        except RuntimeError:  # interpreter shutting down: the fsync does it all
            return
        _pending.setdefault(fd, []).append(future)


def drain(fd: Any) -> None:
    """Wait for every request :func:`start` made for ``fd`` (before fsyncing or closing it)."""
    if fd not in _pending:  # the common case (reads, small files): no lock taken
        return
    with _lock:
        futures = _pending.pop(fd, [])
    for future in futures:
        try:
            future.result()
        except Exception as exc:  # a hint that failed: the fsync that follows reports real errors
            _log.debug("write-behind request failed: %s", exc)
