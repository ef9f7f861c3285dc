"""Run batches copied out of a memory map of the file: one copy in user space, no call per run.

A resharded restore reads a region of a stored chunk: a part of every row (half of each
row when a row-sharded tensor is loaded column-sharded). As read calls that is one
request per row (through io_uring, ~1 µs of kernel work each beside the copy); through a
map of the file it is one strided copy (measured here, 16,384 runs of 8 KiB from the page
cache: 28.8 ms of CPU through io_uring, 16.5-17.6 ms through a map; a 1 GiB load 4 -> 2
ranks, row- to column-sharded: 144-152 ms of CPU a rank through io_uring, 107 through maps).

Protocol (:func:`copy_runs`, called by
:meth:`LocalFileSystem.pread_batch <shardckpt.storage.local.LocalFileSystem.pread_batch>`
for a batch of ascending, disjoint runs going to consecutive places of one buffer):

1. A window of the file holding a stretch of the runs (at most :data:`WINDOW` bytes) is
   mapped read-only and shared, at an address with the same offset from a 2 MiB boundary
   as the file offset, so that large page-cache pages can be mapped whole, with
   ``MADV_HUGEPAGE`` where transparent huge pages are not ``never``: the kernel maps a
   large cached page with one entry, and a fault on a page not cached reads its 2 MiB
   block into one large page-cache page (where the file system keeps large pages; the
   hint does nothing elsewhere). Without it, faults read small pages around the fault,
   and every later read of the file pays for them: measured, a cold 1 GiB load 4 -> 2
   took 595 ms without the hint and 542 ms with it, and the warm loads after it 176 ms
   against 126 ms.
2. With ``populate``, ``MADV_POPULATE_READ`` faults in the pages of the window's runs
   first. It reports a failure (a disk error, the file cut short meanwhile) as an error
   code, not a signal: the window is unmapped and the call returns ``None`` having
   copied nothing of it that the caller relies on; the caller then reads the runs with
   read calls, which raise the usual :class:`~shardckpt.errors.StorageError` /
   :class:`~shardckpt.errors.DataLossError`.
3. The runs are copied out (one strided NumPy copy when evenly spaced, which is the
   rows of a region), the window unmapped, the next window mapped.

Nothing is written; nothing outlives the call (no map is kept).

The price (the same as guided reads', :mod:`.guided`): a page evicted between the
populating and the copy that then fails to read again, or the file truncated by someone
else in that moment, ends the process with ``SIGBUS`` instead of raising. The files read
this way are the data files of committed checkpoints, which nothing writes into.
``LocalFileSystem(map_runs=False)`` (``TFBundleReader(map_reads=False)``) or
``SHARDCKPT_MAP_READS=0`` for the process turns it off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
from typing import Any, Optional, Tuple

import numpy as np

__all__ = ["copy_runs", "map_window", "unmap_window", "available", "can_populate", "libc",
           "transparent_huge_pages", "WINDOW", "PMD"]

WINDOW = 256 << 20  # at most this much of a file is mapped at once
PMD = 2 << 20  # a large page-cache page (x86-64, arm64 with 4 KiB pages)
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # Linux 5.14+
_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value

_state: dict = {"libc": None, "checked": False, "populate": None, "thp": None}


def available() -> bool:
    """Whether maps serve run batches by default here: Linux, ``SHARDCKPT_MAP_READS`` not ``0``, and the C
    library's ``mmap``/``madvise`` reachable. (Whether the kernel populates ranges, Linux 5.14+, is learnt
    on first use: where it does not, default reads stay read calls.)"""
    if os.environ.get("SHARDCKPT_MAP_READS", "1") == "0":
        return False
    return libc() is not None and can_populate()


def can_populate() -> bool:
    """Whether ``MADV_POPULATE_READ`` may work here (``False`` once a kernel refused it)."""
    return _state["populate"] is not False


def libc() -> Any:
    """The C library with ``mmap``, ``munmap``, ``madvise`` and ``syscall`` typed for ctypes (Linux), or
    ``None``; loaded once (the maps of this module and of :mod:`.guided` use it)."""
    if not _state["checked"]:
        _state["checked"] = True
        if platform.system() == "Linux":
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.mmap.restype = ctypes.c_void_p
                lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_long]
                lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.syscall.restype = ctypes.c_long
                _state["libc"] = lib
            except (OSError, AttributeError):
                pass
    return _state["libc"]


def transparent_huge_pages() -> bool:
    """Whether transparent huge pages may be asked for here (not ``never``)."""
    huge = _state.get("thp")
    if huge is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
                huge = "[never]" not in fh.read()
        except OSError:
            huge = False
        _state["thp"] = huge
    return bool(huge)


def map_window(fd: int, offset: int, length: int) -> Tuple[int, int, int]:
    """Map ``length`` bytes (a multiple of the page) of the file open as ``fd`` from ``offset`` (a multiple
    of 2 MiB) read-only and shared, at a 2 MiB-aligned address (large page-cache pages are mapped whole
    only there): ``(address, reserved, span)``; :func:`unmap_window` with ``(reserved, span)`` unmaps it.
    Raises ``OSError`` when a map cannot be made (nothing is left mapped)."""
    calls = libc()
    if calls is None:
        raise OSError(0, "no C library to map files with")
    span = length + PMD
    reserved = calls.mmap(None, span, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if reserved in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap")
    at = -(-reserved // PMD) * PMD
    if calls.mmap(at, length, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, offset) != at:
        err = ctypes.get_errno()
        calls.munmap(reserved, span)
        raise OSError(err, "mmap")
    return at, reserved, span


def unmap_window(reserved: int, span: int) -> None:
    """Unmap a window of :func:`map_window` (the file's map lies inside the reservation: both go)."""
    libc().munmap(reserved, span)


def copy_runs(fd: int, offsets: np.ndarray, run_bytes: int, dest: np.ndarray, *, populate: bool = True,
              huge: bool = True) -> Optional[int]:
    """Copy run ``i`` (``run_bytes`` from file offset ``offsets[i]``, ascending and disjoint, all inside
    the file) into ``dest[i]`` (a ``(len(offsets), run_bytes)`` uint8 array) through maps of the file
    open as ``fd``; see the module. Returns the bytes copied, or ``None`` when a map could not be
    made or populated (the caller reads the runs with read calls instead; runs already copied are
    simply read again). ``populate=False`` copies without populating first (faults read the pages);
    ``huge=False`` leaves out ``MADV_HUGEPAGE``."""
    calls = libc()
    if calls is None:
        return None
    n = len(offsets)
    rb = int(run_bytes)
    huge = huge and transparent_huge_pages()
    i = 0
    while i < n:
        base = int(offsets[i]) // PMD * PMD
        j = max(i + 1, int(np.searchsorted(offsets, base + WINDOW - rb, side="right")))
        end = int(offsets[j - 1]) + rb
        length = -(-(end - base) // _PAGE) * _PAGE
        try:
            at, reserved, span = map_window(fd, base, length)
        except OSError:
            return None
        try:
            if huge:
                calls.madvise(at, length, mmap.MADV_HUGEPAGE)  # a hint: without it the copy still works
            if populate:
                first = int(offsets[i]) - base
                lo = first // _PAGE * _PAGE
                if calls.madvise(at + lo, length - lo, _MADV_POPULATE_READ) != 0:
                    if ctypes.get_errno() == 22:  # EINVAL: a kernel before 5.14
                        _state["populate"] = False
                    return None
                _state["populate"] = True
            src = np.ctypeslib.as_array(ctypes.cast(at, ctypes.POINTER(ctypes.c_uint8)), shape=(length,))
            rel = offsets[i:j] - base
            steps = np.diff(rel)
            if len(steps) and (steps == steps[0]).all():  # evenly spaced (rows): one strided copy
                runs = np.lib.stride_tricks.as_strided(src[int(rel[0]):], shape=(j - i, rb),
                                                       strides=(int(steps[0]), 1))
                np.copyto(dest[i:j], runs)
                del runs
            else:
                for k, r in enumerate(rel.tolist(), start=i):
                    dest[k] = src[r:r + rb]
            del src
        finally:
            unmap_window(reserved, span)
        i = j
    return n * rb
