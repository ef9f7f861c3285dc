"""Whole-entry reads on several threads, and sessions whose reads complete (and are checked) at their end.

An :class:`EntryJob` reads one entry whole in units of a store's preferred request size
(``read_step``): the calling thread and the helpers of a
:class:`~shardckpt.format.crc.ChecksumContext` take units in turn, each checksummed as
it lands; the units' CRC32Cs are combined in order and compared with the stored one.
(Local files go through a :class:`~shardckpt.format.whole_reads.ReadPump` instead.)

A :class:`ReadSession` groups reads through one
:class:`~shardckpt.format.bundle_reader.BundleReader` whose completion and checks are
deferred to the end of the session: its whole-entry reads are queued on the session's
pump, whose helpers read them in file order while the caller plans the next ones; each
session owns its own pending checks, so two threads reading through one reader each see
their own failures. Values read through a session must not be trusted before
:meth:`ReadSession.finish`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union

import numpy as np

from ..errors import DataLossError
from . import crc
from .bundle_index import KeyLike, key_bytes
from .bundle_pieces import StoredPiece
from .tensor_slice import Box, TensorSlice
from .whole_reads import EntryRead, ReadPump, unit_bounds

if TYPE_CHECKING:
    from .bundle_reader import BundleReader

__all__ = ["ReadSession", "EntryJob"]

_BATCH_ENTRIES = 16  # a session's planner hands whole-entry reads to the pump in batches of this many ...
_BATCH_BYTES = 16 << 20  # ... or of this many bytes, whichever comes first


class EntryJob:
    """One whole-entry read: its units are read, and checksummed as they land, by whichever threads take them.

    The calling thread and up to ``workers`` helpers take units in turn; the units'
    CRCs are combined in order (:func:`crc.combine`) and compared with the stored
    checksum in :meth:`finish`, which also re-raises a failed read.
    """

    def __init__(self, reader: "BundleReader", piece: StoredPiece, fd: Any, path: str, flat: memoryview,
                 verify: bool) -> None:
        self.reader = reader
        self.piece = piece
        self.fd = fd
        self.path = path
        self.flat = flat
        self.verify = verify
        size = int(piece.entry.size)
        self.bounds = unit_bounds(size, reader._unit, reader._min_unit, reader._context.workers)
        self.crcs = [0] * len(self.bounds)
        self.error: Optional[BaseException] = None
        self._next = 0
        self._claimed = 0
        self._finished = 0
        self._lock = threading.Lock()
        self._done = threading.Event()

    def _take(self) -> int:
        with self._lock:
            if self._next >= len(self.bounds) or self.error is not None:
                if self._finished == self._claimed:
                    self._done.set()
                return -1
            i = self._next
            self._next += 1
            self._claimed += 1
            return i

    def _read_unit(self, i: int) -> None:
        a, b = self.bounds[i]
        fs = self.reader._fs
        sub = self.reader._sub
        base = int(self.piece.entry.offset)
        value = 0
        for s in range(a, b, sub):
            view = self.flat[s:min(b, s + sub)]
            fs.pread_into(self.fd, view, base + s, self.path)
            if self.verify:
                value = crc.extend(value, view)
        self.crcs[i] = value

    def work(self) -> None:
        """Take and read units until none is left."""
        while True:
            i = self._take()
            if i < 0:
                return
            try:
                self._read_unit(i)
            except BaseException as exc:
                with self._lock:
                    self.error = self.error or exc
            with self._lock:
                self._finished += 1
                if self._finished == self._claimed and (self._next >= len(self.bounds) or self.error is not None):
                    self._done.set()

    def _helpers(self, executor: ThreadPoolExecutor, count: int) -> int:
        for n in range(count):
            try:
                executor.submit(self.work)
            except RuntimeError:  # interpreter shutting down: the caller reads alone
                return n
        return count

    def run(self, executor: Optional[ThreadPoolExecutor]) -> None:
        """Read the units on this thread, helped by the pool (if any) for entries of several units."""
        if len(self.bounds) > 1 and executor is not None:
            self._helpers(executor, min(len(self.bounds) - 1, self.reader._context.workers))
        self.work()

    def finish(self) -> None:
        """Wait for every unit; raise a failed read, a checksum mismatch, or a file replaced meanwhile."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        if not self.verify:
            self.reader._check_unchanged(self.piece.entry.shard_id)
            return
        total = self.crcs[0]
        for (a, b), value in zip(self.bounds[1:], self.crcs[1:]):
            total = crc.combine(total, value, b - a)
        expected = crc.unmask(self.piece.entry.crc32c)
        if total != expected:
            self.reader._check_unchanged(self.piece.entry.shard_id)  # a replaced file says so
            raise DataLossError(f"checksum does not match: stored 0x{expected:08x}, computed 0x{total:08x}",
                                path=self.path, **self.piece.where())


class ReadSession:
    """Reads through one :class:`BundleReader` whose completion and checks may wait for the session's end.

    With ``defer`` (the default) a whole-entry read returns once it is queued on the
    session's pump (helpers read it, in file order, while the caller goes on);
    :meth:`finish` (or leaving the ``with`` block) reads what is left on the calling
    thread too, waits for all of it and raises the first failure — a read error, a checksum
    mismatch (:class:`DataLossError`), a replaced file. Values read through the
    session must not be trusted before that. The session is safe to use from
    several threads; its failures are its own (another session, or a plain read,
    on the same reader never sees them).
    """

    def __init__(self, reader: "BundleReader", *, defer: bool = True) -> None:
        self.reader = reader
        self.defer = defer
        self._jobs: List[EntryJob] = []
        self._reads: List[EntryRead] = []
        self._pump: Optional[ReadPump] = None
        self._lock = threading.Lock()

    def read(self, key: KeyLike, *, verify: bool = True) -> np.ndarray:
        return self.reader.read_region(key, None, verify=verify, session=self)

    def read_region(self, key: KeyLike, region: Optional[Union[Box, TensorSlice, str]] = None,
                    out: Optional[np.ndarray] = None, *, verify: bool = True) -> np.ndarray:
        return self.reader.read_region(key, region, out, verify=verify, session=self)

    def read_many(self, keys: Sequence[KeyLike], outs: Optional[Sequence[Optional[np.ndarray]]] = None, *,
                  verify: bool = True) -> List[np.ndarray]:
        """The whole tensors ``keys``, into ``outs`` (each allocated when ``None``), in order.

        The same as :meth:`read` of each key, planned in one pass: whole entries are handed
        to the pump in batches (helpers start on the first batch while the next is
        planned); keys that need the general path (sliced tensors, strings, ...) are read
        through it in between, in order.
        """
        reader = self.reader
        fast = self.defer and verify
        results: List[np.ndarray] = []
        batch: List[EntryRead] = []
        nbytes = 0
        for i, key in enumerate(keys):
            out = outs[i] if outs is not None else None
            kb = key_bytes(key)
            queued = reader._whole_read(kb, out) if fast else None
            if queued is None:
                if batch:
                    self._queue_many(batch)
                    batch, nbytes = [], 0
                results.append(reader.read_region(kb, None, out, verify=verify, session=self))
                continue
            results.append(queued[0])
            batch.append(queued[1])
            nbytes += queued[1].size
            if len(batch) >= _BATCH_ENTRIES or nbytes >= _BATCH_BYTES:
                self._queue_many(batch)
                batch, nbytes = [], 0
        if batch:
            self._queue_many(batch)
        return results

    def _add(self, job: EntryJob) -> None:
        with self._lock:
            self._jobs.append(job)

    def _queue(self, read: EntryRead) -> None:
        """Hand a whole-entry read to the session's pump (its helpers start on it at once)."""
        self._queue_many((read,))

    def _queue_many(self, reads: Sequence[EntryRead]) -> None:
        """Hand whole-entry reads to the session's pump, in order, in one batch."""
        with self._lock:
            pump = self._pump
            if pump is None:
                pump = self._pump = self.reader._pump()
            self._reads.extend(reads)
        pump.add_many(reads)

    def finish(self) -> None:
        """Wait for every pending read of the session and check it; raise the first failure."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
            reads, self._reads = self._reads, []
            pump = self._pump
        first: Optional[BaseException] = None
        if pump is not None:
            try:
                pump.drain()  # this thread reads too, until every queued span is read
            except BaseException as exc:
                first = exc
        for job in jobs:
            try:
                job.finish()
            except BaseException as exc:
                first = first or exc
        for read in reads:
            try:
                self.reader._check_entry(read)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> "ReadSession":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finish()
            return
        try:  # the block's own error wins; still wait so that no helper writes into arrays afterwards
            self.finish()
        except BaseException:
            pass
