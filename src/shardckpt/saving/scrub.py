"""Proof that the bytes an incremental save reuses are good: file stamps and the background scrub.

An incremental save (:mod:`shardckpt.saving.incremental`) links data files of the previous
checkpoint instead of writing their tensors again. Those bytes were good when they were
written; two things can spoil them afterwards, and each is caught here:

* **a file changed as a file** (rewritten in place, truncated, replaced by a rename): its
  *stamp* (:func:`file_stamp`) no longer equals the one its checkpoint recorded at the
  commit. Local disks: size, inode and modification time (ns); object stores: size and
  ETag. Not the device number (it may change at a remount, or between the clients of a
  network filesystem), not the ctime (linking a file into the next checkpoint and
  retention's deletion of the older name both change it). A file whose stamp differs is
  never linked: the save writes its tensors from memory.
* **bit rot that leaves the stamp alone**: the *scrub* reads the entries a save links and
  compares their CRC32C with the index, on a background thread of its own (nice 19: it
  yields the CPU to the training threads), while training goes on. A file is queued for
  a scrub by the first save that links it (at that save's arrange step: the scrub runs while
  the save goes on and after; the file was written, never read back) and again once it has
  been linked in :data:`SCRUB_EVERY` saves since its last proof; a save never
  links a file whose last proof (its write, or a passed scrub) is more than
  :data:`LINK_LIMIT` saves old (a scrub that did not finish in time, or one a restart
  lost): its tensors are written from memory instead. A file the scrub finds damaged is
  *marked*: its modification time is moved (every checkpoint that links it, in any
  process, now sees a stamp that differs from its record: the first case), and this
  process remembers it. Local disks only: an object store keeps its objects' integrity
  itself (checksums on upload, ETags), and reading them back would cost requests.

What a proof is worth is counted in saves (``age`` in the sidecar: saves since the file's
last proof, 0 for a file the save wrote). At the defaults the bytes a save links were
written or CRC-checked at most 8 saves before; usually the scrub of a newly linked file
has ended before the next save, so a file is proven one save after it is first linked.

On disk: nothing of its own; the stamps and ages live in the incremental sidecar
(``<prefix>.hashes.json``, ``files``), and a damaged file's only change is its mtime.
In memory, per process (:func:`default_scrubber`, a slot of the process's :mod:`~shardckpt.runtime`:
new after a reset and in a forked child): the queue,
the identities proven since they were queued, and those found damaged.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

from ..format import crc
from ..runtime import Slot
from ..storage.base import FileSystem, is_local_path

__all__ = ["SCRUB_EVERY", "LINK_LIMIT", "Stamp", "file_stamp", "file_identity", "scrubbed_store",
           "ScrubEntry", "Scrubber", "default_scrubber", "wait_for_scrubs", "identities_of"]

_log = logging.getLogger("shardckpt")

#: a linked file is scrubbed again once it has been linked in this many saves since its last proof
SCRUB_EVERY = 4
#: a save never links a file whose last proof (its write, or a passed scrub) is more saves old than this
LINK_LIMIT = 2 * SCRUB_EVERY
#: bytes read per call of the scrub
_CHUNK = 4 << 20
#: identities remembered as proven or damaged at most (the oldest are forgotten first)
_REMEMBERED = 4096

#: what a commit records of a data file: ``[size, inode, mtime ns]`` (local) or ``[size, ETag]``
Stamp = List[Any]
#: a file's identity as the store gives it (local: size, device, inode, mtime ns)
Identity = Tuple[Any, ...]


def file_identity(fs: FileSystem, path: str) -> Optional[Identity]:
    """The store's identity of the file at ``path`` (``None``: the store has none to give)."""
    return tuple(fs.identity(path))


def file_stamp(identity: Optional[Identity]) -> Optional[Stamp]:
    """The stamp a commit records of a file of this identity (see the module docstring)."""
    if identity is None:
        return None
    if len(identity) == 4:  # local: (size, device, inode, mtime ns); the device number is left out
        return [int(identity[0]), int(identity[2]), int(identity[3])]
    return [None if v is None else (int(v) if isinstance(v, int) else str(v)) for v in identity]


def scrubbed_store(path: str) -> bool:
    """Whether files at ``path`` are scrubbed (local disks; see the module docstring)."""
    return is_local_path(path)


@dataclass(frozen=True)
class ScrubEntry:
    """One index entry the scrub checks: its key, where its bytes lie and their masked CRC32C."""

    key: bytes
    offset: int
    size: int
    masked_crc32c: int


@dataclass
class _Job:
    fd: int
    path: str
    identity: Identity
    entries: Tuple[ScrubEntry, ...]


class Scrubber:
    """The process's background scrub (see the module docstring): a queue and one thread while it is
    not empty (it ends when the queue is)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: Deque[_Job] = collections.deque()
        self._pending: Set[Identity] = set()
        self._passed: Dict[Identity, None] = {}  # insertion-ordered sets
        self._damaged: Dict[Identity, None] = {}  # as queued, and as marked (its mtime moved)
        self._thread: Optional[threading.Thread] = None
        self._running = False
        #: bytes read and seconds spent by the scrub so far (for benchmarks)
        self.bytes_read = 0
        self.seconds = 0.0

    def submit(self, path: str, identity: Identity, entries: Sequence[ScrubEntry]) -> bool:
        """Queue the file at ``path`` (whose identity the caller just checked) for a scrub of ``entries``;
        whether it was queued (not when one of it is queued or proven already, or it cannot be opened).
        The file is opened now, so a deletion of this name before the scrub runs does not matter."""
        identity = tuple(identity)
        with self._cond:
            if identity in self._pending or identity in self._passed:
                return False
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                _log.info("scrub: cannot open %s (%s); not scrubbed now", path, exc)
                return False
            self._pending.add(identity)
            self._queue.append(_Job(fd, path, identity, tuple(sorted(entries, key=lambda e: e.offset))))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardckpt-scrub", daemon=True)
                self._thread.start()
        return True

    def take_pass(self, identity: Identity) -> bool:
        """Whether a scrub proved the file of ``identity`` good since it was queued; the proof is used up
        (the next save that links it counts its age from this one)."""
        with self._cond:
            identity = tuple(identity)
            if identity in self._passed:
                del self._passed[identity]
                return True
            return False

    def pending(self, identity: Identity) -> bool:
        """Whether a scrub of the file of ``identity`` is queued or running."""
        with self._cond:
            return tuple(identity) in self._pending

    def damaged(self, identity: Identity) -> bool:
        """Whether this process's scrub found the file of ``identity`` (the same file, any mtime) damaged."""
        with self._cond:
            return tuple(identity) in self._damaged

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued scrub has ended; whether they have (``False``: ``timeout`` passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        try:  # this thread only (Linux): the scrub yields the CPU to everything else
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        buf = bytearray(_CHUNK)
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None
                    self._cond.notify_all()
                    return
                job = self._queue.popleft()
                self._running = True
            started = time.perf_counter()
            verdict: Optional[bool] = None
            read, marked = 0, None
            try:
                verdict, read, marked = _check(job, buf)
            except Exception as exc:  # unreadable now: not proven, and the next save's stamp check decides
                _log.warning("scrub of %s failed: %s", job.path, exc)
            finally:
                os.close(job.fd)
            with self._cond:
                self._pending.discard(job.identity)
                if verdict is True:
                    _remember(self._passed, job.identity)
                elif verdict is False:
                    for identity in (job.identity, marked):
                        if identity is not None:
                            _remember(self._damaged, identity)
                self.bytes_read += read
                self.seconds += time.perf_counter() - started
                self._running = False
                self._cond.notify_all()

    def _forget_in_child(self) -> None:
        for job in self._queue:
            try:
                os.close(job.fd)
            except OSError:
                pass


def _remember(kept: Dict[Identity, None], identity: Identity) -> None:
    kept[identity] = None
    while len(kept) > _REMEMBERED:
        del kept[next(iter(kept))]


def _check(job: _Job, buf: bytearray) -> Tuple[Optional[bool], int, Optional[Identity]]:
    """Read ``job``'s entries and compare their CRC32C with the index: ``True`` (all good), ``False``
    (damaged: the file is marked), ``None`` (the file changed since it was queued: the stamp check
    of the next save sees that); the bytes read; a damaged file's identity once marked."""
    st = os.fstat(job.fd)
    if (st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns) != job.identity:
        return None, 0, None
    view = memoryview(buf)
    read = 0
    for entry in job.entries:
        value, left, offset = 0, entry.size, entry.offset
        while left > 0:
            n = os.preadv(job.fd, [view[:min(left, len(buf))]], offset)
            if n <= 0:
                break
            value = crc.extend(value, view[:n])
            left -= n
            offset += n
            read += n
        expected = crc.unmask(entry.masked_crc32c)
        if left > 0 or value != expected:
            return False, read, _mark_damaged(job, st, entry, value, expected, left)
    return True, read, None


def _mark_damaged(job: _Job, st: os.stat_result, entry: ScrubEntry, value: int, expected: int,
                  left: int) -> Optional[Identity]:
    """Log the damage and move the file's mtime, so that every checkpoint linking it sees its stamp change;
    the file's identity after the move (``None``: it could not be moved)."""
    key = entry.key.decode("utf-8", "backslashreplace")
    what = (f"{left} bytes missing" if left > 0
            else f"checksum does not match (stored 0x{expected:08x}, computed 0x{value:08x})")
    moved = max(time.time_ns(), st.st_mtime_ns + 2_000_000_000)
    identity: Optional[Identity] = None
    try:
        os.utime(job.fd if os.utime in os.supports_fd else job.path, ns=(st.st_atime_ns, moved))
        after = os.fstat(job.fd)
        identity = (after.st_size, after.st_dev, after.st_ino, after.st_mtime_ns)
        marked = "its mtime was moved, so no save links it again"
    except OSError as exc:
        marked = f"its mtime could not be moved ({exc}); this process links it no more"
    _log.error("scrub: %s: key %r at offset %d: %s; the data file is damaged and %s: the next save writes "
               "its tensors from memory", job.path, key, entry.offset, what, marked)
    return identity


#: The process's scrubber (a forked child closes the files its parent's had queued, and makes its own).
_DEFAULT: "Slot[Scrubber]" = Slot("the scrubber", Scrubber, in_child=Scrubber._forget_in_child)


def default_scrubber() -> Scrubber:
    """The process's :class:`Scrubber`, created on first use (a slot of the process's :mod:`~shardckpt.runtime`)."""
    return _DEFAULT.get()


def wait_for_scrubs(timeout: Optional[float] = None) -> bool:
    """Wait until this process's queued scrubs have ended (tests, benchmarks, a job about to exit)."""
    scrubber = _DEFAULT.peek()
    return True if scrubber is None else scrubber.wait(timeout)


def identities_of(fs: FileSystem, paths: Sequence[str]) -> Dict[str, Optional[Identity]]:
    """The identity of each of ``paths`` (``None``: missing, or the store gives none), in one batch
    where the store offers one (an object store: one listing)."""
    return {p: (None if i is None else tuple(i)) for p, i in fs.identities(list(paths)).items()}
