"""Whole-entry reads: queued, read in file order by a few threads, checksummed as the bytes land.

A :class:`ReadPump` takes whole entries (:class:`EntryRead`: where the entry lies in a
data file, the flat bytes of the array it goes into) and turns them into *spans*,
contiguous byte ranges of one file:

* a large entry is cut into units (at least one per worker, so one large read uses
  every core), each a span of its own;
* small entries that lie next to each other in the file are gathered into one span,
  read with one request and handed out to their arrays.

Spans are queued in the order entries arrive (for a restore: file order) and taken by
the pump's helpers (threads of a :class:`~shardckpt.format.crc.ChecksumContext`) while
the caller goes on planning; :meth:`ReadPump.drain` makes the calling thread take
spans too and waits until none is left. Reading and checksumming release the GIL, so
the helpers use every core.

How one span is read: in pieces of ``sub`` bytes, each checksummed (CRC32C) right after
it lands, while it is still in the CPU cache. A piece goes straight into the destination
array unless the copy would be slow: the kernel copies file pages into user memory with
``rep movsb``, which on current AMD cores (and some Intel ones) runs at about a quarter
of its speed when the destination is a few bytes past the source modulo 4096 (a store
aliasing the next load). Fresh NumPy arrays large enough to be mapped on their own start
16 bytes into a page, so an entry that starts on a page boundary in its file lands just
there (the reader's own destinations are 64-byte aligned, :mod:`.buffers`: 64 bytes in,
outside the slow range). Such pieces (and gathered small entries) are read into a per-thread bounce buffer
placed half a page away from the source, checksummed there, and copied into the
array (an in-cache copy, again half a page away).

Each entry's parts carry their own CRC; :meth:`EntryRead.check` combines them in order
(:func:`~shardckpt.format.crc.combine`) and compares the result with the stored
checksum. Failures (a read error, a short file) are kept per entry; the owner decides
when to raise them, so values must not be trusted before the check.

Nothing is written to any file here; the destination arrays are written by the helpers
until :meth:`ReadPump.drain` returns.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..storage.base import FileSystem
from . import crc

__all__ = ["EntryRead", "ReadPump", "read_range", "unit_bounds", "ALIGN"]

ALIGN = 64 << 10  # unit boundaries (relative to the entry) are multiples of this
_PAGE = 4096
_SLOW_SKEW = 64  # a copy whose destination is 1..63 bytes past its source (mod 4096) is slow
_BOUNCE_AT = _PAGE // 2  # bounce buffers sit half a page away from the bytes they hold
_GATHER_MAX = 256 << 10  # entries up to this size are gathered with their neighbours ...
_GATHER_SPAN = 1 << 20  # ... into spans of at most this many bytes

_local = threading.local()


def unit_bounds(size: int, unit: int, min_unit: int, workers: int) -> List[Tuple[int, int]]:
    """Split ``size`` bytes into nearly equal units of at most ``unit`` bytes (64 KiB aligned).

    An entry of at least two ``min_unit`` is split into one unit per worker at least,
    so a single large-ish read uses every core.
    """
    if size <= 0:
        return [(0, 0)]
    count = max(-(-size // unit), min(workers, size // min_unit))
    step = -(-size // count)
    step = -(-step // ALIGN) * ALIGN
    return [(a, min(size, a + step)) for a in range(0, size, step)]


def _mv(array: np.ndarray) -> memoryview:
    return memoryview(array)  # type: ignore[arg-type]


def _slow_copy(dest_addr: int, file_offset: int) -> bool:
    """Whether copying file bytes at ``file_offset`` to ``dest_addr`` hits the slow ``rep movsb`` case."""
    return 0 < (dest_addr - file_offset) % _PAGE < _SLOW_SKEW


def _bounce(nbytes: int) -> np.ndarray:
    """This thread's bounce buffer (at least ``nbytes + 2 pages``; grown when needed)."""
    buf: Optional[np.ndarray] = getattr(_local, "bounce", None)
    if buf is None or len(buf) < nbytes + 2 * _PAGE:
        buf = np.empty(nbytes + 2 * _PAGE, dtype=np.uint8)
        _local.bounce = buf
        _local.addr = buf.ctypes.data
    return buf


def _bounce_view(file_offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of this thread's bounce buffer, placed half a page away from ``file_offset`` (mod 4096)."""
    buf = _bounce(nbytes)
    start = (file_offset + _BOUNCE_AT - _local.addr) % _PAGE
    return buf[start:start + nbytes]


def read_range(fs: FileSystem, fd: Any, path: str, file_offset: int, dest: np.ndarray, sub: int,
               verify: bool, value: int = 0, slow: Optional[bool] = None) -> int:
    """Fill ``dest`` (flat ``uint8``) from ``file_offset`` in pieces of ``sub`` bytes; the CRC-32C
    of the bytes extended from ``value`` (``value`` unchanged when not ``verify``)."""
    total = len(dest)
    if slow is None:
        slow = _slow_copy(dest.ctypes.data, file_offset) if total else False
    if not slow:
        mv = _mv(dest)
        for s in range(0, total, sub):
            view = mv[s:s + sub]
            fs.pread_into(fd, view, file_offset + s, path)
            if verify:
                value = crc.extend(value, view)
        return value
    for s in range(0, total, sub):
        n = min(sub, total - s)
        tmp = _bounce_view(file_offset + s, n)
        view = _mv(tmp)
        fs.pread_into(fd, view, file_offset + s, path)
        if verify:
            value = crc.extend(value, view)
        np.copyto(dest[s:s + n], tmp)
    return value


class EntryRead:
    """One whole entry read into ``dest`` (flat ``uint8``), in parts whose CRCs are combined in order.

    ``expected`` is the stored (unmasked) CRC-32C; ``tag`` is the owner's (what the entry is).
    """

    __slots__ = ("fd", "path", "offset", "size", "dest", "verify", "expected", "tag", "shard",
                 "parts", "crcs", "error", "slow")

    def __init__(self, fd: Any, path: str, offset: int, dest: np.ndarray, verify: bool, expected: int,
                 tag: Any, shard: int) -> None:
        self.fd = fd
        self.path = path
        self.offset = offset
        self.size = len(dest)
        self.dest = dest
        self.verify = verify
        self.expected = expected
        self.tag = tag
        self.shard = shard
        self.parts: List[Tuple[int, int]] = []  # entry-relative ranges, in order
        self.crcs: List[int] = []
        self.error: Optional[BaseException] = None
        self.slow: Optional[bool] = None if self.size else False  # found by the first reader (see is_slow)

    def is_slow(self) -> bool:
        """Whether copying the entry's file bytes straight into ``dest`` hits the slow ``rep movsb`` case
        (found once, by whichever thread reads first: finding the address costs the planner a microsecond)."""
        slow = self.slow
        if slow is None:
            slow = self.slow = _slow_copy(self.dest.ctypes.data, self.offset)
        return slow

    def _part(self, a: int, b: int) -> int:
        self.parts.append((a, b))
        self.crcs.append(0)
        return len(self.parts) - 1

    def computed(self) -> int:
        """The CRC-32C of the entry's bytes, from its parts' CRCs."""
        total = self.crcs[0] if self.crcs else 0
        for (a, b), value in zip(self.parts[1:], self.crcs[1:]):
            total = crc.combine(total, value, b - a)
        return total

    def mismatch(self) -> Optional[str]:
        """``None`` when the checksum matches (or is not checked), else what does not match."""
        if not self.verify:
            return None
        computed = self.computed()
        if computed == self.expected:
            return None
        return f"checksum does not match: stored 0x{self.expected:08x}, computed 0x{computed:08x}"


class _Span:
    """Contiguous bytes ``[start, end)`` of one file and the entry parts they fill."""

    __slots__ = ("fd", "path", "start", "end", "parts")

    def __init__(self, fd: Any, path: str, start: int) -> None:
        self.fd = fd
        self.path = path
        self.start = start
        self.end = start
        self.parts: List[Tuple[EntryRead, int, int]] = []  # (entry, part index, entry-relative start)

    def add(self, entry: EntryRead, a: int, b: int) -> None:
        self.parts.append((entry, entry._part(a, b), a))
        self.end += b - a


class _Lane:
    """Spans ``[next, stop)`` of the pump's list that one reader takes in order (one sequential stream)."""

    __slots__ = ("next", "stop")

    def __init__(self, start: int, stop: int) -> None:
        self.next = start
        self.stop = stop

    def left(self) -> int:
        return self.stop - self.next


class ReadPump:
    """Reads queued whole entries on up to ``workers`` helper threads (see the module docstring).

    Safe to feed from several threads. ``unit``: the largest span of one entry;
    ``min_unit``: an entry is split across workers only into spans at least this large;
    ``sub``: bytes read (and checksummed) per request.
    """

    def __init__(self, fs: FileSystem, executor: Callable[[], ThreadPoolExecutor], workers: int, *,
                 unit: int, min_unit: int, sub: int) -> None:
        self._fs = fs
        self._executor = executor
        self._workers = max(0, workers)  # 0: no helpers, the calling thread reads everything in drain()
        self._unit = unit
        self._min_unit = min_unit
        self._sub = sub
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._spans: List[Optional[_Span]] = []  # in arrival order; a taken span's slot is emptied
        self._frontier = 0  # spans before it belong to a lane
        self._lanes: List[_Lane] = []
        self._outstanding = 0  # spans queued or being read
        self._helpers = 0
        self._gather: Optional[_Span] = None  # small neighbours waiting for more

    # -- feeding -----------------------------------------------------------------------------
    def add(self, entry: EntryRead) -> None:
        """Queue ``entry``; helpers start reading it at once (gathered small entries: once their span is full)."""
        self.add_many((entry,))

    def add_many(self, entries: Sequence[EntryRead]) -> None:
        """Queue ``entries`` in order, as :meth:`add` does each, taking the lock once (a restore's planner
        hands over entries in batches: one lock and one wake-up per batch, not per tensor)."""
        spans: List[_Span] = []
        with self._lock:
            unit, min_unit, workers = self._unit, self._min_unit, self._workers
            for entry in entries:
                size = entry.size
                gather = self._gather
                if size <= _GATHER_MAX:
                    if gather is not None and (gather.fd is not entry.fd or gather.end != entry.offset
                                               or gather.end - gather.start + size > _GATHER_SPAN):
                        spans.append(gather)  # not a neighbour, or the span is full
                        gather = None
                    if gather is None:
                        gather = self._gather = _Span(entry.fd, entry.path, entry.offset)
                    gather.add(entry, 0, size)
                    continue
                if gather is not None:
                    spans.append(gather)
                    self._gather = None
                for a, b in unit_bounds(size, unit, min_unit, workers):
                    span = _Span(entry.fd, entry.path, entry.offset + a)
                    span.add(entry, a, b)
                    spans.append(span)
            self._push(spans)

    def _push(self, spans: List[_Span]) -> None:
        """Queue ``spans`` and start helpers for them (holding the lock)."""
        if not spans:
            return
        self._spans.extend(spans)
        self._outstanding += len(spans)
        wanted = min(self._workers, self._outstanding) - self._helpers
        for _ in range(max(0, wanted)):
            try:
                self._executor().submit(self._help)
            except RuntimeError:  # interpreter shutting down: drain() reads on the calling thread
                break
            self._helpers += 1

    def flush(self) -> None:
        """Queue the small entries still waiting for neighbours."""
        with self._lock:
            if self._gather is not None:
                span, self._gather = self._gather, None
                self._push([span])

    # -- reading -----------------------------------------------------------------------------
    def _help(self) -> None:
        try:
            self._work()
        finally:
            with self._lock:
                self._helpers -= 1

    def _work(self) -> None:
        lane: Optional[_Lane] = None
        while True:
            with self._lock:
                lane, i = self._claim(lane)
                if lane is None:
                    return
                span = self._spans[i]
                self._spans[i] = None
            assert span is not None
            try:
                self._read(span)
            finally:
                with self._lock:
                    self._outstanding -= 1
                    if self._outstanding == 0:
                        self._spans, self._frontier, self._lanes = [], 0, []
                        self._idle.notify_all()

    def _claim(self, lane: Optional[_Lane]) -> Tuple[Optional[_Lane], int]:
        """The next span for a reader that held ``lane`` (holding the lock): the next of its lane; else
        the spans no lane has yet, as a new lane; else the back half of the longest lane."""
        if lane is not None:
            if lane.next < lane.stop:
                lane.next += 1
                return lane, lane.next - 1
            if lane in self._lanes:
                self._lanes.remove(lane)
        if self._frontier < len(self._spans):
            lane = _Lane(self._frontier, len(self._spans))
            self._frontier = lane.stop
        else:
            victim = max(self._lanes, key=_Lane.left, default=None)
            if victim is None or victim.left() < 2:
                return None, -1
            mid = (victim.next + victim.stop + 1) // 2
            lane = _Lane(mid, victim.stop)
            victim.stop = mid
        self._lanes.append(lane)
        lane.next += 1
        return lane, lane.next - 1

    def drain(self) -> None:
        """Queue everything, read spans on this thread too, and wait until every span is read."""
        self.flush()
        self._work()
        with self._lock:
            while self._outstanding:
                self._idle.wait()

    def _read(self, span: _Span) -> None:
        fs, sub = self._fs, self._sub
        if len(span.parts) == 1:
            entry, index, a = span.parts[0]
            if entry.error is not None:
                return
            b = a + span.end - span.start
            try:
                entry.crcs[index] = read_range(fs, span.fd, span.path, span.start, entry.dest[a:b], sub,
                                               entry.verify, slow=entry.is_slow())
            except BaseException as exc:  # kept for the entry's owner
                entry.error = entry.error or exc
            return
        try:  # gathered neighbours: one request per ``sub`` bytes, through the bounce buffer
            pos = span.start
            parts = span.parts
            i = 0
            while pos < span.end:
                n = min(sub, span.end - pos)
                tmp = _bounce_view(pos, n)
                view = _mv(tmp)
                fs.pread_into(span.fd, view, pos, span.path)
                end = pos + n
                while i < len(parts):
                    entry, index, a = parts[i]
                    lo = max(pos, entry.offset + a)
                    hi = min(end, entry.offset + entry.size)
                    if hi > lo:
                        if entry.verify:
                            entry.crcs[index] = crc.extend(entry.crcs[index], view[lo - pos:hi - pos])
                        entry.dest[lo - entry.offset:hi - entry.offset] = tmp[lo - pos:hi - pos]
                    if entry.offset + entry.size > end:
                        break  # this entry goes on in the next piece
                    i += 1
                pos = end
        except BaseException as exc:  # a failed request fails every entry of the span
            for entry, _, _ in span.parts:
                entry.error = entry.error or exc
