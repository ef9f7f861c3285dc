"""Many positional reads in one system call: a small io_uring client (Linux, x86-64) over ``ctypes``.

A resharded load reads tens of thousands of runs (half of every row of a chunk) that
are not adjacent in the file. One ``preadv`` per run costs a system call and a few
Python objects per run; here the runs are handed to the kernel in batches of up to
1024 ``IORING_OP_READ`` requests, written into the submission ring with NumPy in bulk,
submitted and waited for with one ``io_uring_enter`` per batch. The bytes read are
exactly the runs' bytes.

Protocol of :func:`read_runs` (``fd``, ``offsets``, ``addresses``, ``length``): request
``i`` reads ``length`` bytes at file offset ``offsets[i]`` into memory at
``addresses[i]``; the call returns each request's result (bytes read, or ``-errno``)
only once every request it submitted has completed, so no read lands in memory
after it returns (an exception raised while waiting, a ``KeyboardInterrupt``
included, is re-raised only after the wait). Short or failed requests are the
caller's to redo with ordinary reads, which raise the usual errors. Nothing is
written to any file.

The ring is per thread and per process (a forked child makes its own; it never
touches its parent's). Where io_uring cannot be used (not Linux on x86-64, a kernel
without it, a seccomp profile or ``kernel.io_uring_disabled`` that refuses it,
``SHARDCKPT_IO_URING=0``) :func:`read_runs` returns ``None`` and the caller reads the
runs one call each. x86-64 only because its memory ordering makes plain NumPy
stores and loads of the ring's head and tail correct without explicit barriers.

``/proc/<pid>/io``'s ``rchar`` does not count these reads; callers count them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import threading
from typing import Any, Optional

import numpy as np

__all__ = ["read_runs", "available", "BATCH"]

BATCH = 1024  # requests per submission (the ring's size)
_SETUP, _ENTER = 425, 426  # syscall numbers (the same on every architecture but alpha)
_ENTER_GETEVENTS = 1
_FEAT_SINGLE_MMAP = 1
_OP_READ = 22
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAX_LEN = 1 << 30  # one request reads at most this much (a 32-bit length field)

_SQE = np.dtype([("opcode", "u1"), ("flags", "u1"), ("ioprio", "<u2"), ("fd", "<i4"), ("off", "<u8"),
                 ("addr", "<u8"), ("len", "<u4"), ("rw_flags", "<u4"), ("user_data", "<u8"), ("pad", "V24")])
_CQE = np.dtype([("user_data", "<u8"), ("res", "<i4"), ("flags", "<u4")])

_local = threading.local()
_state = {"disabled": os.environ.get("SHARDCKPT_IO_URING", "1") == "0"
          or platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64")}
_syscall: Any = None


def _libc_syscall() -> Any:
    global _syscall
    if _syscall is None:
        libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL
        fn = libc.syscall
        fn.restype = ctypes.c_long
        _syscall = fn
    return _syscall


class _Ring:
    """One io_uring instance: its file descriptor and NumPy views of its rings (see the module)."""

    def __init__(self, entries: int, flags: int = 0) -> None:
        call = _libc_syscall()
        params = (ctypes.c_uint32 * 30)()  # struct io_uring_params, 120 bytes
        params[2] = flags
        fd = call(ctypes.c_long(_SETUP), ctypes.c_uint32(entries), params)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self.fd = int(fd)
        self.pid = os.getpid()
        self._maps = []
        try:
            p = np.array(params[:], dtype=np.uint32)
            sq_entries, cq_entries, features = int(p[0]), int(p[1]), int(p[5])
            sq_off, cq_off = p[10:20], p[20:30]  # io_sqring_offsets, io_cqring_offsets
            sq_size = int(sq_off[6]) + sq_entries * 4
            cq_size = int(cq_off[5]) + cq_entries * _CQE.itemsize
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            flags = mmap.MAP_SHARED | _MAP_POPULATE
            if features & _FEAT_SINGLE_MMAP:
                sq_map = cq_map = mmap.mmap(self.fd, max(sq_size, cq_size), flags, prot, offset=_OFF_SQ_RING)
                self._maps.append(sq_map)
            else:
                sq_map = mmap.mmap(self.fd, sq_size, flags, prot, offset=_OFF_SQ_RING)
                self._maps.append(sq_map)
                cq_map = mmap.mmap(self.fd, cq_size, flags, prot, offset=_OFF_CQ_RING)
                self._maps.append(cq_map)
            sqe_map = mmap.mmap(self.fd, sq_entries * _SQE.itemsize, flags, prot, offset=_OFF_SQES)
            self._maps.append(sqe_map)
            self.sq = np.frombuffer(sq_map, dtype=np.uint32)
            self.cq = sq_words = np.frombuffer(cq_map, dtype=np.uint32)
            self.sq_head, self.sq_tail = int(sq_off[0]) // 4, int(sq_off[1]) // 4
            self.sq_mask = int(self.sq[int(sq_off[2]) // 4])
            array = int(sq_off[6]) // 4
            self.sq[array:array + sq_entries] = np.arange(sq_entries, dtype=np.uint32)  # slot i -> SQE i
            self.cq_head, self.cq_tail = int(cq_off[0]) // 4, int(cq_off[1]) // 4
            self.cq_mask = int(sq_words[int(cq_off[2]) // 4])
            self.cqes = np.frombuffer(cq_map, dtype=_CQE, count=cq_entries, offset=int(cq_off[5]))
            self.sqes = np.frombuffer(sqe_map, dtype=_SQE)
            self.entries = sq_entries
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for attr in ("sq", "cq", "cqes", "sqes"):
            self.__dict__.pop(attr, None)
        for m in self._maps:
            try:
                m.close()
            except (BufferError, ValueError):
                pass
        self._maps = []
        if self.fd >= 0 and self.pid == os.getpid():
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort at thread exit
        try:
            self.close()
        except Exception:
            pass

    def _enter(self, submit: int, wait: int) -> int:
        got = _libc_syscall()(ctypes.c_long(_ENTER), ctypes.c_uint(self.fd), ctypes.c_uint(submit),
                              ctypes.c_uint(wait), ctypes.c_uint(_ENTER_GETEVENTS), None, ctypes.c_size_t(0))
        if got < 0:
            code = ctypes.get_errno()
            if code in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                return -1
            raise OSError(code, os.strerror(code))
        return int(got)

    def read(self, fd: int, offsets: np.ndarray, addresses: np.ndarray, length: int, results: np.ndarray) -> None:
        """Submit ``len(offsets)`` (at most ``entries``) reads, wait for all of them, fill ``results``."""
        k = len(offsets)
        tail = int(self.sq[self.sq_tail])
        block = np.zeros(k, dtype=_SQE)
        block["opcode"] = _OP_READ
        block["fd"] = fd
        block["off"] = offsets
        block["addr"] = addresses
        block["len"] = length
        block["user_data"] = np.arange(k, dtype=np.uint64)
        self.sqes[(tail + np.arange(k, dtype=np.int64)) & self.sq_mask] = block
        end = (tail + k) & 0xFFFFFFFF
        self.sq[self.sq_tail] = end  # x86-64: the kernel sees the requests before the new tail
        first = int(self.cq[self.cq_head])  # completions reaped so far: the ring's own count, never lost
        pending: Optional[BaseException] = None
        while (int(self.cq[self.cq_head]) - first) & 0xFFFFFFFF < k:
            try:
                done = (int(self.cq[self.cq_head]) - first) & 0xFFFFFFFF
                left = (end - int(self.sq[self.sq_head])) & 0xFFFFFFFF  # requests the kernel has not taken
                try:
                    self._enter(left, k - done)  # waits only once every request is taken
                except OSError:
                    if left == k:  # nothing taken: withdraw the requests, the caller reads another way
                        self.sq[self.sq_tail] = tail
                    else:  # reads in flight that cannot be waited for: never use this ring again
                        self.close()
                    raise
                self._reap(results)
            except OSError:
                raise
            except BaseException as exc:  # noqa: BLE001 - e.g. KeyboardInterrupt: the reads finish first
                pending = pending or exc
        if pending is not None:
            raise pending

    def _reap(self, results: np.ndarray) -> None:
        """Copy the posted completions' results out, then release their slots (the head moves last)."""
        head = int(self.cq[self.cq_head])
        tail = int(self.cq[self.cq_tail])
        count = (tail - head) & 0xFFFFFFFF
        if count:
            entries = self.cqes[(head + np.arange(count, dtype=np.int64)) & self.cq_mask]
            results[entries["user_data"].astype(np.int64)] = entries["res"]
            self.cq[self.cq_head] = tail


def _ring() -> Optional[_Ring]:
    """This thread's ring (made on first use), or ``None`` where io_uring is not available."""
    if _state["disabled"]:
        return None
    ring: Optional[_Ring] = getattr(_local, "ring", None)
    if ring is not None and ring.pid == os.getpid() and ring.fd >= 0:
        return ring
    try:
        ring = _Ring(BATCH)
    except (OSError, ValueError, AttributeError):
        _state["disabled"] = True  # refused here (no kernel support, seccomp, a sysctl): never ask again
        return None
    _local.ring = ring
    return ring


def available() -> bool:
    """Whether :func:`read_runs` can read through io_uring in this thread."""
    return _ring() is not None


def read_runs(fd: int, offsets: np.ndarray, addresses: np.ndarray, length: int) -> Optional[np.ndarray]:
    """Read ``length`` bytes at each of ``offsets`` into each of ``addresses`` (see the module).

    Returns each request's result (``length`` when whole; fewer bytes at the end of
    the file; ``-errno`` on failure), or ``None`` (nothing read) where io_uring is not
    available or ``length`` is outside 1 .. 1 GiB.
    """
    if not 0 < length <= _MAX_LEN:
        return None
    ring = _ring()
    if ring is None:
        return None
    n = len(offsets)
    results = np.full(n, -errno.EIO, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.uint64)
    addresses = np.asarray(addresses, dtype=np.uint64)
    step = ring.entries
    try:
        for i in range(0, n, step):
            j = min(n, i + step)
            part = np.full(j - i, -errno.EIO, dtype=np.int64)
            ring.read(fd, offsets[i:j], addresses[i:j], length, part)
            results[i:j] = part
    except OSError:
        if ring.fd < 0:
            _local.ring = None
        if i == 0:
            return None  # nothing read: the caller reads the runs one by one
        results[i:] = -errno.EIO  # the rest is redone by the caller's ordinary reads
    return results
