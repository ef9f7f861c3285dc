"""Whole-entry reads on several threads, and sessions whose reads complete (and are checked) at their end.

:class:`WholeEntries` reads entries whole: local files through a
:class:`~shardckpt.format.whole_reads.ReadPump` (large entries split into units, small
neighbours gathered into one request, the spans read and checksummed on several threads,
each piece while it is still in the CPU cache), and plans the restore's fast path (one
checked :class:`~shardckpt.format.whole_reads.EntryRead` per tensor, ready to queue).
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

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import DataLossError
from ..storage.base import FileSystem
from . import crc
from .buffers import aligned_empty
from .bundle_files import DataFiles
from .bundle_index import MAX_RANK, BundleIndex, KeyLike, key_bytes
from .bundle_pieces import StoredPiece
from .bundle_writer import byte_view
from .dtypes import from_enum
from .tensor_slice import Box, TensorSlice
from .whole_reads import EntryRead, ReadPump, read_range, unit_bounds

if TYPE_CHECKING:
    from .bundle_reader import BundleReader

__all__ = ["ReadSession", "EntryJob", "WholeEntries"]

_UNIT = 4 << 20  # whole entries are read and checksummed in units of this size, on several threads
_MIN_UNIT = 512 << 10  # entries are split across threads only into units at least this large
_SUB = 2 << 20  # within a unit, read this much and checksum it while it is still in the CPU cache (L3)

_BATCH_ENTRIES = 16  # a session's planner hands whole-entry reads to the pump in batches of this many ...
_BATCH_BYTES = 16 << 20  # ... or of this many bytes, whichever comes first


class EntryJob:
    """One whole-entry read: its units are read, and checksummed as they land, by whichever threads take them.

    The calling thread and up to ``workers`` helpers take units in turn; the units'
    CRCs are combined in order (:func:`crc.combine`) and compared with the stored
    checksum in :meth:`finish`, which also re-raises a failed read.
    """

    def __init__(self, owner: "WholeEntries", piece: StoredPiece, fd: Any, path: str, flat: memoryview,
                 verify: bool) -> None:
        self.owner = owner
        self.piece = piece
        self.fd = fd
        self.path = path
        self.flat = flat
        self.verify = verify
        size = int(piece.entry.size)
        self.bounds = unit_bounds(size, owner.unit, owner.min_unit, owner.context.workers)
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
        fs = self.owner.fs
        sub = self.owner.sub
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
            self._helpers(executor, min(len(self.bounds) - 1, self.owner.context.workers))
        self.work()

    def finish(self) -> None:
        """Wait for every unit; raise a failed read, a checksum mismatch, or a file replaced meanwhile."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        if not self.verify:
            self.owner.check_unchanged(self.piece.entry.shard_id)
            return
        total = self.crcs[0]
        for (a, b), value in zip(self.bounds[1:], self.crcs[1:]):
            total = crc.combine(total, value, b - a)
        expected = crc.unmask(self.piece.entry.crc32c)
        if total != expected:
            self.owner.check_unchanged(self.piece.entry.shard_id)  # a replaced file says so
            raise DataLossError(f"checksum does not match: stored 0x{expected:08x}, computed 0x{total:08x}",
                                path=self.path, **self.piece.where())


class WholeEntries:
    """Whole-entry reads of one bundle: planned for a pump, read on several threads, checked.

    ``index`` and ``files`` are the bundle's :class:`~shardckpt.format.bundle_index.BundleIndex`
    and :class:`~shardckpt.format.bundle_files.DataFiles`; ``context`` owns the helper
    threads. Local files go through a :class:`~shardckpt.format.whole_reads.ReadPump`
    (large entries split into units, small neighbours gathered); stores with a preferred
    request size (``read_step``) read entries in units of that size (:class:`EntryJob`).
    """

    def __init__(self, fs: FileSystem, context: crc.ChecksumContext, index: BundleIndex, files: DataFiles) -> None:
        self.fs = fs
        self.context = context
        self.unit = fs.read_step or _UNIT  # a store's preferred request size, when it has one
        self.min_unit = fs.read_step or _MIN_UNIT
        self.sub = fs.read_step or _SUB
        self.big_endian = index.big_endian
        self._index = index
        self._files = files
        self.check_unchanged = files.check_unchanged
        # plan() reads these directly: the same objects as the index's and the files'
        self._entries = index.entries
        self._shapes = index.shapes
        self._fds = files.fds
        self._file_sizes = files.sizes
        self._paths = files.paths

    def plan(self, kb: bytes, out: Optional[np.ndarray]) -> Optional[Tuple[np.ndarray, EntryRead]]:
        """A checksummed whole-tensor read of ``kb`` into ``out`` (allocated when ``None``), ready to queue on
        a pump; ``None`` when the key needs the general path (sliced, strings, byte-swapped, zero-sized
        dimensions, a store with its own request size, a destination that is not a C-contiguous
        array of the stored shape and dtype, or any check failing: the general path raises then).

        The restore planner's fast path, run once per tensor: the same checks as
        :meth:`~shardckpt.format.bundle_reader.BundleReader.read_region` (entry inside its file,
        byte count equal to shape times item size, shape an array can have), each done once,
        with no intermediate objects.
        """
        entry = self._entries.get(kb)
        if entry is None:
            entry = self._index.entry(kb)
        if entry.slices or self.fs.read_step is not None:
            return None
        dt = from_enum(entry.dtype)
        itemsize = dt.itemsize
        if itemsize is None or (dt.swap_unit and self.big_endian):
            return None
        shape = self._shapes[kb]
        count = math.prod(shape)
        size = entry.size
        if size != count * itemsize or len(shape) > MAX_RANK or (count == 0 and shape):
            return None  # (a zero dimension: the general path checks the other dimensions' product)
        shard = entry.shard_id
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._files.open(shard)[0]
        offset = entry.offset
        if offset + size > self._file_sizes[shard]:
            return None
        if out is None:
            out = aligned_empty(shape, dt.numpy)
        elif out.shape != shape or out.dtype != dt.numpy or not out.flags.c_contiguous:
            return None
        path = self._paths.get(shard) or self._files.path(shard)
        flat = out.reshape(-1).view(np.uint8)
        return out, EntryRead(fd, path, offset, flat, True, crc.unmask(entry.crc32c), kb, shard)

    def read(self, piece: StoredPiece, fd: Any, path: str, dest: np.ndarray, verify: bool,
             session: Optional["ReadSession"]) -> None:
        """Read one entry whole into ``dest``: queued on the session's pump (or a pump of its own), read
        in units on several threads, each piece checksummed as it lands (see :mod:`.whole_reads`)."""
        if self.fs.read_step is not None:  # stores with their own request size: units of that size
            self._read_units(piece, fd, path, dest, verify, session)
            return
        flat = dest.reshape(-1).view(np.uint8)
        entry = piece.entry
        offset = int(entry.offset)
        if session is None and len(flat) < 2 * self.min_unit:  # one unit: no pump, no helpers
            computed = read_range(self.fs, fd, path, offset, flat, self.sub, verify)
            self.check_read(piece, path, verify, computed)
            return
        read = EntryRead(fd, path, offset, flat, verify, crc.unmask(entry.crc32c), piece, int(entry.shard_id))
        if session is not None:  # read by the session's helpers; checked when the session finishes
            session._queue(read)
            return
        pump = self.pump()
        pump.add(read)
        pump.drain()
        self.check_entry(read)

    def pump(self) -> ReadPump:
        """A new pump over the context's helpers."""
        return ReadPump(self.fs, lambda: self.context.executor, self.context.workers, unit=self.unit,
                        min_unit=self.min_unit, sub=self.sub)

    def check_read(self, piece: StoredPiece, path: str, verify: bool, computed: int) -> None:
        """Raise what went wrong with a read done whole on this thread (``computed``: its CRC32C)."""
        if not verify:
            self.check_unchanged(piece.entry.shard_id)
            return
        expected = crc.unmask(piece.entry.crc32c)
        if computed != expected:
            self.check_unchanged(piece.entry.shard_id)  # a replaced file says so
            raise DataLossError(f"checksum does not match: stored 0x{expected:08x}, computed "
                                f"0x{computed:08x}", path=path, **piece.where())

    def check_entry(self, read: EntryRead) -> None:
        """Raise what went wrong with a queued whole-entry read: a failed read, a replaced file, a checksum."""
        if read.error is not None:
            raise read.error
        if not read.verify:
            self.check_unchanged(read.shard)
            return
        problem = read.mismatch()
        if problem is not None:
            self.check_unchanged(read.shard)  # a replaced file says so
            where = read.tag.where() if isinstance(read.tag, StoredPiece) else {"key": read.tag}
            raise DataLossError(problem, path=read.path, **where)

    def _read_units(self, piece: StoredPiece, fd: Any, path: str, dest: np.ndarray, verify: bool,
                    session: Optional["ReadSession"]) -> None:
        """Read one entry whole in units of the store's request size, on several threads."""
        size = int(piece.entry.size)
        if session is None and size <= self.sub:  # one small read: no job, no helpers
            flat = byte_view(dest)
            self.fs.pread_into(fd, flat, int(piece.entry.offset), path)
            self.check_read(piece, path, verify, crc.value(flat) if verify else 0)
            return
        job = EntryJob(self, piece, fd, path, byte_view(dest), verify)
        job.run(self.context.executor if self.context.workers else None)  # this thread reads units too
        if session is not None:  # units still in flight on helpers are waited for by the session
            session._add(job)
            return
        job.finish()


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
