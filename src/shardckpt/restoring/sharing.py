"""Shared pieces: a stored piece that several reads of one batch cut across is read once, whole.

A resharded restore asks for regions that cut stored pieces across: a (4096, 1024) tensor
stored as four (1024, 1024) row blocks and read as four (4096, 256) column regions has each
block cut by the four regions into 1 KiB row runs. Read region by region, each block is
read (or covered by row reads) four times, and no checksum covers any of it.
:func:`share` plans one batch of reads (a deferring plan's region reads, or one group of a
streaming plan) from the source's metadata (:meth:`~.source.PieceSource.piece_boxes`): where
the reads' parts of a stored piece together cover it and at least one part is strided in the
file (not one contiguous range, which a region read moves straight into place), the piece
is read once with a whole-piece read (``Read(key, piece box)``: the source reads it
contiguously and checks its CRC32C) into a buffer (or straight into a destination whose part
is the whole piece, when that part is contiguous in memory), and each part is copied out of
it into its destination. The reads' other parts are read as before, each into its place in
the read's destination (a view). The engine's calls, in order:

    share(source, reads)   a :class:`Sharing`, from metadata only; ``.extra``: the bytes of
                           its piece buffers (a streaming plan's budget counts them)
    .reads()               what the jobs will read (announced: shared pieces whole)
    .batch()               when the batch is admitted: the shared reads' destinations
                           (allocated here, 64-byte aligned, where a read has none) and the
                           jobs: a PieceCut (one whole-piece read and its copies), a Read
                           (a part of a read, or a read left as it was) or a PartRead (a
                           part of a read with a follow-up) each; any order is correct (the
                           jobs write disjoint parts, or equal bytes)
    Batch.values(r)        every read's destination, in order, given the jobs' results

Piece buffers come from the run's :class:`Scratch` (reused: at most one per job running).

A read with a follow-up (``then``) that shares a piece has it run on the thread of the last
job that writes its destination (its parts then are never deferred). Only reads of a numeric
dtype, whose region fits the tensor and whose destination (when given) has the region's
shape and the stored dtype take part; any other read is left as it is, so the source reports
its problems as it always did. A read takes part only when the stored pieces tile its
region. Pieces larger than :data:`MAX_SHARED_PIECE` (or than the plan's budget) are not
shared: their buffer would cost more memory than the saved reads are worth.

Nothing here touches storage.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ..errors import ShardckptError
from ..format.buffers import aligned_empty
from ..format.bundle_index import key_bytes
from ..format.bundle_pieces import region_box
from ..format.tensor_slice import Box, box_shape, box_volume, boxes_tile, full_box, intersect
from .plan import Read

__all__ = ["PieceCut", "PartRead", "Scratch", "Batch", "Sharing", "share", "unshared", "MAX_SHARED_PIECE"]

MAX_SHARED_PIECE = 64 << 20  # bytes: larger pieces are read by parts, as their reads ask

PieceId = Tuple[bytes, Box]  # the tensor's key and the piece's box in it


@dataclass(frozen=True)
class PieceCut:
    """One stored piece read whole (``read``: checksum-verified by the source) and copied into each
    destination: ``cuts`` are ``(index into the piece, destination)`` pairs (a destination that is
    ``read.out`` itself already holds its part). ``nbytes``: the piece buffer's bytes, 0 when the
    piece is read straight into a destination (else the buffer, of ``shape`` and ``dtype``, comes
    from the run's :class:`Scratch`)."""

    read: Read
    cuts: Tuple[Tuple[Tuple[slice, ...], np.ndarray], ...]
    shape: Tuple[int, ...]
    dtype: np.dtype
    nbytes: int = 0
    after: Tuple["_FollowUp", ...] = ()

    def run(self, source: Any, verify: bool, scratch: "Scratch") -> None:
        """Read the piece (complete and checked on return), cut it into every destination, and follow
        up the reads it completed."""
        read, raw = self.read, None
        if read.out is None:
            raw = scratch.take(self.nbytes)
            read = replace(read, out=raw[:self.nbytes].view(self.dtype).reshape(self.shape))
        try:
            buf = source.read(read, None, verify=verify)
            for index, dest in self.cuts:
                if dest is not read.out:
                    dest[...] = buf[index]
        finally:
            if raw is not None:
                scratch.give(raw)
        for follow_up in self.after:
            follow_up.tick()


@dataclass(frozen=True)
class PartRead:
    """A part of a read with a follow-up: read and checked now (never deferred), then its read is
    followed up if this was its last part."""

    read: Read
    after: Tuple["_FollowUp", ...]

    def run(self, source: Any, verify: bool, scratch: "Scratch") -> None:
        source.read(self.read, None, verify=verify)
        for follow_up in self.after:
            follow_up.tick()


class _FollowUp:
    """A shared read's ``then``, run on the thread of the last job that writes its destination."""

    def __init__(self, then: Any, dest: np.ndarray, jobs: int) -> None:
        self._then, self._dest, self._left = then, dest, jobs
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._then(self._dest)


class Scratch:
    """Piece buffers reused by the jobs of one run (a freshly allocated buffer costs a page fault a
    page, about as much as reading the piece). A buffer too small for a piece is dropped when a
    larger one is made, so the run holds at most one buffer per job running at once (at most
    ``keep`` free); all are dropped with the run."""

    def __init__(self, keep: int) -> None:
        self._keep = max(1, keep)
        self._free: List[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A 64-byte aligned byte buffer of at least ``nbytes``."""
        with self._lock:
            free = self._free
            fits = [k for k, b in enumerate(free) if b.nbytes >= nbytes]
            if fits:
                return free.pop(min(fits, key=lambda k: free[k].nbytes))
            if free:  # replaced by the larger one made now
                free.pop(min(range(len(free)), key=lambda k: free[k].nbytes))
        return aligned_empty((nbytes,), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """``buf`` is free again."""
        with self._lock:
            free = self._free
            free.append(buf)
            if len(free) > self._keep:
                free.pop(min(range(len(free)), key=lambda k: free[k].nbytes))


Job = Union[Read, PieceCut, PartRead]


@dataclass(frozen=True)
class Batch:
    """The jobs that serve a batch of reads (see the module docstring)."""

    jobs: Tuple[Job, ...]
    slots: Tuple[Union[int, np.ndarray], ...]  # per read: the index of its job, or its destination
    extra: int = 0

    def values(self, results: Sequence[Any]) -> List[np.ndarray]:
        """Every read's destination, in order, given each job's result (a Read's value)."""
        return [results[s] if isinstance(s, int) else s for s in self.slots]


def unshared(reads: Sequence[Read]) -> Batch:
    """The batch that reads each read as it is."""
    return Batch(tuple(reads), tuple(range(len(reads))))


@dataclass
class _Part:
    pid: PieceId
    common: Box  # the part, in the tensor's coordinates
    read: Read  # the read it belongs to


@dataclass
class _Split:
    box: Box  # the read's region, in the tensor's coordinates
    dtype: np.dtype
    parts: List[_Part]


@dataclass
class _Piece:
    nbytes: int
    dtype: np.dtype
    parts: List[_Part] = field(default_factory=list)


class _Meta:
    """The source's metadata, asked once per key while one batch is planned."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self._seen: Dict[bytes, Tuple[Tuple[int, ...], Any, List[Box]]] = {}
        self._sets: Dict[bytes, Set[Box]] = {}

    def of(self, key: Any) -> Tuple[Tuple[int, ...], Any, List[Box]]:
        kb = key_bytes(key)
        got = self._seen.get(kb)
        if got is None:
            source = self.source
            got = self._seen[kb] = (tuple(source.shape(key)), source.dtype(key), [])
        return got

    def boxes(self, key: Any) -> List[Box]:
        shape, dt, boxes = self.of(key)
        if not boxes:
            boxes.extend(tuple(tuple(pair) for pair in box) for box in self.source.piece_boxes(key))
        return boxes

    def is_piece(self, key: Any, box: Box) -> bool:
        """Whether ``box`` is the box of one of the stored pieces of ``key``."""
        kb = key_bytes(key)
        found = self._sets.get(kb)
        if found is None:
            found = self._sets[kb] = set(self.boxes(key))
        return box in found


def _split(meta: _Meta, read: Read) -> Optional[_Split]:
    """``read`` as its parts, one per stored piece it overlaps, or ``None`` when it does not take part."""
    if read.region is None and read.piece is None:
        return None
    stored = read.piece
    key = read.key if stored is None else stored.tensor_key
    shape, dt, _ = meta.of(key)
    if not dt.is_numeric:
        return None
    if stored is None:
        box = region_box(read.region, shape, meta.source.prefix, key)
        if meta.is_piece(key, box):  # a stored piece itself (a restore onto the saved layout): one part
            commons = [(box, box)]
        else:
            overlaps = [(pbox, intersect(pbox, box)) for pbox in meta.boxes(key)]
            commons = [(pbox, c) for pbox, c in overlaps if c is not None]
            if box_volume(box) == 0 or boxes_tile([c for _, c in commons], box) is not None:
                return None  # the read reports what is missing
    else:
        pshape = box_shape(stored.box)
        local = read.region if read.region is not None else full_box(pshape)
        local = tuple((int(a), int(b)) for a, b in local)
        if len(local) != len(pshape) or any(not 0 <= a < b <= d for (a, b), d in zip(local, pshape)):
            return None
        box = tuple((p0 + a, p0 + b) for (a, b), (p0, _) in zip(local, stored.box))
        commons = [(tuple(stored.box), box)]
    dtype = np.dtype(dt.numpy)
    out = read.out
    if out is not None and (tuple(out.shape) != box_shape(box) or out.dtype != dtype):
        return None  # the read reports the wrong destination
    kb = key_bytes(key)
    return _Split(box, dtype, [_Part((kb, pbox), common, read) for pbox, common in commons])


class Sharing:
    """Which stored pieces one batch of reads shares, from metadata only (nothing is allocated until
    :meth:`batch`). ``extra``: the bytes of the shared pieces' buffers (at most: a piece read straight
    into a destination needs none)."""

    def __init__(self, reads: Sequence[Read], splits: Sequence[Optional[_Split]], pieces: Dict[PieceId, _Piece],
                 chosen: Set[PieceId]) -> None:
        self._reads = tuple(reads)
        self._splits = tuple(splits)
        self._pieces = pieces
        self._chosen = chosen
        self.extra = sum(pieces[pid].nbytes for pid in chosen)

    def _whole(self, pid: PieceId, into: Optional[np.ndarray]) -> Read:
        """The read of piece ``pid`` whole (through the stored piece a read named, when one did)."""
        parts = self._pieces[pid].parts
        named = next((part.read.piece for part in parts if part.read.piece is not None), None)
        if named is not None:
            return Read(parts[0].read.key, full_box(box_shape(pid[1])), into, named)
        return Read(parts[0].read.key, pid[1], into)

    def reads(self) -> List[Read]:
        """What the batch's jobs will read (to announce): each shared piece whole, the reads' other
        parts, the reads that share nothing (destinations not set: nothing is allocated)."""
        if not self._chosen:
            return list(self._reads)
        out: List[Read] = []
        for read, split in zip(self._reads, self._splits):
            if split is None or not any(part.pid in self._chosen for part in split.parts):
                out.append(read)
                continue
            out.extend(_part_read(read, part, None) for part in split.parts if part.pid not in self._chosen)
        out.extend(self._whole(pid, None) for pid in self._pieces if pid in self._chosen)
        return out

    def batch(self) -> Batch:
        """The jobs, with the shared reads' destinations (allocated now, 64-byte aligned, where a read
        has none)."""
        if not self._chosen:
            return unshared(self._reads)
        chosen = self._chosen
        jobs: List[Job] = []
        slots: List[Union[int, np.ndarray]] = []
        cuts: Dict[PieceId, List[Tuple[Tuple[slice, ...], np.ndarray]]] = {}
        after: Dict[PieceId, List[_FollowUp]] = {}
        for read, split in zip(self._reads, self._splits):
            if split is None or not any(part.pid in chosen for part in split.parts):
                slots.append(len(jobs))
                jobs.append(read)
                continue
            dest = read.out if read.out is not None else aligned_empty(box_shape(split.box), split.dtype)
            slots.append(dest)
            follow_up = _FollowUp(read.then, dest, len(split.parts)) if read.then is not None else None
            for part in split.parts:
                view = dest[_index(part.common, split.box)]
                if part.pid in chosen:
                    cuts.setdefault(part.pid, []).append((_index(part.common, part.pid[1]), view))
                    if follow_up is not None:
                        after.setdefault(part.pid, []).append(follow_up)
                elif follow_up is not None:
                    jobs.append(PartRead(_part_read(read, part, view), (follow_up,)))
                else:
                    jobs.append(_part_read(read, part, view))
        extra = 0
        for pid, piece_cuts in cuts.items():
            pbox = pid[1]
            into = next((d for index, d in piece_cuts if _is_whole(index, pbox) and d.flags.c_contiguous), None)
            piece = self._pieces[pid]
            job = PieceCut(self._whole(pid, into), tuple(piece_cuts), box_shape(pbox), piece.dtype,
                           0 if into is not None else piece.nbytes, tuple(after.get(pid, ())))
            extra += job.nbytes
            jobs.append(job)
        return Batch(tuple(jobs), tuple(slots), extra)


def _part_read(read: Read, part: _Part, out: Optional[np.ndarray]) -> Read:
    """The part of ``read`` that one stored piece holds, into ``out`` (without the read's follow-up)."""
    if read.piece is not None:  # the read names its piece: the part relative to it
        return Read(read.key, _relative(part.common, read.piece.box), out, read.piece)
    return Read(read.key, part.common, out)


def share(source: Any, reads: Sequence[Read], *, limit: Optional[int] = None) -> Sharing:
    """Plan ``reads`` so that every stored piece their parts cover, and cut across, is read once
    (pieces over ``limit`` bytes, or :data:`MAX_SHARED_PIECE`, are not)."""
    limit = MAX_SHARED_PIECE if limit is None else min(limit, MAX_SHARED_PIECE)
    tensors: Dict[bytes, int] = {}  # reads per tensor: a piece is shared by reads of one tensor
    for read in reads:
        if read.region is not None or read.piece is not None:
            kb = _tensor_key(read)
            tensors[kb] = tensors.get(kb, 0) + 1
    if not any(n > 1 for n in tensors.values()):
        return Sharing(reads, [None] * len(reads), {}, set())
    meta = _Meta(source)
    splits: List[Optional[_Split]] = []
    pieces: Dict[PieceId, _Piece] = {}
    for read in reads:
        try:
            split = _split(meta, read) if tensors.get(_tensor_key(read), 0) > 1 else None
        except ShardckptError:  # left to the read itself to report
            split = None
        splits.append(split)
        if split is None:
            continue
        for part in split.parts:
            piece = pieces.get(part.pid)
            if piece is None:
                piece = pieces[part.pid] = _Piece(box_volume(part.pid[1]) * split.dtype.itemsize, split.dtype)
            piece.parts.append(part)
    chosen = {pid for pid, piece in pieces.items() if piece.nbytes <= limit and _worth_sharing(pid[1], piece.parts)}
    return Sharing(reads, splits, pieces, chosen)


def _tensor_key(read: Read) -> bytes:
    return key_bytes(read.key if read.piece is None else read.piece.tensor_key)


def _worth_sharing(pbox: Box, parts: List[_Part]) -> bool:
    """Whether reading the piece once beats reading its parts: they cover it, and one of them is strided
    in the file (a part of whole trailing dimensions is one contiguous range, read straight into place)."""
    pshape = box_shape(pbox)
    strided = any(any(c != p for c, p in zip(part.common[1:], pbox[1:])) for part in parts)
    return strided and len(pshape) > 1 and _covers([part.common for part in parts], pbox)


def _covers(boxes: List[Box], region: Box) -> bool:
    """Whether the union of ``boxes`` (all inside ``region``, overlaps allowed) is ``region``."""
    distinct = list(set(boxes))
    volume = sum(box_volume(b) for b in distinct)
    if volume < box_volume(region):
        return False
    if volume == box_volume(region) and len(distinct) <= 16 and not any(
            intersect(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:]):
        return True  # disjoint boxes of the region's volume: they tile it
    edges = [sorted({lo, hi} | {b[d][0] for b in boxes} | {b[d][1] for b in boxes})
             for d, (lo, hi) in enumerate(region)]
    cells = 1
    for e in edges:
        cells *= len(e) - 1
    if cells > 4 * len(boxes) + 65536:  # a grid too large to paint: not shared
        return False
    painted = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for box in boxes:
        at = tuple(slice(bisect.bisect_left(e, a), bisect.bisect_left(e, b)) for e, (a, b) in zip(edges, box))
        painted[at] = True
    return bool(painted.all())


def _index(common: Box, within: Box) -> Tuple[slice, ...]:
    """``common`` as an index into an array holding the box ``within``."""
    return tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(common, within))


def _relative(common: Box, pbox: Box) -> Box:
    return tuple((a - p0, b - p0) for (a, b), (p0, _) in zip(common, pbox))


def _is_whole(index: Tuple[slice, ...], pbox: Box) -> bool:
    return all(s.start == 0 and s.stop == b - a for s, (a, b) in zip(index, pbox))
