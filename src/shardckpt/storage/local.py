"""Local POSIX files: positional reads into existing buffers, full writes, fsync, atomic replace.

Everything the format and saving rooms do with files goes through
:class:`LocalFileSystem`, so that other stores can offer the same small surface.

Batches of runs (:class:`~shardckpt.storage.base.RunBatch`, a region read of many rows):
runs below a page are served by covering reads; runs that follow each other in the file
(one range going to the rows of a strided destination) by ``preadv`` calls of up to
``IOV_MAX`` buffers; other runs of a page or more through io_uring (:mod:`.uring`, up to
1024 reads a system call; their bytes counted in :attr:`LocalFileSystem.ring_bytes`,
since ``/proc``'s ``rchar`` does not see them) or, where io_uring is refused, by one
positional read each. Every way reads exactly the runs' bytes. A subclass that overrides
:meth:`LocalFileSystem.pread_into` gets every run through it instead (so that what it
counts or injects sees every read).

Dense strided batches (at least 8 runs of a page or more, filling at least half of the
span they cover: the rows of a resharded load's region) are copied out of a read-only
memory map of the file instead (:mod:`.mapped`: a huge-page map, its pages populated
first, one strided copy, no call per run; a resharded load reading half of every row
costs about half as much). Their bytes are counted in :attr:`LocalFileSystem.mapped_bytes`
(``/proc``'s ``rchar`` does not see copies out of a map). Populating reports a disk error
or a file cut short as a code, and the read calls then serve the batch and raise as
usual; the price that remains (the same as guided reads', for files of committed
checkpoints): a page evicted between the populating and the copy that fails to read
again, or a truncation by someone else in that moment, ends the process with ``SIGBUS``.
``LocalFileSystem(map_runs=False)`` or ``SHARDCKPT_MAP_READS=0`` turns maps off;
``map_runs=True`` maps every batch of ascending runs.

Announced reads (:meth:`LocalFileSystem.prefetch`, from a restore): a file whose announced
ranges leave gaps of 1 MiB or more (the dead bytes of a linked data file of an incremental
checkpoint, or the tensors a partial restore skips) is read through a guide
(:mod:`.guided`: a huge-page map populated ahead of the reads, which reads the announced
bytes and not the gaps; the same ``SIGBUS`` price, for files of committed checkpoints).
Its bytes are counted in :attr:`LocalFileSystem.guided_bytes`. Other files keep
``POSIX_FADV_SEQUENTIAL`` readahead. ``LocalFileSystem(guide_reads=False)`` turns it off; files
on a RAM disk (``tmpfs``: a node-local tier) are never announced (:mod:`.mounts`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import secrets
import shutil
import threading
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from ..errors import NotFoundError, ShardckptError, StorageError
from . import guided, mapped, mounts, uring, writeback
from .base import FileSystem, RunBatch

__all__ = ["LocalFileSystem", "local_fs", "StorageError"]

_MAX_IO = 1 << 30  # one syscall moves at most 1 GiB (Linux caps near 2 GiB)
_COALESCE_GAP = 4096  # pread_batch reads runs below a page, and gaps up to a page, in one covering call
_COALESCE_SPAN = 16 << 20  # ... as long as one covering read stays below this
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024
_RING_MIN = 8  # run batches of at least this many strided runs go through io_uring (where available)
_RUN_BLOCK = 128  # otherwise: one preadv a run, the views made a block of runs at a time
_FICLONE = 0x40049409  # ioctl: clone a whole file (btrfs, XFS with reflink, bcachefs, ...)
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EACCES)
_log = logging.getLogger("shardckpt")
_said: set = set()
_said_lock = threading.Lock()


def _say_once(what: str, message: str, *args: object) -> None:
    with _said_lock:
        if what in _said:
            return
        _said.add(what)
    _log.warning(message, *args)


def _wrap(exc: OSError, path: str, action: str) -> ShardckptError:
    if exc.errno == errno.ENOENT:
        return NotFoundError(f"{action}: no such file", path=path)
    wrapped = StorageError(f"{action} failed: {exc.strerror or exc}", path=path)
    wrapped.errno = exc.errno  # what failed, for callers that tell a full disk from the rest (ENOSPC)
    return wrapped


class LocalFileSystem(FileSystem):
    """The local filesystem (``map_runs``: which run batches are copied out of memory maps, see the module
    docstring)."""

    supports_rename = True
    read_step = None
    map_runs: Optional[bool] = None
    mapped_bytes = 0  # bytes that run batches copied out of maps
    ring_bytes = 0  # bytes that run batches read through io_uring
    ring_runs = True  # strided run batches through io_uring where available (see _pread_runs)
    guide_reads = True  # announced reads guide the kernel's reads where they leave gaps (see prefetch)
    guided_bytes = 0  # bytes that reads copied from guides' maps (see prefetch)
    _count_lock = threading.Lock()
    #: the guide of each guided descriptor (descriptors are process-wide, so is this)
    _guides: "dict[int, guided.Guide]" = {}

    def __init__(self, *, map_runs: Optional[bool] = None, ring_runs: bool = True, guide_reads: bool = True) -> None:
        self.map_runs = map_runs
        self.ring_runs = ring_runs
        self.guide_reads = guide_reads

    @property
    def prefetches(self) -> bool:
        """Whether announced reads guide the kernel's (``guide_reads``; see :meth:`prefetch`)."""
        return self.guide_reads

    def prefetches_in(self, folder: str) -> bool:
        """Whether announced reads of files in ``folder`` guide the kernel's: not on a RAM disk
        (:func:`.mounts.in_memory`), whose pages are in memory already."""
        return self.guide_reads and not mounts.in_memory(folder)

    # -- reading ---------------------------------------------------------
    def open_read(self, path: str) -> int:
        """Open ``path`` for positional reads (hinting the kernel that reads are mostly sequential)."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _wrap(exc, path, "open") from None
        self._drop_guide(fd)  # a guide of a closed descriptor with this number
        advise = getattr(os, "posix_fadvise", None)
        if advise is not None:
            try:
                advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass
        return fd

    def identity(self, path: str, handle: Optional[int] = None) -> Tuple[Any, ...]:
        """What identifies the file's current contents: size, device, inode, mtime (of ``handle`` when given).

        A file replaced by a rename or rewritten in place gets another identity.
        """
        try:
            st = os.fstat(handle) if handle is not None else os.stat(path)
        except OSError as exc:
            raise _wrap(exc, path, "stat") from None
        return (st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns)

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

    def prefetch(self, fd: int, starts: Any, ends: Any, path: str = "") -> int:
        """Announce reads: bytes ``[starts[i], ends[i])`` of the file open as ``fd`` will be read soon.

        Where they leave gaps (e.g. the dead bytes of a linked data file of an incremental
        checkpoint) the descriptor's reads are guided (:mod:`.guided`): the announced bytes
        are read ahead through a map of the file, not the gaps. Otherwise nothing changes.
        Returns the number of chunks the guide holds (0: not guided).
        """
        if not self.guide_reads:
            return 0
        try:
            size = os.fstat(fd).st_size
        except OSError:
            return 0
        previous = self._guides.get(fd)
        guide = guided.plan(fd, size, starts, ends, previous)
        if guide is None:
            return 0
        self._guides[fd] = guide
        if previous is not None:
            previous.close()
        return len(guide.starts)

    def _drop_guide(self, fd: int) -> None:
        guide = self._guides.pop(fd, None)
        if guide is not None:
            guide.close()

    def pread_into(self, fd: int, buf: memoryview, offset: int, path: str = "") -> None:
        """Fill ``buf`` from ``offset``; a short file is an error."""
        if self._guides:
            guide = self._guides.get(fd)
            if guide is not None:
                guide.ahead(offset, len(buf))
                if guide.read(offset, buf):
                    with self._count_lock:
                        self.guided_bytes += len(buf)
                    return
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

    def pread_batch(self, fd: int, requests: Sequence[Tuple[int, memoryview]], path: str = "") -> None:
        """Fill every ``(offset, buffer)``; runs shorter than a page less than a page apart share one read."""
        guide = self._guides.get(fd) if self._guides and len(requests) else None
        if guide is not None:  # the runs are read from the descriptor; their chunks are populated ahead
            if isinstance(requests, RunBatch):
                lo, hi = int(requests.offsets[0]), int(requests.offsets[-1]) + requests.run_bytes
            else:
                lo = min(o for o, _ in requests)
                hi = max(o + b.nbytes for o, b in requests)
            guide.ahead(lo, hi - lo)
        if isinstance(requests, RunBatch) and len(requests):
            packed = requests.dest_offsets is None
            if packed and len(requests) > 1 and self._mapping(requests) and self._map_runs(fd, requests, path):
                return
            if packed and requests.run_bytes < _COALESCE_GAP:
                self._pread_small_runs(fd, requests, path)
            else:
                self._pread_runs(fd, requests, path)
            return
        reqs = [(o, b if b.format == "B" and b.ndim == 1 else b.cast("B")) for o, b in requests if len(b)]
        if any(reqs[i][0] > reqs[i + 1][0] for i in range(len(reqs) - 1)):
            reqs.sort(key=lambda r: r[0])
        i = 0
        n = len(reqs)
        while i < n:
            start, first = reqs[i]
            end = start + len(first)
            j = i + 1
            if len(first) < _COALESCE_GAP:
                while j < n:
                    off, buf = reqs[j]
                    size = len(buf)
                    if size >= _COALESCE_GAP or not 0 <= off - end <= _COALESCE_GAP \
                            or off + size - start > _COALESCE_SPAN:
                        break
                    end = max(end, off + size)
                    j += 1
            if j == i + 1:
                self.pread_into(fd, first, start, path)
            else:
                cover = memoryview(bytearray(end - start))
                self.pread_into(fd, cover, start, path)
                for off, buf in reqs[i:j]:
                    buf[:] = cover[off - start:off - start + len(buf)]
            i = j

    def _pread_runs(self, fd: int, batch: RunBatch, path: str) -> None:
        """Runs of a page or more (or runs scattered over the destination): exactly their bytes, few calls.

        * Runs that follow each other in the file (a contiguous range going to the rows
          of a strided destination) are read by ``preadv`` calls of up to ``IOV_MAX``
          buffers each: one call per 1024 runs.
        * Other runs (strided in the file: half of every row of a chunk) go through
          io_uring where it is available (:mod:`.uring`: up to 1024 reads per system
          call, the requests written in bulk, no Python object per run; their bytes are
          counted in :attr:`ring_bytes`), else one ``preadv`` each, issued from one ``map``
          over precomputed views, a block of runs at a time (so that a batch of tens of
          thousands of runs allocates no more than a block's views at once and wakes no
          garbage collection).

        Runs left short (end of file, a signal) or failed are finished by :meth:`pread_into`,
        which raises for a file too short or a read error. A subclass's (or a test's)
        ``pread_into`` sees every run instead.
        """
        if type(self).pread_into is not _PREAD_INTO:
            for offset, buf in batch:
                self.pread_into(fd, buf, offset, path)
            return
        import numpy as np

        rb = batch.run_bytes
        n = len(batch)
        dest = batch.dest if batch.dest.format == "B" and batch.dest.ndim == 1 else batch.dest.cast("B")
        offsets = np.asarray(batch.offsets, dtype=np.int64)
        at = np.arange(0, n * rb, rb, dtype=np.int64) if batch.dest_offsets is None else \
            np.asarray(batch.dest_offsets, dtype=np.int64)
        if n and (int(at.min()) < 0 or int(at.max()) + rb > len(dest)):  # reads by address must stay inside
            raise ValueError(f"run batch: runs of {rb} bytes at {int(at.min())}..{int(at.max())} do not fit "
                             f"a destination of {len(dest)} bytes")
        if n > 1 and (np.diff(offsets) == rb).all():  # one range of the file: scatter reads
            self._pread_scatter(fd, int(offsets[0]), dest, at, rb, path)
            return
        if n >= _RING_MIN and self.ring_runs:
            base = np.frombuffer(dest, dtype=np.uint8).ctypes.data if len(dest) else 0
            got = uring.read_runs(fd, offsets, base + at.astype(np.uint64), rb)
            if got is not None:
                whole = got == rb
                with self._count_lock:
                    self.ring_bytes += int(got[got > 0].sum())
                for i in np.flatnonzero(~whole).tolist():  # short or failed: the usual read (and error)
                    done = max(0, int(got[i]))
                    o = int(at[i])
                    self.pread_into(fd, dest[o + done:o + rb], int(offsets[i]) + done, path)
                return
        for i in range(0, n, _RUN_BLOCK):
            j = min(n, i + _RUN_BLOCK)
            offs = offsets[i:j].tolist()
            views = [[dest[o:o + rb]] for o in at[i:j].tolist()]
            try:
                counts = list(map(os.preadv, itertools.repeat(fd, j - i), views, offs))
            except OSError as exc:
                raise _wrap(exc, path, "read") from None
            if counts.count(rb) != j - i:
                for (view,), offset, got_n in zip(views, offs, counts):
                    if got_n != rb:
                        self.pread_into(fd, view[got_n:], offset + got_n, path)
            del views, counts  # freed before the next block's are made

    def _pread_scatter(self, fd: int, start: int, dest: memoryview, at: Any, rb: int, path: str) -> None:
        """Bytes ``[start, start + len(at) * rb)`` of the file into ``dest[at[i]:at[i] + rb]`` for each ``i``,
        with ``preadv`` calls of up to ``IOV_MAX`` buffers (a short read is finished by :meth:`pread_into`)."""
        n = len(at)
        per_call = max(1, min(_IOV_MAX, _MAX_IO // max(rb, 1)))
        for i in range(0, n, per_call):
            j = min(n, i + per_call)
            views = [dest[o:o + rb] for o in at[i:j].tolist()]
            offset = start + i * rb
            try:
                got = os.preadv(fd, views, offset)
            except OSError as exc:
                raise _wrap(exc, path, "read") from None
            if got == (j - i) * rb:
                continue
            for view in views:  # finish the rest buffer by buffer
                if got >= rb:
                    got -= rb
                else:
                    self.pread_into(fd, view[got:], offset + got, path)
                    got = 0
                offset += rb

    def _mapping(self, batch: RunBatch) -> bool:
        """Whether a packed batch of runs is copied out of maps (see the module docstring): always with
        ``map_runs=True``, never with ``False``; by default (``None``) batches of at least ``_RING_MIN``
        runs of a page or more, strided in the file, whose runs fill at least half of their span, where
        :func:`mapped.available` (and no subclass reads run by run through its own ``pread_into``)."""
        if self.map_runs is not None:
            return self.map_runs
        n = len(batch)
        rb = batch.run_bytes
        if n < _RING_MIN or rb < _COALESCE_GAP or type(self).pread_into is not _PREAD_INTO or \
                not mapped.available():
            return False
        first, last = int(batch.offsets[0]), int(batch.offsets[-1])
        span = last + rb - first
        return span > n * rb and 2 * n * rb >= span  # not one range (preadv serves that), dense enough

    def _map_runs(self, fd: int, batch: RunBatch, path: str) -> bool:
        """Copy the runs out of read-only maps of the file (:func:`mapped.copy_runs`).

        False (nothing read; the read calls serve the batch) where a map does not fit: runs
        not ascending and disjoint, a file shorter than the runs (the read calls then raise
        the usual error), a file that cannot be mapped or whose pages fail to populate.
        """
        import numpy as np

        offsets = np.asarray(batch.offsets, dtype=np.int64)
        rb = batch.run_bytes
        n = len(offsets)
        if rb <= 0 or rb > mapped.WINDOW or offsets[0] < 0 or (np.diff(offsets) < rb).any():
            return False
        try:
            if os.fstat(fd).st_size < int(offsets[-1]) + rb:
                return False
        except OSError:
            return False
        dest = np.frombuffer(batch.dest, dtype=np.uint8)[:n * rb].reshape(n, rb)
        copied = mapped.copy_runs(fd, offsets, rb, dest, populate=mapped.can_populate())
        if copied is None and self.map_runs and not mapped.can_populate():  # asked for, on a kernel before 5.14
            copied = mapped.copy_runs(fd, offsets, rb, dest, populate=False)
        if copied is None:
            return False
        with self._count_lock:
            self.mapped_bytes += copied
        return True

    def _pread_small_runs(self, fd: int, batch: RunBatch, path: str) -> None:
        """Many runs below a page: covering reads of up to ``_COALESCE_SPAN``, runs copied out in bulk.

        With ``batch.cover`` the whole cover is read (split at run boundaries), otherwise
        gaps of more than a page between runs start a new read.
        """
        import numpy as np

        offsets = np.asarray(batch.offsets, dtype=np.int64)
        rb = batch.run_bytes
        n = len(offsets)
        cover = batch.cover
        if (np.diff(offsets) < rb).any() or (cover is not None and (
                offsets[0] < cover[0] or offsets[-1] + rb > cover[0] + cover[1])):
            FileSystem.pread_batch(self, fd, list(batch), path)  # not ascending and disjoint: one by one
            return
        dest = np.frombuffer(batch.dest, dtype=np.uint8)[:n * rb].reshape(n, rb)
        gaps = offsets[1:] - offsets[:-1] - rb
        breaks = np.flatnonzero(gaps > _COALESCE_GAP) + 1 if cover is None else np.zeros(0, np.int64)
        i = 0
        read_from = int(cover[0]) if cover is not None else int(offsets[0])
        while i < n:
            k = int(np.searchsorted(breaks, i, side="right"))
            stop = int(breaks[k]) if k < len(breaks) else n
            start = read_from if cover is not None else int(offsets[i])
            j = min(stop, int(np.searchsorted(offsets, start + _COALESCE_SPAN - rb, side="right")))
            j = max(j, i + 1)
            end = int(offsets[j - 1]) + rb
            if cover is not None:
                end = int(cover[0] + cover[1]) if j == n else int(offsets[j])  # read up to the next run
            buf = np.empty(end - start, dtype=np.uint8)
            self.pread_into(fd, memoryview(buf), start, path)  # type: ignore[arg-type]
            rel = offsets[i:j] - start
            steps = np.diff(rel)
            if len(steps) and (steps == steps[0]).all():  # evenly spaced: one strided copy
                first = buf[int(rel[0]):]
                dest[i:j] = np.lib.stride_tricks.as_strided(first, shape=(j - i, rb), strides=(int(steps[0]), 1))
            else:
                dest[i:j] = buf[rel[:, None] + np.arange(rb)]
            read_from = end
            i = j

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

    def start_writeback(self, fd: int, offset: int, length: int, path: str = "") -> None:
        """Begin writing these bytes to the device now (``sync_file_range``, on a helper thread)."""
        writeback.start(fd, offset, length)

    def fsync(self, fd: int, path: str = "") -> None:
        writeback.drain(fd)
        try:
            os.fsync(fd)
        except OSError as exc:
            raise _wrap(exc, path, "fsync") from None

    def close(self, fd: int) -> None:
        """Close ``fd``; closing twice or a bad descriptor is ignored."""
        writeback.drain(fd)  # no write-behind request may outlive its descriptor
        self._drop_guide(fd)
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

    def copy_file(self, src: str, dst: str, *, fsync: bool = False) -> str:
        """A hard link; where the filesystem has none (or not across these folders), a reflink
        (``FICLONE``); else a copy in the kernel (``copy_file_range``, which some filesystems
        turn into a clone). The fallbacks are logged once per process."""
        try:
            os.link(src, dst)
            return "link"
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise _wrap(exc, src, f"link to {dst}") from None
            reason = exc.strerror or str(exc)
        try:
            fin = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _wrap(exc, src, "open") from None
        try:
            fout = self.open_write(dst)
            try:
                how = self._clone_or_copy(fin, fout, src, dst)
                if fsync:
                    self.fsync(fout, dst)
            except BaseException:
                os.close(fout)
                self.remove(dst)
                raise
            os.close(fout)
        finally:
            os.close(fin)
        _say_once(how, "incremental saves: no hard links here (%s); unchanged data files are %s", reason,
                  "reflinked (copy-on-write clones)" if how == "reflink" else "copied")
        return how

    @staticmethod
    def _clone_or_copy(fin: int, fout: int, src: str, dst: str) -> str:
        try:
            fcntl.ioctl(fout, _FICLONE, fin)
            return "reflink"
        except OSError:
            pass
        total = os.fstat(fin).st_size
        done = 0
        copy_range = getattr(os, "copy_file_range", None)
        while done < total:
            try:
                if copy_range is not None:
                    n = copy_range(fin, fout, min(total - done, _MAX_IO), done, done)
                else:
                    n = os.sendfile(fout, fin, done, min(total - done, _MAX_IO))
            except OSError as exc:
                if copy_range is not None and exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL,
                                                            errno.EOPNOTSUPP):
                    copy_range = None
                    continue
                raise _wrap(exc, src, f"copy to {dst}") from None
            if n == 0:
                raise StorageError(f"copy to {dst}: {src} ended after {done} of {total} bytes", path=src)
            done += n
        return "copy"

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


_PREAD_INTO = LocalFileSystem.pread_into
local_fs = LocalFileSystem()
