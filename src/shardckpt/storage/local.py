"""Local POSIX files: positional reads into existing buffers, full writes, fsync, atomic replace.

Everything the format and saving rooms do with files goes through
:class:`LocalFileSystem`, so that other stores can offer the same small surface.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
from typing import Any, Iterator, List, Optional

from ..errors import NotFoundError, ShardckptError, StorageError
from .base import FileSystem

__all__ = ["LocalFileSystem", "local_fs", "StorageError"]

_MAX_IO = 1 << 30  # one syscall moves at most 1 GiB (Linux caps near 2 GiB)


def _wrap(exc: OSError, path: str, action: str) -> ShardckptError:
    if exc.errno == errno.ENOENT:
        return NotFoundError(f"{action}: no such file", path=path)
    return StorageError(f"{action} failed: {exc.strerror or exc}", path=path)


class LocalFileSystem(FileSystem):
    """The local filesystem."""

    supports_rename = True
    read_step = None

    # -- reading ---------------------------------------------------------
    def open_read(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _wrap(exc, path, "open") from None

    def size(self, path: str) -> int:
        try:
            return os.stat(path).st_size
        except OSError as exc:
            raise _wrap(exc, path, "stat") from None

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise _wrap(exc, path, "read") from None

    def pread_into(self, fd: int, buf: memoryview, offset: int, path: str = "") -> None:
        """Fill ``buf`` from ``offset``; a short file is an error."""
        done = 0
        total = len(buf)
        while done < total:
            try:
                n = os.preadv(fd, [buf[done:done + _MAX_IO]], offset + done)
            except OSError as exc:
                raise _wrap(exc, path, "read") from None
            if n == 0:
                from ..errors import DataLossError
                raise DataLossError(f"unexpected end of file at offset {offset + done} "
                                    f"(wanted {total - done} more bytes)", path=path)
            done += n

    # -- writing ---------------------------------------------------------
    def open_write(self, path: str) -> int:
        """Create (or truncate) ``path`` for writing."""
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise _wrap(exc, path, "create") from None

    def write_all(self, fd: int, buf: memoryview, path: str = "") -> None:
        done = 0
        total = len(buf)
        while done < total:
            try:
                done += os.write(fd, buf[done:done + _MAX_IO])
            except OSError as exc:
                raise _wrap(exc, path, "write") from None

    def fsync(self, fd: int, path: str = "") -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            raise _wrap(exc, path, "fsync") from None

    def close(self, fd: int) -> None:
        """Close ``fd``; closing twice or a bad descriptor is ignored."""
        try:
            os.close(fd)
        except OSError:
            pass

    def fsync_dir(self, path: str) -> None:
        """Make the directory entries of ``path`` durable."""
        try:
            fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise _wrap(exc, path, "open directory") from None
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise _wrap(exc, path, "fsync directory") from None
        finally:
            os.close(fd)

    def temp_name(self, path: str) -> str:
        """A sibling name for writing ``path`` before an atomic rename (TF's ``.tempstate`` form)."""
        return f"{path}.tempstate{secrets.randbits(63)}"

    def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        """Write ``data`` to a temporary sibling, then rename it over ``path``."""
        tmp = self.temp_name(path)
        fd: Optional[int] = self.open_write(tmp)
        try:
            assert fd is not None
            self.write_all(fd, memoryview(data), tmp)
            if fsync:
                self.fsync(fd, tmp)
            self.close(fd)
            fd = None  # never close a descriptor number twice: another thread may own it by now
            self.rename(tmp, path)
        except BaseException:
            if fd is not None:
                self.close(fd)
            self.remove(tmp)
            raise

    # -- names -----------------------------------------------------------
    def rename(self, src: str, dst: str) -> None:
        try:
            os.replace(src, dst)
        except OSError as exc:
            raise _wrap(exc, src, f"rename to {dst}") from None

    def remove(self, path: str) -> None:
        """Delete a file; a missing file is not an error."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _wrap(exc, path, "delete") from None

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def rmdir_if_empty(self, path: str) -> bool:
        try:
            os.rmdir(path)
            return True
        except OSError:
            return False

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def makedirs(self, path: str) -> None:
        if not path:
            return
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise _wrap(exc, path, "create directory") from None

    def listdir(self, path: str) -> List[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as exc:
            raise _wrap(exc, path, "list directory") from None

    # -- coordination between processes (flock: released by the kernel when a process dies) --
    def _open_dir(self, path: str) -> int:
        try:
            return os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _wrap(exc, path, "open directory") from None

    @contextlib.contextmanager
    def exclusive(self, directory: str) -> Iterator[None]:
        """An exclusive ``flock`` on the directory itself (no lock file is left behind)."""
        fd = self._open_dir(directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def claim(self, path: str) -> Any:
        """A shared ``flock`` on the directory ``path``, held until :meth:`release` or death."""
        fd = self._open_dir(path)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def release(self, claim: Any) -> None:
        if claim is not None:
            try:
                os.close(claim)
            except OSError:
                pass

    def claimed(self, path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path)

    def basename(self, path: str) -> str:
        return os.path.basename(path)

    def isabs(self, path: str) -> bool:
        return os.path.isabs(path)

    def normpath(self, path: str) -> str:
        return os.path.normpath(path)


local_fs = LocalFileSystem()
