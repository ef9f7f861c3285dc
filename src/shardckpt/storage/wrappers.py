"""Filesystems that wrap another: the base for fault injection and for recording what a save does.

:class:`FileSystemWrapper` forwards every operation to ``inner``; subclasses override
:meth:`FileSystemWrapper.before` (called with the operation's name and path before it
runs) or single methods. :class:`FaultInjectingFileSystem` raises chosen errors at
chosen operations. Put a wrapper in place for a scheme with
:func:`shardckpt.storage.registry.mounted`::

    faulty = FaultInjectingFileSystem(local_fs)
    faulty.fail("write_atomic", r"/model\\.index$", StorageError("injected"))
    with mounted(faulty):            # plain paths now go through ``faulty``
        save_tensors("/ckpt/model", tensors)
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .base import FileSystem, ReadHandle, WriteHandle

__all__ = ["FileSystemWrapper", "FaultInjectingFileSystem", "Fault", "RecordingFileSystem", "Op"]


class FileSystemWrapper(FileSystem):
    """Forward everything to ``inner``; :meth:`before` sees each operation first."""

    def __init__(self, inner: FileSystem) -> None:
        self.inner = inner
        self.supports_rename = inner.supports_rename
        self.read_step = inner.read_step

    def before(self, op: str, path: str) -> None:
        """Called before operation ``op`` on ``path`` (default: nothing)."""

    # reading
    def open_read(self, path: str) -> ReadHandle:
        self.before("open_read", path)
        return self.inner.open_read(path)

    def pread_into(self, handle: ReadHandle, buf: memoryview, offset: int, path: str = "") -> None:
        self.before("pread_into", path)
        self.inner.pread_into(handle, buf, offset, path)

    def size(self, path: str) -> int:
        self.before("size", path)
        return self.inner.size(path)

    def read_bytes(self, path: str) -> bytes:
        self.before("read_bytes", path)
        return self.inner.read_bytes(path)

    # writing
    def open_write(self, path: str) -> WriteHandle:
        self.before("open_write", path)
        return self.inner.open_write(path)

    def write_all(self, handle: WriteHandle, buf: memoryview, path: str = "") -> None:
        self.before("write_all", path)
        self.inner.write_all(handle, buf, path)

    def start_writeback(self, handle: WriteHandle, offset: int, length: int, path: str = "") -> None:
        self.inner.start_writeback(handle, offset, length, path)

    def fsync(self, handle: WriteHandle, path: str = "") -> None:
        self.before("fsync", path)
        self.inner.fsync(handle, path)

    def close(self, handle: ReadHandle) -> None:
        self.inner.close(handle)

    def discard(self, handle: WriteHandle) -> None:
        self.inner.discard(handle)

    def fsync_dir(self, path: str) -> None:
        self.before("fsync_dir", path)
        self.inner.fsync_dir(path)

    def temp_name(self, path: str) -> str:
        return self.inner.temp_name(path)

    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        self.before("write_atomic", path)
        self.inner.write_atomic(path, data, fsync=fsync)

    def copy_file(self, src: str, dst: str, *, fsync: bool = False) -> str:
        self.before("copy_file", dst)
        return self.inner.copy_file(src, dst, fsync=fsync)

    # names
    def rename(self, src: str, dst: str) -> None:
        self.before("rename", dst)
        self.inner.rename(src, dst)

    def remove(self, path: str) -> None:
        self.before("remove", path)
        self.inner.remove(path)

    def remove_tree(self, path: str) -> None:
        self.before("remove_tree", path)
        self.inner.remove_tree(path)

    def rmdir_if_empty(self, path: str) -> bool:
        self.before("rmdir_if_empty", path)
        return self.inner.rmdir_if_empty(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.inner.isfile(path)

    def makedirs(self, path: str) -> None:
        self.before("makedirs", path)
        self.inner.makedirs(path)

    def listdir(self, path: str) -> List[str]:
        self.before("listdir", path)
        return self.inner.listdir(path)

    # coordination
    def exclusive(self, directory: str) -> Any:
        return self.inner.exclusive(directory)

    def claim(self, path: str) -> Any:
        return self.inner.claim(path)

    def release(self, claim: Any) -> None:
        self.inner.release(claim)

    def claimed(self, path: str) -> bool:
        return self.inner.claimed(path)

    # path arithmetic
    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def dirname(self, path: str) -> str:
        return self.inner.dirname(path)

    def basename(self, path: str) -> str:
        return self.inner.basename(path)

    def isabs(self, path: str) -> bool:
        return self.inner.isabs(path)

    def normpath(self, path: str) -> str:
        return self.inner.normpath(path)

    def __getattr__(self, name: str) -> Any:  # a store's extras (e.g. pread_batch, counters)
        return getattr(self.inner, name)


@dataclass
class Fault:
    """Raise ``error`` (an exception, or a callable making one) at operation ``op`` on paths matching ``path``,
    skipping the first ``skip`` matches, at most ``times`` times (``None``: always)."""

    op: str
    path: "re.Pattern[str]"
    error: Union[BaseException, Callable[[str], BaseException]]
    skip: int = 0
    times: Optional[int] = 1
    when: Optional[Callable[[], bool]] = None
    hits: int = 0


class FaultInjectingFileSystem(FileSystemWrapper):
    """A wrapper that raises chosen errors at chosen operations (see :class:`Fault`)."""

    def __init__(self, inner: FileSystem) -> None:
        super().__init__(inner)
        self.faults: List[Fault] = []
        self._lock = threading.Lock()

    def fail(self, op: str, path: str = "", error: Union[BaseException, Callable[[str], BaseException], None] = None,
             *, skip: int = 0, times: Optional[int] = 1, when: Optional[Callable[[], bool]] = None) -> Fault:
        """Add a fault: ``op`` is an operation name (``"write_all"``, ``"write_atomic"``, ``"rename"``, ...),
        ``path`` a regular expression searched in the path."""
        fault = Fault(op, re.compile(path), error if error is not None else OSError(5, "injected I/O error"),
                      skip, times, when)
        self.faults.append(fault)
        return fault

    def before(self, op: str, path: str) -> None:
        with self._lock:
            for fault in self.faults:
                if fault.op != op or not fault.path.search(path) or (fault.when is not None and not fault.when()):
                    continue
                fault.hits += 1
                if fault.hits <= fault.skip or (fault.times is not None and fault.hits > fault.skip + fault.times):
                    continue
                error = fault.error
                raise error(path) if callable(error) and not isinstance(error, BaseException) else error


#: One recorded operation: ``(kind, path, data_or_second_path)``.
Op = Tuple[str, str, Any]


class RecordingFileSystem(FileSystemWrapper):
    """A wrapper that logs every operation that changes what is on disk, in order.

    Kinds: ``create`` (path), ``write`` (path, bytes), ``fsync`` (path: the file's data),
    ``rename`` (src, dst), ``link`` (src, dst: a second name for src's file; a reflink or copy
    is recorded as the create / write / fsync it amounts to), ``remove`` (path), ``remove_tree`` (path),
    ``mkdir`` (path),
    ``fsync_dir`` (path: the directory's entries). ``write_atomic`` is recorded as the
    create / write / fsync / rename it is made of, so a crash-state checker can place
    a power loss between any two of them. For the method of ALICE (OSDI'14) and
    CrashMonkey (OSDI'18); see tests/helpers/crash_states.py.
    """

    def __init__(self, inner: FileSystem) -> None:
        super().__init__(inner)
        self.ops: List[Op] = []
        self._paths: Dict[int, str] = {}
        self._log_lock = threading.Lock()

    def _log(self, kind: str, path: str, extra: Any = None) -> None:
        with self._log_lock:
            self.ops.append((kind, path, extra))

    def open_write(self, path: str) -> WriteHandle:
        handle = self.inner.open_write(path)
        self._log("create", path)
        return handle

    def write_all(self, handle: WriteHandle, buf: memoryview, path: str = "") -> None:
        self.inner.write_all(handle, buf, path)
        self._log("write", path, bytes(buf))

    def fsync(self, handle: WriteHandle, path: str = "") -> None:
        self.inner.fsync(handle, path)
        self._log("fsync", path)

    def fsync_dir(self, path: str) -> None:
        self.inner.fsync_dir(path)
        self._log("fsync_dir", path)

    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        tmp = self.inner.temp_name(path)
        handle = self.open_write(tmp)
        try:
            self.write_all(handle, memoryview(data), tmp)
            if fsync:
                self.fsync(handle, tmp)
        except BaseException:
            self.inner.close(handle)
            self.remove(tmp)
            raise
        self.inner.close(handle)
        self.rename(tmp, path)

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)
        self._log("rename", src, dst)

    def copy_file(self, src: str, dst: str, *, fsync: bool = False) -> str:
        how = self.inner.copy_file(src, dst, fsync=fsync)
        if how == "link":
            self._log("link", src, dst)
        else:
            self._log("create", dst)
            self._log("write", dst, self.inner.read_bytes(dst))
            if fsync:
                self._log("fsync", dst)
        return how

    def remove(self, path: str) -> None:
        existed = self.inner.exists(path)
        self.inner.remove(path)
        if existed:
            self._log("remove", path)

    def remove_tree(self, path: str) -> None:
        existed = self.inner.exists(path)
        self.inner.remove_tree(path)
        if existed:
            self._log("remove_tree", path)

    def rmdir_if_empty(self, path: str) -> bool:
        removed = self.inner.rmdir_if_empty(path)
        if removed:
            self._log("remove_tree", path)
        return removed

    def makedirs(self, path: str) -> None:
        missing = []
        p = path
        while p and not self.inner.isdir(p):
            missing.append(p)
            parent = self.inner.dirname(p)
            if parent == p:
                break
            p = parent
        self.inner.makedirs(path)
        for d in reversed(missing):
            self._log("mkdir", d)
