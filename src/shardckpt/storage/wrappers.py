"""Filesystems that wrap another: the base for fault injection and for recording what a save does.

:class:`FileSystemWrapper` forwards every operation to ``inner``, each one written out
(no ``__getattr__``: a wrapper answers exactly what the interface declares, so what it
reads and writes is what production does); subclasses override
:meth:`FileSystemWrapper.before` (called with the operation's name and path before it
runs) or single methods. Around an :class:`~shardckpt.storage.object_store.ObjectStore`
a wrapper is an :class:`ObjectStoreWrapper`: every object-store member (``put``,
``create_exclusive``, ``remove_if``, listings, ...) is forwarded through ``before`` too,
so a fault can be injected at any of them (e.g. ``faulty.fail("put", r"\\.index$")``:
the index PUT of an index-last commit). ``FileSystemWrapper(store)`` and its subclasses
become object-store wrappers by themselves when ``store`` is one.
:class:`FaultInjectingFileSystem` raises chosen errors at chosen operations. Put a wrapper in
place for a scheme with
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .base import FileSystem, Identity, ReadHandle, WriteHandle
from .object_store import ListedIndex, ObjectInfo, ObjectStore, PendingUpload

__all__ = ["FileSystemWrapper", "ObjectStoreWrapper", "FaultInjectingFileSystem", "Fault", "RecordingFileSystem",
           "Op"]

_OBJECT_STORE_FORMS: Dict[type, type] = {}
_FORMS_LOCK = threading.Lock()


def _object_store_form(cls: type) -> type:
    """``cls`` (a wrapper class) as a wrapper of object stores: a subclass of it and :class:`ObjectStoreWrapper`
    (made once per class; ``cls``'s own overrides come first)."""
    if cls is FileSystemWrapper:
        return ObjectStoreWrapper
    with _FORMS_LOCK:
        form = _OBJECT_STORE_FORMS.get(cls)
        if form is None:
            form = type(cls.__name__, (cls, ObjectStoreWrapper), {"__module__": cls.__module__,
                                                                  "__qualname__": cls.__qualname__})
            _OBJECT_STORE_FORMS[cls] = form
        return form


class FileSystemWrapper(FileSystem):
    """Forward everything to ``inner``; :meth:`before` sees each operation first.

    Made around an :class:`~shardckpt.storage.object_store.ObjectStore` (the first argument,
    or ``inner=``), any wrapper class is instantiated in its object-store form (the class
    and :class:`ObjectStoreWrapper`), which is an ``ObjectStore`` and forwards its members.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "FileSystemWrapper":
        inner = args[0] if args else kwargs.get("inner")
        form = _object_store_form(cls) if isinstance(inner, ObjectStore) and not issubclass(cls, ObjectStore) else cls
        return super().__new__(form)

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

    def identity(self, path: str, handle: Optional[ReadHandle] = None) -> Identity:
        self.before("identity", path)
        return self.inner.identity(path, handle)

    def identities(self, paths: Sequence[str]) -> "dict[str, Optional[Identity]]":
        for path in paths:
            self.before("identities", path)
        return self.inner.identities(paths)

    @property
    def prefetches(self) -> bool:
        return self.inner.prefetches

    def prefetches_in(self, folder: str) -> bool:
        return self.inner.prefetches_in(folder)

    def prefetch(self, handle: ReadHandle, starts: Any, ends: Any, path: str = "") -> int:
        return self.inner.prefetch(handle, starts, ends, path)

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


class ObjectStoreWrapper(FileSystemWrapper, ObjectStore):
    """A wrapper of an :class:`~shardckpt.storage.object_store.ObjectStore`: every member forwarded to
    ``inner``, each through :meth:`before` (the operation's name is the member's name)."""

    inner: ObjectStore

    def __init__(self, inner: FileSystem) -> None:
        if not isinstance(inner, ObjectStore):
            raise TypeError(f"{type(self).__name__} wraps an ObjectStore, not {type(inner).__name__}")
        super().__init__(inner)

    @property
    def conditional_writes(self) -> bool:
        return self.inner.conditional_writes

    @conditional_writes.setter
    def conditional_writes(self, value: bool) -> None:
        self.inner.conditional_writes = value

    @property
    def stale_after(self) -> float:
        return self.inner.stale_after

    @stale_after.setter
    def stale_after(self, value: float) -> None:
        self.inner.stale_after = value

    # writers
    def put(self, path: str, data: bytes, *, if_match: Optional[str] = None, if_none_match: bool = False) -> str:
        self.before("put", path)
        return self.inner.put(path, data, if_match=if_match, if_none_match=if_none_match)

    def create_exclusive(self, path: str) -> WriteHandle:
        self.before("create_exclusive", path)
        return self.inner.create_exclusive(path)

    def written_etag(self, handle: WriteHandle) -> Optional[str]:
        return self.inner.written_etag(handle)

    def head_etag(self, path: str) -> Optional[str]:
        self.before("head_etag", path)
        return self.inner.head_etag(path)

    def remove_if(self, path: str, etag: str) -> bool:
        self.before("remove_if", path)
        return self.inner.remove_if(path, etag)

    def remove_many(self, paths: Sequence[str]) -> None:
        for path in paths:
            self.before("remove_many", path)
        self.inner.remove_many(paths)

    def list_details(self, path: str) -> Dict[str, ObjectInfo]:
        self.before("list_details", path)
        return self.inner.list_details(path)

    # a dead save's multipart uploads
    def list_uploads(self, path: str) -> List[PendingUpload]:
        self.before("list_uploads", path)
        return self.inner.list_uploads(path)

    def upload_activity(self, path: str, upload_id: str) -> float:
        self.before("upload_activity", path)
        return self.inner.upload_activity(path, upload_id)

    def abort_upload(self, path: str, upload_id: str) -> None:
        self.before("abort_upload", path)
        self.inner.abort_upload(path, upload_id)

    # readers
    def list_identities(self, prefix: str) -> Optional[Dict[str, Identity]]:
        self.before("list_identities", prefix)
        return self.inner.list_identities(prefix)

    def list_and_read(self, prefix: str, path: str, limit: int) -> Optional[ListedIndex]:
        self.before("list_and_read", path)
        return self.inner.list_and_read(prefix, path, limit)

    def pin(self, handle: ReadHandle, identity: Any) -> bool:
        return self.inner.pin(handle, identity)


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
