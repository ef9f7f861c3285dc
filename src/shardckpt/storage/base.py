"""The storage interface under the format and saving rooms.

Two implementations: :class:`~shardckpt.storage.local.LocalFileSystem` (POSIX files,
handles are int descriptors, atomic rename) and
:class:`~shardckpt.storage.fsspec_fs.FsspecFileSystem` (any fsspec store: ``s3://``
through s3fs, ``gs://`` through gcsfs, ``memory://`` for tests; no rename, objects
appear whole when their upload completes). Which store serves a path is decided
once, at a front door, by :func:`shardckpt.storage.registry.get_fs` (or
:meth:`shardckpt.storage.location.Location.of`); the rooms below receive the
filesystem object and never look it up again.

Roles and call sequences (who calls what):

* **Writers** (``format.BundleWriter``, the committers):
  ``open_write`` -> ``write_all`` (repeated, with ``start_writeback`` hints for what is
  written when an ``fsync`` will follow) -> [``fsync``] -> ``close``. On an object store
  ``close`` completes the upload and raises if it fails; ``discard`` drops a handle
  without publishing anything it wrote where the store allows that.
  ``write_atomic`` writes a small whole file (an index, the state file) so that
  readers see the old content or the new one, never a mix.
* **Readers** (``format.BundleReader``): ``open_read`` -> [``prefetch``: the ranges it
  will read] -> ``pread_into`` (repeated) / ``pread_batch`` -> ``close``; ``size`` and
  ``read_bytes`` for whole small files; ``identity`` / ``identities`` at open and again
  later, to tell a checkpoint replaced under the reader.
* **Committers** (``saving.commit``): names (``rename``, ``remove``, ``listdir``,
  ...), ``copy_file`` (incremental saves: a hard link, a reflink, a server-side copy),
  durability of names (``fsync_dir``), and coordination between processes:
  ``exclusive(directory)`` around cleaning and committing, ``claim``/``claimed`` so
  that a live save's temporary folder is never taken for a dead save's leftovers. ``supports_rename`` tells which
  committer a store gets: rename-commit where renames are atomic and cheap,
  index-last where they are not (object stores: :class:`~shardckpt.storage.object_store.ObjectStore`,
  which declares what they add; only :func:`shardckpt.saving.commit.committer_for` asks).

Handles are opaque to callers (:data:`ReadHandle`, :data:`WriteHandle`): int file
descriptors locally, upload/download objects on object stores. Every method takes
the path too (for error messages): errors are from :mod:`shardckpt.errors` and name
the path.
"""

from __future__ import annotations

import abc
import contextlib
import posixpath
import re
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from ..errors import NotFoundError

__all__ = ["FileSystem", "ReadHandle", "WriteHandle", "Identity", "RunBatch", "split_scheme", "is_local_path",
           "normalize", "posix_dirname"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


#: A handle from :meth:`FileSystem.open_read` (an int descriptor locally).
ReadHandle = Any
#: A handle from :meth:`FileSystem.open_write` (an int descriptor locally, an upload on object stores).
WriteHandle = Any
#: What identifies a file's current contents (:meth:`FileSystem.identity`): equal identities, same bytes.
Identity = Tuple[Any, ...]


class FileSystem(abc.ABC):
    """What the format and saving rooms need from a store (see the module docstring for the roles)."""

    #: Whether ``rename`` is atomic and cheap. Object stores: False (they get the
    #: index-last committer: data written in place, the index written last).
    supports_rename: bool = True
    #: Preferred size of one read request (``None``: the reader's own defaults).
    read_step: Optional[int] = None

    # -- reading ---------------------------------------------------------
    @abc.abstractmethod
    def open_read(self, path: str) -> ReadHandle:
        """Open ``path`` for positional reads."""

    def pread_batch(self, handle: ReadHandle, requests: Sequence[Tuple[int, memoryview]], path: str = "") -> None:
        """Fill every ``(offset, buffer)`` of ``requests`` from ``handle``.

        The default serves them one by one with :meth:`pread_into`; stores override it
        to coalesce nearby ranges or keep several requests in flight. ``requests`` may
        be a :class:`RunBatch` (many equal runs), which a store may serve in bulk.
        """
        for offset, buf in requests:
            self.pread_into(handle, buf, offset, path)

    @abc.abstractmethod
    def pread_into(self, handle: ReadHandle, buf: memoryview, offset: int, path: str = "") -> None:
        """Fill all of ``buf`` from ``offset``; a file too short is an error."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of the file in bytes."""

    @abc.abstractmethod
    def identity(self, path: str, handle: Optional[ReadHandle] = None) -> Identity:
        """What identifies the file's current contents (of the file open as ``handle`` when given):
        a file replaced or rewritten gets another identity. Readers record it at open and check
        it again to tell a checkpoint replaced under them. A missing file raises
        :class:`~shardckpt.errors.NotFoundError`."""

    def identities(self, paths: Sequence[str]) -> "dict[str, Optional[Identity]]":
        """:meth:`identity` of many files (``None``: missing); stores answer in bulk where they can
        (an object store: one listing per folder). Default: one :meth:`identity` each."""
        out: "dict[str, Optional[Identity]]" = {}
        for p in paths:
            try:
                out[p] = self.identity(p)
            except NotFoundError:
                out[p] = None
        return out

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` does anything here (callers may skip building the list). Default: no."""
        return False

    def prefetches_in(self, folder: str) -> bool:
        """Whether :meth:`prefetch` does anything for files in ``folder`` (callers may skip building the
        list). Default: :attr:`prefetches`."""
        return self.prefetches

    def prefetch(self, handle: ReadHandle, starts: Any, ends: Any, path: str = "") -> int:
        """Announce reads: bytes ``[starts[i], ends[i])`` of the file open as ``handle`` will be read soon
        (any thread). A store may fetch them ahead (object stores: few large GETs) or guide the
        kernel; reads are unchanged. Returns the number of requests or chunks planned (default:
        nothing, 0)."""
        return 0

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """The whole (small) file."""

    # -- writing ---------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, path: str) -> WriteHandle:
        """Create (or truncate) ``path`` for sequential writes."""

    @abc.abstractmethod
    def write_all(self, handle: WriteHandle, buf: memoryview, path: str = "") -> None:
        """Append all of ``buf``."""

    @abc.abstractmethod
    def fsync(self, handle: WriteHandle, path: str = "") -> None:
        """Make what was written durable (a no-op where objects are durable once complete)."""

    def start_writeback(self, handle: WriteHandle, offset: int, length: int, path: str = "") -> None:
        """A hint from a writer that will ``fsync``: the bytes ``[offset, offset + length)`` are
        written; begin moving them to the device now (default: nothing). Promises no durability."""
        return None

    @abc.abstractmethod
    def close(self, handle: ReadHandle) -> None:
        """Close a handle; for a write handle on an object store this completes the upload."""

    def discard(self, handle: WriteHandle) -> None:
        """Drop a write handle after a failure (default: close it)."""
        self.close(handle)

    @abc.abstractmethod
    def fsync_dir(self, path: str) -> None:
        """Make the names in directory ``path`` durable (renames, creations, removals)."""

    @abc.abstractmethod
    def temp_name(self, path: str) -> str:
        """A fresh temporary name beside ``path`` (``<path>.tempstate<random>``)."""

    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        """Replace ``path`` with ``data`` so that readers see the old or the new content, never a mix."""

    def copy_file(self, src: str, dst: str, *, fsync: bool = False) -> str:
        """Make ``dst`` (which must not exist) hold what ``src`` holds, as cheaply as the store allows;
        return how: ``"link"`` (a hard link: the same bytes under a second name), ``"reflink"`` (a
        copy-on-write clone), ``"server-copy"`` (the store copied it; no byte through this process) or
        ``"copy"`` (the bytes were read and written). ``dst`` never shares later writes with ``src``:
        nothing writes into a committed data file. With ``fsync`` a copy's bytes are made durable.

        The default streams the bytes through this process.
        """
        src_handle = self.open_read(src)
        try:
            total = self.size(src)
            handle = self.open_write(dst)
            try:
                buf = bytearray(min(total, 16 << 20) or 1)
                done = 0
                while done < total:
                    n = min(len(buf), total - done)
                    view = memoryview(buf)[:n]
                    self.pread_into(src_handle, view, done, src)
                    self.write_all(handle, view, dst)
                    done += n
                if fsync:
                    self.fsync(handle, dst)
            except BaseException:
                self.discard(handle)
                self.remove(dst)
                raise
            self.close(handle)
        finally:
            self.close(src_handle)
        return "copy"

    # -- names -----------------------------------------------------------
    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` to ``dst`` (only where ``supports_rename``)."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove a file; a missing one is fine."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything under it; a missing one is fine."""

    @abc.abstractmethod
    def rmdir_if_empty(self, path: str) -> bool:
        """Remove ``path`` if it is an empty directory; whether it was removed."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or directory ``path`` exists."""

    @abc.abstractmethod
    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (a prefix with objects under it on object stores)."""

    @abc.abstractmethod
    def isfile(self, path: str) -> bool:
        """Whether ``path`` is a file (an object)."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents (a no-op on object stores)."""

    @abc.abstractmethod
    def listdir(self, path: str) -> List[str]:
        """Names (not paths) of the entries of directory ``path``."""

    # -- coordination between processes ---------------------------------
    @contextlib.contextmanager
    def exclusive(self, directory: str) -> Iterator[None]:
        """Hold an exclusive lock on ``directory`` inside the block (committers take it around
        cleaning leftovers and around the commit). Default: nothing (object stores order
        writers with conditional writes instead)."""
        yield

    def claim(self, path: str) -> Any:
        """Mark the directory ``path`` as in use by this live process until :meth:`release`;
        :meth:`claimed` then answers True in any other process. Default: no claims."""
        return None

    def release(self, claim: Any) -> None:
        """Give up a claim from :meth:`claim` (a process that dies gives up its claims)."""
        return None

    def claimed(self, path: str) -> bool:
        """Whether a live process holds a claim on the directory ``path``."""
        return False

    # -- path arithmetic -------------------------------------------------
    @abc.abstractmethod
    def join(self, *parts: str) -> str:
        """Join path components."""

    @abc.abstractmethod
    def dirname(self, path: str) -> str:
        """The directory part of ``path``."""

    @abc.abstractmethod
    def basename(self, path: str) -> str:
        """The last component of ``path``."""

    @abc.abstractmethod
    def isabs(self, path: str) -> bool:
        """Whether ``path`` is absolute."""

    @abc.abstractmethod
    def normpath(self, path: str) -> str:
        """``path`` with redundant separators and up-level references collapsed."""


class RunBatch(Sequence[Tuple[int, memoryview]]):
    """Requests of :meth:`FileSystem.pread_batch` in bulk: ``len(offsets)`` runs of ``run_bytes`` each.

    Run ``i`` is read from file offset ``offsets[i]`` (an int64 array, ascending) into
    ``dest[i * run_bytes:(i + 1) * run_bytes]``, or, with ``dest_offsets`` (an int64
    array: runs scattered over ``dest``, e.g. the rows of a strided destination), into
    ``dest[dest_offsets[i]:dest_offsets[i] + run_bytes]``. As a sequence it yields the
    usual ``(offset, buffer)`` pairs, so any store can serve it one by one. ``cover``,
    when given, is a ``(start, length)`` range holding every run (e.g. whole rows) that
    a store for which requests cost more than bytes may read whole instead (only
    without ``dest_offsets``).
    """

    def __init__(self, offsets: Any, run_bytes: int, dest: memoryview,
                 cover: Optional[Tuple[int, int]] = None, dest_offsets: Any = None) -> None:
        self.offsets = offsets
        self.run_bytes = int(run_bytes)
        self.dest = dest
        self.cover = cover if dest_offsets is None else None
        self.dest_offsets = dest_offsets

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        rb = self.run_bytes
        at = i * rb if self.dest_offsets is None else int(self.dest_offsets[i])
        return int(self.offsets[i]), self.dest[at:at + rb]


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
    """Whether ``path`` is served by the local filesystem (no scheme, or ``file://``)."""
    scheme, _ = split_scheme(path)
    return scheme in ("", "file")


def posix_dirname(path: str) -> str:
    """``posixpath.dirname`` that never climbs above ``scheme://bucket``."""
    scheme, rest = split_scheme(path)
    if not scheme:
        return posixpath.dirname(path)
    parent = posixpath.dirname(rest.rstrip("/"))
    return f"{scheme}://{parent}" if parent else f"{scheme}://{rest.split('/', 1)[0]}"
