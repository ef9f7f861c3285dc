"""Guided reads of local files whose announced ranges leave gaps: the kernel reads those ranges, not the gaps.

Why: a data file of an incremental checkpoint may be a hard link of an older one whose
changed pieces are still inside it, named by no entry (``saving/incremental.py``). The
kernel's readahead (a window of ``read_ahead_kb``, doubled by ``POSIX_FADV_SEQUENTIAL``;
8 MiB and 16 MiB on the VM measured) runs ahead of the reads straight through such gaps,
so a cold restore reads them from the device too (1124 MiB for 1024 MiB restored when 10 %
of 4 MiB tensors changed). Nothing a reader can tell a descriptor bounds that window, and
what bounds it otherwise costs more than the gaps (measured, see ``benchmarks/README.md``):
``POSIX_FADV_RANDOM`` with ``POSIX_FADV_WILLNEED`` ahead of the reads reads exact bytes,
but into 4 KiB page-cache pages, so in requests of about 1 MiB of many segments, which the
virtual disk measured serves at ~1.4 GB/s instead of ~2 GB/s (the restore got 30 % slower);
a page cached at the start of each gap does not stop the window either. And every
large page that readahead reads carries a marker; a later ``read`` of it through any
descriptor (``POSIX_FADV_RANDOM`` or not) starts readahead from the next page not cached:
into the gap, when the page is the last before one.

What does: a read-only shared map of the file with ``MADV_HUGEPAGE`` and ``MADV_RANDOM``.
A fault in such a map reads the one 2 MiB-aligned block around it as one large page-cache
page (one request; no readahead beyond it, and ``MADV_RANDOM`` keeps accesses through the
map from starting readahead at markers). ``MADV_POPULATE_READ`` on a range faults it in
and reports a failure as an error code, not a signal.

Protocol. A reader announces the byte ranges it is about to read
(:meth:`LocalFileSystem.prefetch <shardckpt.storage.local.LocalFileSystem.prefetch>`,
from :meth:`BundleReader.prefetch <shardckpt.format.bundle_reader.BundleReader.prefetch>`).
:func:`plan` merges them (gaps below :data:`MERGE_GAP` are read through) and decides: when
no gap of at least :data:`MIN_GAP` is left between them, nor after the last one before the
end of the file, nothing changes (the descriptor keeps its sequential readahead: a full
restore reads as before). Otherwise the file gets a :class:`Guide`: the map (placed on a
2 MiB boundary, so that large pages are mapped whole), the merged ranges cut into chunks
of at most :data:`CHUNK` bytes, and ``POSIX_FADV_RANDOM`` on the descriptor (a read that
falls back to it reads what it asks for). Reads of the descriptor then go through the
guide:

* :meth:`Guide.ahead`, before each read: every chunk not yet asked for that overlaps the
  read or starts less than :data:`AHEAD` bytes after it is handed to a few populating
  threads (:data:`POPULATORS`, one chunk each at a time: as many 2 MiB requests in flight,
16 MiB, about what ``POSIX_FADV_SEQUENTIAL`` readahead keeps in flight here), in
  every stream of reads of the file (the read pump's helpers read distant parts of one
  file at once). When the page cache already holds as many pages between the first and
  the last range as the ranges span (``cachestat``, Linux 6.5+: a warm restore), nothing
  is populated: copies fault cached pages in without a request.
* :meth:`Guide.read`: a read that lies in chunks whose populating succeeded is copied from
  the map (after waiting for those chunks; a chunk whose populating has not started yet is
  populated by the reading thread itself, so that a busy machine that leaves the populating
  threads waiting does not leave the reads waiting too). Any other read (outside the announced ranges,
  or in a chunk whose populating failed) goes to the descriptor as usual and raises the
  usual errors.

Bytes read from the device: the announced ranges, rounded out to 2 MiB blocks.

The price (the same as mapped run reads', :mod:`.mapped`): a copy from the map that
faults on a page not in the cache (evicted meanwhile) and fails to read it, or a file
truncated by someone else meanwhile, ends the process with ``SIGBUS``. The files guided
are those of committed checkpoints, which nothing writes into.
``LocalFileSystem(guide_reads=False)`` turns guides off, and so does
``SHARDCKPT_GUIDED_READS=0`` for the process. Guides are used only on Linux with transparent
huge pages not set to ``never``, and only on file systems where the kernel does read large
pages into the cache for such a map (XFS since Linux 5.18, ext4 since 6.16; elsewhere a
fault would read 4 KiB at a time, one request each). The first guide that populates a
file of a file system is the probe (:meth:`Guide.probe`): it populates a chunk holding a
whole 2 MiB block on the calling thread and looks in ``/proc/self/smaps`` for the large
page mapped there (``FilePmdMapped``). If there is none, that file system is marked
unfit for this process and its files are read as before (the sequential readahead); a
file too small to probe is not guided. Elsewhere reads are unchanged.

Only reads: nothing is written. The guide is memory only (the map and a few arrays per
descriptor; the pages copied out stay mapped, so the process's resident set counts them
as shared file pages, page cache that the kernel can still reclaim, until the guide is
closed); :meth:`Guide.close` (the descriptor is closed) waits for the copies and the
populating threads in progress, then unmaps.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import mapped

__all__ = ["Guide", "plan", "available", "large_pages", "cached_pages", "MIN_GAP", "MERGE_GAP", "CHUNK", "AHEAD",
           "POPULATORS"]

MIN_GAP = 1 << 20  # a gap at least this large between announced ranges makes a file guided
MERGE_GAP = 256 << 10  # gaps below this are read with their neighbours
CHUNK = 4 << 20  # one populating call covers at most this much
AHEAD = 32 << 20  # chunks starting less than this after a read are populated ahead of it
POPULATORS = 8  # populating threads (requests in flight)

_PMD = mapped.PMD
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22
_CACHESTAT = 451  # syscall number (Linux 6.5+; the same on every architecture but alpha)

_state: dict = {"ok": None, "libc": None, "pool": None, "pid": None, "no_cachestat": False}
_large_pages: Dict[int, bool] = {}  # st_dev -> whether the probe saw a large page mapped (see the module)
_pool_lock = threading.Lock()


def available() -> bool:
    """Whether guides can be used here (Linux with transparent huge pages not ``never``; not turned off by
    ``SHARDCKPT_GUIDED_READS=0``)."""
    ok = _state["ok"]
    if ok is None:
        ok = False
        if platform.system() == "Linux" and hasattr(os, "posix_fadvise") and \
                os.environ.get("SHARDCKPT_GUIDED_READS", "1") != "0" and mapped.transparent_huge_pages():
            _state["libc"] = mapped.libc()
            ok = _state["libc"] is not None
        _state["ok"] = ok
    return bool(ok)


def _pool() -> ThreadPoolExecutor:
    """The populating threads of this process (a forked child makes its own)."""
    with _pool_lock:
        if _state["pool"] is None or _state["pid"] != os.getpid():
            _state["pool"] = ThreadPoolExecutor(max_workers=POPULATORS, thread_name_prefix="shardckpt-populate")
            _state["pid"] = os.getpid()
        return _state["pool"]


def _union(starts: Any, ends: Any, gap: int) -> Tuple[np.ndarray, np.ndarray]:
    """The ranges ``[starts[i], ends[i])`` merged where they overlap or lie less than ``gap`` apart."""
    s = np.asarray(starts, dtype=np.int64).reshape(-1)
    e = np.asarray(ends, dtype=np.int64).reshape(-1)
    keep = e > s
    s, e = s[keep], e[keep]
    if len(s) == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = np.maximum.accumulate(e[order])
    fresh = np.empty(len(s), dtype=bool)
    fresh[0] = True
    fresh[1:] = s[1:] - e[:-1] >= gap
    first = np.flatnonzero(fresh)
    return s[first], e[np.append(first[1:], len(s)) - 1]


def large_pages(fd: int) -> Optional[bool]:
    """What the probe found for the file system of the file open as ``fd`` in this process: whether faults
    in a guide's map read large pages (``None``: not probed yet)."""
    return _large_pages.get(os.fstat(fd).st_dev)


def _pmd_mapped(base: int) -> int:
    """``FilePmdMapped`` (KiB) of the mapping of this process that starts at address ``base`` (0 when the
    mapping or the field is not there)."""
    head = f"{base:x}-"
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                if line.startswith(head):
                    for field in fh:
                        if field.startswith("FilePmdMapped:"):
                            return int(field.split()[1])
                        if "-" in field.split(" ", 1)[0]:  # the next mapping's header
                            return 0
    except (OSError, ValueError):
        pass
    return 0


def cached_pages(fd: int, start: int, length: int) -> Optional[int]:
    """Pages of ``[start, start + length)`` of the file in the page cache (``cachestat``), or ``None``
    where the kernel cannot tell (before Linux 6.5)."""
    libc = _state["libc"]
    if libc is None or _state["no_cachestat"]:
        return None
    span = (ctypes.c_uint64 * 2)(start, length)
    stat = (ctypes.c_uint64 * 5)()
    if libc.syscall(ctypes.c_long(_CACHESTAT), ctypes.c_int(fd), span, stat, ctypes.c_uint(0)) != 0:
        _state["no_cachestat"] = True
        return None
    return int(stat[0])


class Guide:
    """A read-only map of one file and its announced ranges in chunks (see the module docstring).

    ``populate``: whether chunks are populated ahead of the reads (not when all is cached).
    """

    def __init__(self, fd: int, size: int, starts: np.ndarray, ends: np.ndarray, populate: bool = True) -> None:
        libc = _state["libc"]
        counts = -(-(ends - starts) // CHUNK)
        which = np.repeat(np.arange(len(starts)), counts)
        j = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        self.starts = starts[which] + j * CHUNK  # chunk i: bytes [starts[i], ends[i])
        self.ends = np.minimum(self.starts + CHUNK, ends[which])
        self.size = size
        self.populates = populate
        self._jobs: List[Optional["Future[bool]"]] = [None] * len(self.starts)
        if not populate:  # copies fault the cached pages in; nothing to ask for ahead
            done: "Future[bool]" = Future()
            done.set_result(True)
            self._jobs = [done] * len(self.starts)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._copying = 0  # copies out of the map in progress (close waits for them)
        self._closed = False
        self._length = -(-size // _PAGE) * _PAGE
        base, self._reserved, self._span = mapped.map_window(fd, 0, self._length)
        self.base = base
        if libc.madvise(base, self._length, mmap.MADV_HUGEPAGE) != 0 or \
                libc.madvise(base, self._length, mmap.MADV_RANDOM) != 0:
            err = ctypes.get_errno()
            mapped.unmap_window(self._reserved, self._span)
            raise OSError(err, "madvise")

    def ranges(self) -> Tuple[np.ndarray, np.ndarray]:
        """The announced ranges (merged), for a later announcement to add to."""
        return _union(self.starts, self.ends, 1)

    def _populate(self, i: int) -> bool:
        a = int(self.starts[i]) // _PAGE * _PAGE
        b = min(self._length, -(-int(self.ends[i]) // _PAGE) * _PAGE)
        return bool(_state["libc"].madvise(self.base + a, b - a, _MADV_POPULATE_READ) == 0)

    def probe(self) -> Optional[bool]:
        """Populate, on this thread, the first chunk that holds a whole 2 MiB block of the file, and say
        whether the kernel mapped a large page there (see the module); ``None`` when no chunk holds one
        or the populating failed."""
        whole = self.size // _PMD * _PMD
        for i in range(len(self.starts)):
            block = -(-int(self.starts[i]) // _PMD) * _PMD
            if block + _PMD <= min(int(self.ends[i]), whole):
                ok = self._populate(i)
                done: "Future[bool]" = Future()
                done.set_result(ok)
                with self._lock:
                    self._jobs[i] = done
                return _pmd_mapped(self.base) > 0 if ok else None
        return None

    def ahead(self, offset: int, length: int) -> int:
        """Start populating the chunks not asked for yet that overlap ``[offset, offset + length)`` or start
        less than :data:`AHEAD` bytes after it. Returns how many bytes were asked for."""
        if not self.populates:
            return 0
        lo = int(np.searchsorted(self.ends, offset, side="right"))
        hi = int(np.searchsorted(self.starts, offset + length + AHEAD, side="left"))
        asked = 0
        with self._lock:
            if self._closed:
                return 0
            for i in range(lo, hi):
                if self._jobs[i] is None:
                    self._jobs[i] = _pool().submit(self._populate, i)
                    asked += int(self.ends[i] - self.starts[i])
        return asked

    def read(self, offset: int, view: memoryview) -> bool:
        """Copy ``[offset, offset + len(view))`` from the map when chunks whose populating succeeded hold all
        of it (waiting for them); whether it did (else the caller reads from the descriptor)."""
        n = len(view)
        if n == 0 or offset < 0 or offset + n > self.size:
            return False
        i = int(np.searchsorted(self.ends, offset, side="right"))
        at = offset
        jobs: List[Tuple[int, "Future[bool]"]] = []
        with self._lock:
            if self._closed:
                return False
            while at < offset + n:
                job = self._jobs[i] if i < len(self.starts) and self.starts[i] <= at else None
                if job is None:
                    return False
                jobs.append((i, job))
                at = int(self.ends[i])
                i += 1
            self._copying += 1
        try:
            for k, job in jobs:
                if job.cancel():  # not started (the populating threads are busy): populate it here, now
                    done: "Future[bool]" = Future()
                    done.set_result(self._populate(k))
                    with self._lock:
                        self._jobs[k] = job = done
                if not job.result():
                    return False
            dest = np.frombuffer(view, dtype=np.uint8)  # type: ignore[call-overload]
            ctypes.memmove(dest.ctypes.data, self.base + offset, n)  # releases the GIL
            return True
        finally:
            with self._lock:
                self._copying -= 1
                if not self._copying:
                    self._idle.notify_all()

    def close(self) -> None:
        """Wait for the copies and the populating threads in progress (chunks not started are dropped),
        then unmap."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._copying:
                self._idle.wait()
            jobs = [j for j in self._jobs if j is not None and not j.done()]
        for job in jobs:
            if not job.cancel():
                try:
                    job.result()
                except BaseException:
                    pass
        mapped.unmap_window(self._reserved, self._span)


def plan(fd: int, size: int, starts: Any, ends: Any, previous: Optional[Guide] = None) -> Optional[Guide]:
    """The guide for reads of ``[starts[i], ends[i])`` of a file of ``size`` bytes open as ``fd`` (with what
    ``previous`` announced), or ``None`` when the ranges leave no gap worth skipping or guides are not
    available here (see the module). A new guide switches ``fd`` to ``POSIX_FADV_RANDOM``.
    """
    if size <= 0 or not available():
        return None
    s = np.asarray(starts, dtype=np.int64).reshape(-1)
    e = np.minimum(np.asarray(ends, dtype=np.int64).reshape(-1), size)
    if previous is not None:
        ps, pe = previous.ranges()
        s, e = np.concatenate([ps, s]), np.concatenate([pe, e])
    us, ue = _union(s, e, MERGE_GAP)
    if len(us) == 0:
        return None
    gaps = us[1:] - ue[:-1]
    if previous is None and not (gaps >= MIN_GAP).any() and size - int(ue[-1]) < MIN_GAP:
        return None
    first, last = int(us[0]) // _PAGE, -(-int(ue[-1]) // _PAGE)
    cached = cached_pages(fd, first * _PAGE, (last - first) * _PAGE)
    wanted = int((-(-ue // _PAGE) - us // _PAGE).sum())
    device = os.fstat(fd).st_dev
    if _large_pages.get(device) is False:
        return None
    populate = cached is None or cached < wanted
    try:
        guide = Guide(fd, size, us, ue, populate=populate)
    except OSError:
        return None
    if populate and device not in _large_pages:
        found = guide.probe()
        if found is not None:
            _large_pages[device] = found
        if not found:
            guide.close()
            return None
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:
        pass
    return guide
