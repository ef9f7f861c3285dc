"""Read a tensor bundle: look entries up in ``<prefix>.index``, read values from the data files.

A small index is read and checked whole when the reader opens; a large one is not read:
its SSTable's footer and index block are, and each lookup reads (and checks) the one
data block that may hold its key (see :class:`~shardckpt.format.sstable.TableReader`).

:class:`BundleReader` reads whole tensors (assembling sliced ones) and arbitrary
regions of them. A region read issues positional reads of just the byte ranges
that hold the region, straight into the destination array, as one batch of runs for
the filesystem's ``pread_batch`` (which coalesces ranges smaller than a page, and may
hand many runs to the kernel at once); a strided destination (columns of a tensor)
gets the runs cut where either the file or the destination has a gap, each read
straight into its place (no temporary). Whole-entry reads go through a :class:`~shardckpt.format.whole_reads.ReadPump`:
large entries are split into units, small neighbours gathered into one request, and the
spans read and checksummed on several threads at once (the calling thread and the
helpers of a :class:`~shardckpt.format.crc.ChecksumContext`), each piece checksummed
while it is still in the CPU cache; the pieces' CRC32Cs are combined and compared with
the stored one. (Stores with a preferred request size, ``read_step``, read entries in
units of that size instead.)

A :class:`ReadSession` groups reads whose completion and checks are deferred to the
end of the session: its whole-entry reads are queued on the session's pump, whose
helpers read them in file order while the caller plans the next ones; each session
owns its own pending checks, so two threads reading through one reader each see
their own failures.

The reader sees the checkpoint it opened, or raises
:class:`~shardckpt.errors.CheckpointReplacedError`: the identity of the index and
of every data file (inode/size/mtime locally, size and ETag on object stores) is
recorded when the index is opened (an open that finds the index replaced meanwhile
starts again, data file names included: they follow the shard count of the index
that is kept); a data file opened later must still have it (one deleted since then
is a replaced checkpoint too, not a missing file), and reads whose bytes no checksum
covers (region reads, ``verify=False``) check the file's identity again after reading.
A checksum that does not match on a file whose identity is unchanged is damage
(:class:`~shardckpt.errors.DataLossError`).

Every problem with the files is a :mod:`shardckpt.errors` exception naming the
file and the key; sizes are checked against the files before anything is
allocated, so a hostile index cannot make the reader allocate unbounded memory.
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import (
    CheckpointReplacedError,
    CorruptIndexError,
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    ShardckptError,
    UnsupportedError,
)
from ..storage.base import FileSystem, RunBatch, normalize
from ..storage.object_store import ObjectStore
from ..storage.registry import get_fs
from . import crc
from .bundle_writer import byte_view
from .dtypes import DType, from_enum
from .naming import data_filename, index_filename
from .ordered_code import encode_tensor_name_slice, is_slice_key
from .protos import tensor_bundle_pb2 as pb
from .sstable import TableReader, read_table
from .strings import decode_strings, decode_variants
from .tensor_slice import Box, TensorSlice, box_shape, box_volume, boxes_tile, full_box, intersect
from .whole_reads import EntryRead, ReadPump, read_range, unit_bounds

__all__ = ["BundleReader", "ReadSession", "StoredPiece", "MAX_SUPPORTED_VERSION"]

MAX_SUPPORTED_VERSION = 1  # the bundle format's producer/consumer version
_UNIT = 4 << 20  # whole entries are read and checksummed in units of this size, on several threads
_MIN_UNIT = 512 << 10  # entries are split across threads only into units at least this large
_SUB = 2 << 20  # within a unit, read this much and checksum it while it is still in the CPU cache (L3)
_MAX_SHARDS = 1 << 24
_PAGE = 4096
_MIN_SCATTER = 512  # pieces of a file range scattered into a strided destination: at least this many bytes
_MAX_RANK = 64  # NumPy's limit (TensorFlow allows 254; such tensors cannot be arrays here)
_MAX_ELEMENTS = (1 << 63) - 1
_EAGER_IDENTITY = 1024  # data files whose identity is recorded when the index is opened
_OPEN_ATTEMPTS = 3
_EAGER_INDEX_BYTES = 1 << 20  # index files up to this size are read and checked whole when opened
_BATCH_ENTRIES = 16  # a session's planner hands whole-entry reads to the pump in batches of this many ...
_BATCH_BYTES = 16 << 20  # ... or of this many bytes, whichever comes first

KeyLike = Union[str, bytes]


def region_box(region: Any, shape: Tuple[int, ...], prefix: str, key: Union[str, bytes]) -> Box:
    """The box of ``region`` of a tensor of ``shape``: the whole tensor for ``None``, a
    :class:`TensorSlice` or its text form, or ``(start, stop)`` pairs (checked to fit)."""
    if region is None:
        return full_box(shape)
    if isinstance(region, (TensorSlice, str)):
        tslice = TensorSlice.parse(region, rank=len(shape)) if isinstance(region, str) else region
        return tslice.box(shape)
    box = tuple((int(a), int(b)) for a, b in region)
    if len(box) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(box, shape)):
        raise InvalidArgumentError(f"region {list(box)} does not fit shape {list(shape)}", path=prefix, key=key)
    return box


def _box_runs(offset: int, shape: Tuple[int, ...], local: Box, itemsize: int) -> Tuple[np.ndarray, int, bool]:
    """Where the sub-box ``local`` of a row-major block stored at ``offset`` lies: the file offset of
    each run (row-major order, computed in bulk), the bytes of one run, and whether it is one
    contiguous run (then the single offset starts all of the box's bytes)."""
    rank = len(shape)
    strides = [1] * rank
    for d in range(rank - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    j = rank  # dims j.. are taken whole, so each run spans them
    while j > 0 and local[j - 1] == (0, shape[j - 1]):
        j -= 1
    if j <= 1:
        start = offset + (local[0][0] * strides[0] * itemsize if rank else 0)
        total = box_volume(local) * itemsize
        return np.array([start], dtype=np.int64), total, True
    runs_dim = j - 1
    run_bytes = (local[runs_dim][1] - local[runs_dim][0]) * strides[runs_dim] * itemsize
    elem = np.full((), local[runs_dim][0] * strides[runs_dim], dtype=np.int64)
    for d in range(runs_dim):
        elem = np.add.outer(elem, np.arange(local[d][0], local[d][1], dtype=np.int64) * strides[d])
    return offset + elem.reshape(-1) * itemsize, run_bytes, False


def _scatter_runs(offset: int, shape: Tuple[int, ...], local: Box, itemsize: int,
                  dest: np.ndarray) -> Optional[RunBatch]:
    """The reads that move the sub-box ``local`` of a row-major block stored at ``offset`` straight into
    the strided array ``dest``, or ``None`` where a temporary serves better.

    The box's bytes, in row-major order, are cut where the file is not contiguous
    (the runs of :func:`_box_runs`) and where ``dest`` is not (its rows, say): every
    piece is then contiguous in both, and pieces next to each other in both were never
    cut (the cuts fall at the coarser of the two levels). Run ``i`` of the batch goes to
    byte ``dest_offsets[i]`` of a view spanning ``dest``'s memory. ``None``: negative
    strides, or pieces smaller than ``_MIN_SCATTER`` bytes (``_PAGE`` when the pieces are
    not next to each other in the file either).
    """
    rank = len(shape)
    box = box_shape(local)
    strides = dest.strides
    if rank == 0 or tuple(dest.shape) != box or any(st < 0 for st in strides) or box_volume(local) == 0:
        return None
    k, expect = rank, itemsize  # dims k.. of dest are laid out contiguously
    while k > 0 and (box[k - 1] == 1 or strides[k - 1] == expect):
        expect *= box[k - 1]
        k -= 1
    j = rank  # dims j.. are stored whole
    while j > 0 and local[j - 1] == (0, shape[j - 1]):
        j -= 1
    m = max(k, j - 1, 0)  # pieces span dims m..
    piece = itemsize * int(np.prod(box[m:], dtype=np.int64))
    file_contiguous = j <= 1  # the box is one range of the file
    if piece < (_MIN_SCATTER if file_contiguous else _PAGE):
        return None
    file_strides = [itemsize * int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(rank)]
    start = offset + sum(a * fs for (a, _), fs in zip(local, file_strides))
    at = np.zeros((), dtype=np.int64)
    where = np.zeros((), dtype=np.int64)
    for d in range(m):
        at = np.add.outer(at, np.arange(box[d], dtype=np.int64) * file_strides[d])
        where = np.add.outer(where, np.arange(box[d], dtype=np.int64) * strides[d])
    span = sum((n - 1) * st for n, st in zip(box, strides)) + itemsize
    try:
        raw = np.lib.stride_tricks.as_strided(dest.view(np.uint8), shape=(span,), strides=(1,))
    except ValueError:  # a last axis NumPy will not view as bytes
        return None
    return RunBatch(start + at.reshape(-1), piece, memoryview(raw), None,  # type: ignore[arg-type]
                    where.reshape(-1))


def _key_bytes(key: KeyLike) -> bytes:
    if isinstance(key, bytes):
        return key
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"key {key!r} is not valid Unicode text ({exc.reason}); keys are UTF-8") from None


def _key_str(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


class StoredPiece:
    """One stored block of a tensor: the whole tensor, or one slice of it.

    ``key`` is the index key holding the bytes (the encoded slice key for a
    slice), ``tensor_key`` the tensor's own key, ``slice`` the slice (``None`` for
    a whole entry) and ``box`` where the piece lies in the tensor.
    """

    __slots__ = ("box", "key", "entry", "tensor_key", "slice")

    def __init__(self, box: Box, key: bytes, entry: pb.BundleEntryProto, tensor_key: bytes,
                 tensor_slice: Optional[TensorSlice] = None) -> None:
        self.box = box
        self.key = key
        self.entry = entry
        self.tensor_key = tensor_key
        self.slice = tensor_slice

    @property
    def slice_spec(self) -> Optional[str]:
        """The slice in TF's text form (``"0,4:-"``), or ``None`` for a whole entry."""
        return None if self.slice is None else str(self.slice)

    def where(self) -> dict:
        """Keyword arguments naming this piece in an error: ``key`` and ``slice_spec``."""
        return {"key": self.tensor_key, "slice_spec": self.slice_spec}


class BundleReader:
    """Random access to the tensors of the bundle at ``prefix``.

    ``fs`` is the store (default: chosen from the path); ``context`` owns the helper
    threads that read and checksum units of large entries (default:
    :func:`~shardckpt.format.crc.default_context`). ``load_index``: ``True`` reads the
    whole index and checks all of it when opening; ``False`` reads only its footer and
    index block, then the data blocks that lookups need (a 10^6-entry index opens in a few
    milliseconds; :meth:`keys` still reads it whole, once); ``None`` (default) reads it
    whole when the file is at most 1 MiB. Safe to share between threads; each thread's
    :class:`ReadSession` keeps its own pending checks.
    """

    def __init__(self, prefix: str, *, fs: Optional[FileSystem] = None,
                 context: Optional[crc.ChecksumContext] = None, load_index: Optional[bool] = None) -> None:
        prefix = normalize(prefix)
        self.prefix = prefix
        self.index_path = index_filename(prefix)
        fs = fs if fs is not None else get_fs(prefix)
        self._fs = fs
        self._context = context if context is not None else crc.default_context()
        self._identity_of = fs.identity
        #: object stores: reads held to the version an identity names (``If-Match``), see _open_index
        self._pin = fs.pin if isinstance(fs, ObjectStore) else None
        self._unit = fs.read_step or _UNIT  # a store's preferred request size, when it has one
        self._min_unit = fs.read_step or _MIN_UNIT
        self._sub = fs.read_step or _SUB
        self._fds: Dict[int, Any] = {}
        self._file_sizes: Dict[int, int] = {}
        self._paths: Dict[int, str] = {}
        self._identities: Dict[int, Any] = {}  # shard -> identity at open (None: missing then)
        self._lock = threading.Lock()
        self._load_index = load_index
        self._raw: Optional[Dict[bytes, bytes]] = None  # every entry, once read whole
        self._table: Optional[TableReader] = None  # lookups through the index block (index not read whole)
        self._index_fd: Any = None
        self._index_identity: Any = None
        self._index_size = 0
        for _attempt in range(_OPEN_ATTEMPTS):
            if self._open_index():
                break
        else:
            raise CheckpointReplacedError(f"the checkpoint was replaced while it was being opened "
                                          f"({_OPEN_ATTEMPTS} attempts)", path=self.index_path)

    def _identity(self, path: str, handle: Any = None) -> Any:
        assert self._identity_of is not None
        return self._identity_of(path, handle)

    def _open_index(self) -> bool:
        """Read the index and record the identity of it and the data files; False if it changed meanwhile.

        A small index (or ``load_index=True``) is read and checked whole. A large one (or
        ``load_index=False``) stays on storage: its footer and index block are read now,
        data blocks when a lookup needs them (each checked then, see
        :class:`~shardckpt.format.sstable.TableReader`); the whole index is read only
        for :meth:`keys`.
        """
        fs = self._fs
        self._close_index()  # from an earlier attempt
        self._raw, self._table = None, None
        # Object stores that list and pin: one round trip lists the identity of the index and
        # of every data object, and reads the index's first bytes with the identity of the
        # version read. Both name the same index, or the open starts again; later reads are
        # pinned to the identities (a replaced object fails the read), so no HEAD is needed.
        both = fs.list_and_read if isinstance(fs, ObjectStore) else None
        got = both(self.prefix + ".", self.index_path, _EAGER_INDEX_BYTES) if both is not None else None
        listed, head = got if got is not None else (None, None)
        if head is not None:
            before = head[1]
            if listed is not None and listed.get(self.index_path, before) != before:
                return False  # the index changed between the two requests
            if listed is not None and self.index_path not in listed:
                listed = None  # the listing predates the index: data identities are asked for below
        else:
            listed = None
            before = self._identity(self.index_path) if self._identity_of is not None else None
        lazy = self._load_index is False
        if self._load_index is None:
            size = int(before[0]) if before is not None else fs.size(self.index_path)
            lazy = size > _EAGER_INDEX_BYTES
        if lazy:
            try:
                header_bytes = self._open_lazily(before)
            except CheckpointReplacedError:
                self._close_index()
                return False
            if header_bytes is None:
                raise CorruptIndexError("index has no header entry (empty key)", path=self.index_path)
        else:
            if head is not None and len(head[0]) >= int(before[0]):
                data = head[0][:int(before[0])]  # all of it came with the listing
            else:
                try:
                    data = self._read_index_whole(before, pinned=head is not None)
                except CheckpointReplacedError:
                    return False
            raw = dict(read_table(data, self.index_path))
            header_bytes = raw.pop(b"", None)
            if header_bytes is None:
                raise CorruptIndexError("index has no header entry (empty key)", path=self.index_path)
            self._raw = raw
            if before is not None and before[0] != len(data):
                return False
        self.header = self._parse_header(header_bytes)
        self.num_shards = int(self.header.num_shards)
        # data file names follow this index's shard count: an earlier attempt's (another index's, when
        # the prefix was overwritten meanwhile) would pair this index with another checkpoint's files
        self._paths = {}
        self.big_endian = self.header.endianness == pb.BundleHeaderProto.BIG
        self._entries: Dict[bytes, pb.BundleEntryProto] = {}
        self._shapes: Dict[bytes, Tuple[int, ...]] = {}  # of every entry in _entries
        self._pieces: Dict[bytes, List[StoredPiece]] = {}  # sliced tensors' pieces, once checked
        self._starts: Dict[bytes, Dict[Tuple[int, ...], Any]] = {}  # piece_at: box start -> slice (or its piece)
        if self._identity_of is None:
            return True
        self._identities = {}
        if listed is not None:  # the listing that named the index's version names its data objects
            for shard in range(self.num_shards):
                path = self.data_path(shard)
                if path in listed:
                    self._identities[shard] = listed[path]
                elif self.num_shards <= _EAGER_IDENTITY:  # not listed: ask the object before calling it missing
                    try:
                        self._identities[shard] = self._identity(path)
                    except NotFoundError:
                        self._identities[shard] = None
            return True
        if self.num_shards <= _EAGER_IDENTITY:
            paths = [self.data_path(shard) for shard in range(self.num_shards)]
            batch = self._fs.identities
            if batch is not None:  # e.g. one listing on an object store
                found = batch(paths)
                self._identities = {shard: found.get(path) for shard, path in enumerate(paths)}
            else:
                for shard, path in enumerate(paths):
                    try:
                        self._identities[shard] = self._identity(path)
                    except NotFoundError:
                        self._identities[shard] = None
        return self._identity(self.index_path) == before

    def _read_index_whole(self, before: Any, pinned: bool) -> bytes:
        """The whole index file; with ``pinned``, read held to the identity ``before`` (raises
        :class:`CheckpointReplacedError` when the index is another one now)."""
        if not pinned:
            return self._fs.read_bytes(self.index_path)
        fd = self._fs.open_read(self.index_path)
        try:
            if not self._pin_handle(fd, before):
                return self._fs.read_bytes(self.index_path)
            buf = bytearray(int(before[0]))
            self._fs.pread_into(fd, memoryview(buf), 0, self.index_path)
            return bytes(buf)
        finally:
            self._fs.close(fd)

    def _pin_handle(self, fd: Any, identity: Any) -> bool:
        """Hold the reads of ``fd`` to ``identity`` where the store can (then its identity costs no request)."""
        return bool(self._pin is not None and identity is not None and self._pin(fd, identity))

    def _open_lazily(self, before: Any) -> Optional[bytes]:
        """Open the index for lookups through its index block; the header entry's value."""
        self._index_identity = before
        self._index_size = int(before[0]) if before is not None else self._fs.size(self.index_path)
        self._index_handle()
        self._table = TableReader(self._index_read, self._index_size, self.index_path)
        return self._table.get(b"")

    def _index_handle(self) -> Any:
        """The open index file (opened again after :meth:`close`; it must still be the same file)."""
        with self._lock:
            if self._index_fd is None:
                fd = self._fs.open_read(self.index_path)
                if self._identity_of is not None:
                    self._pin_handle(fd, self._index_identity)
                    try:
                        now = self._identity(self.index_path, fd)
                    except BaseException:
                        self._fs.close(fd)
                        raise
                    if now != self._index_identity:
                        self._fs.close(fd)
                        raise self._replaced(self.index_path, "the index differs from the one opened "
                                                              f"(identity {now} != {self._index_identity})")
                self._index_fd = fd
            return self._index_fd

    def _index_read(self, offset: int, size: int) -> bytes:
        """``size`` bytes of the index file at ``offset`` (the file must be the one opened)."""
        fd = self._index_handle()
        buf = bytearray(size)
        self._fs.pread_into(fd, memoryview(buf), offset, self.index_path)
        if self._identity_of is not None:
            now = self._identity(self.index_path, fd)
            if now != self._index_identity:
                raise self._replaced(self.index_path, f"the index changed (identity {now} != "
                                                      f"{self._index_identity})")
        return bytes(buf)

    def _close_index(self) -> None:
        with self._lock:
            if self._index_fd is not None:
                self._fs.close(self._index_fd)
                self._index_fd = None

    def _all_entries(self) -> Dict[bytes, bytes]:
        """Every entry but the header (the whole index is read and checked on first use)."""
        raw = self._raw
        if raw is None:
            raw = dict(read_table(self._index_read(0, self._index_size), self.index_path))
            raw.pop(b"", None)
            self._raw = raw
        return raw

    def _value(self, key: bytes) -> Optional[bytes]:
        """The stored value of ``key`` (``None`` when absent; the header is not an entry)."""
        if self._raw is not None:
            return self._raw.get(key)
        if not key:
            return None
        assert self._table is not None
        return self._table.get(key)

    # -- index -------------------------------------------------------------
    def _parse_header(self, value: bytes) -> pb.BundleHeaderProto:
        header = pb.BundleHeaderProto()
        try:
            header.ParseFromString(value)
        except Exception:
            raise CorruptIndexError("unparsable bundle header", path=self.index_path) from None
        if not 1 <= header.num_shards <= _MAX_SHARDS:
            raise CorruptIndexError(f"bad num_shards {header.num_shards} in header", path=self.index_path)
        if header.endianness not in (pb.BundleHeaderProto.LITTLE, pb.BundleHeaderProto.BIG):
            raise UnsupportedError(f"unknown endianness {header.endianness}", path=self.index_path)
        version = header.version
        if version.producer < 0 or version.min_consumer > MAX_SUPPORTED_VERSION or \
                MAX_SUPPORTED_VERSION in version.bad_consumers:
            raise UnsupportedError(
                f"bundle version producer={version.producer} min_consumer={version.min_consumer} "
                f"bad_consumers={list(version.bad_consumers)} is not readable by format version "
                f"{MAX_SUPPORTED_VERSION}", path=self.index_path)
        return header

    def keys(self, include_slices: bool = False) -> List[bytes]:
        """All keys in index order; slice entries only with ``include_slices``."""
        return [k for k in self._all_entries() if include_slices or not is_slice_key(k)]

    def __contains__(self, key: KeyLike) -> bool:
        return self._value(_key_bytes(key)) is not None

    def entry(self, key: KeyLike) -> pb.BundleEntryProto:
        """The parsed and checked ``BundleEntryProto`` of ``key``."""
        kb = _key_bytes(key)
        cached = self._entries.get(kb)
        if cached is not None:
            return cached
        value = self._value(kb)
        if value is None:
            raise NotFoundError("key not found in checkpoint", path=self.prefix, key=kb)
        entry = pb.BundleEntryProto()
        try:
            entry.ParseFromString(value)
        except Exception:
            raise CorruptIndexError("unparsable entry", path=self.index_path, key=kb) from None
        try:
            from_enum(entry.dtype)
        except UnsupportedError:
            from_enum(entry.dtype, self.index_path, _key_str(kb))  # raises again, naming the key
        self._shapes[kb] = _check_shape(entry, self.index_path, kb, None)
        if not entry.slices:
            if entry.offset < 0 or entry.size < 0 or not 0 <= entry.shard_id < self.num_shards:
                raise CorruptIndexError(
                    f"bad location shard_id={entry.shard_id} offset={entry.offset} size={entry.size} "
                    f"(bundle has {self.num_shards} shards)", path=self.index_path, key=kb)
        self._entries[kb] = entry
        return entry

    def dtype(self, key: KeyLike) -> DType:
        return from_enum(self.entry(key).dtype)

    def shape(self, key: KeyLike) -> Tuple[int, ...]:
        kb = _key_bytes(key)
        shape = self._shapes.get(kb)
        if shape is None:
            self.entry(kb)
            shape = self._shapes[kb]
        return shape

    def pieces(self, key: KeyLike) -> List[StoredPiece]:
        """Where the tensor's values are stored: one piece, or one per slice."""
        kb = _key_bytes(key)
        cached = self._pieces.get(kb)
        if cached is not None:
            return list(cached)
        entry = self.entry(kb)
        shape = self.shape(kb)
        if not entry.slices:
            return [StoredPiece(full_box(shape), kb, entry, kb)]
        out = [self._slice_piece(kb, entry, tslice, box) for tslice, box in self._slice_boxes(kb, entry, shape)]
        self._pieces[kb] = out
        return list(out)

    def piece_at(self, key: KeyLike, start: Sequence[int]) -> Optional[StoredPiece]:
        """The stored piece of ``key`` whose box starts at ``start`` (``None``: no such piece).

        Only that piece's slice entry is looked up and checked (a rank that reads one
        chunk of a tensor sliced many ways looks up one entry, not all of them).
        """
        kb = _key_bytes(key)
        start = tuple(int(a) for a in start)
        starts = self._starts.get(kb)
        if starts is None:
            entry = self.entry(kb)
            shape = self.shape(kb)
            if not entry.slices:
                starts = {tuple(0 for _ in shape): StoredPiece(full_box(shape), kb, entry, kb)}
            else:
                starts = {tuple(a for a, _ in box): (tslice, box)
                          for tslice, box in self._slice_boxes(kb, entry, shape)}
            self._starts[kb] = starts  # two threads may both build it: the same dict either way
        found = starts.get(start)
        if found is None or isinstance(found, StoredPiece):
            return found
        piece = self._slice_piece(kb, self.entry(kb), found[0], found[1])
        starts[start] = piece
        return piece

    def piece_boxes(self, key: KeyLike) -> List[Box]:
        """Where the tensor's stored pieces lie (as :meth:`pieces` gives them), from its own entry
        only: the slice entries are looked up (and checked) when :meth:`pieces` is called."""
        kb = _key_bytes(key)
        cached = self._pieces.get(kb)
        if cached is not None:
            return [p.box for p in cached]
        entry = self.entry(kb)
        shape = self.shape(kb)
        if not entry.slices:
            return [full_box(shape)]
        return [box for _, box in self._slice_boxes(kb, entry, shape)]

    def _slice_boxes(self, kb: bytes, entry: pb.BundleEntryProto,
                     shape: Tuple[int, ...]) -> Iterator[Tuple[TensorSlice, Box]]:
        for proto in entry.slices:
            tslice = TensorSlice.from_proto(proto)
            try:
                box = tslice.box(shape)
            except InvalidArgumentError as exc:
                raise CorruptIndexError(f"bad slice: {exc}", path=self.index_path, key=kb) from None
            yield tslice, box

    def _slice_piece(self, kb: bytes, entry: pb.BundleEntryProto, tslice: TensorSlice, box: Box) -> StoredPiece:
        """The stored piece of one listed slice (its entry looked up and checked against the tensor's)."""
        slice_key = encode_tensor_name_slice(kb, tslice.extents)
        try:
            slice_entry = self.entry(slice_key)
        except NotFoundError:
            raise CorruptIndexError(f"slice {tslice} listed but its entry is missing",
                                    path=self.index_path, key=kb) from None
        if slice_entry.dtype != entry.dtype or slice_entry.slices or \
                tuple(int(d.size) for d in slice_entry.shape.dim) != box_shape(box):
            raise CorruptIndexError(f"slice {tslice} entry disagrees with the tensor's dtype or shape",
                                    path=self.index_path, key=kb)
        return StoredPiece(box, slice_key, slice_entry, kb, tslice)

    def _overlapping(self, kb: bytes, box: Box) -> List[Tuple[StoredPiece, Box]]:
        """The stored pieces of ``kb`` that overlap ``box``, with the common part: only their slice
        entries are looked up (a region of a tensor sliced many ways costs a few lookups)."""
        entry = self.entry(kb)
        shape = self.shape(kb)
        if not entry.slices or kb in self._pieces or box == full_box(shape):
            pairs = [(p, intersect(p.box, box)) for p in self.pieces(kb)]
        else:
            pairs = [(self._slice_piece(kb, entry, tslice, pbox), intersect(pbox, box))
                     for tslice, pbox in self._slice_boxes(kb, entry, shape) if intersect(pbox, box) is not None]
        return [(p, c) for p, c in pairs if c is not None]

    # -- data files ----------------------------------------------------------
    def data_path(self, shard_id: int) -> str:
        path = self._paths.get(shard_id)
        if path is None:
            path = self._paths[shard_id] = data_filename(self.prefix, shard_id, self.num_shards)
        return path

    def _replaced(self, path: str, what: str) -> CheckpointReplacedError:
        return CheckpointReplacedError(f"checkpoint was replaced while open: {what} (open the checkpoint again "
                                       "to read what is there now)", path=path)

    def _fd(self, shard_id: int) -> Tuple[Any, int]:
        with self._lock:
            fd = self._fds.get(shard_id)
            if fd is None:
                path = self.data_path(shard_id)
                if self._identity_of is None:
                    if not self._fs.exists(path):
                        raise NotFoundError("data file of the checkpoint is missing", path=path)
                    fd = self._fs.open_read(path)
                    size = self._fs.size(path)
                else:
                    known = shard_id in self._identities
                    recorded = self._identities.get(shard_id)
                    if known and recorded is None:
                        if self._fs.exists(path):
                            raise self._replaced(path, "the data file was missing when the index was opened "
                                                       "and exists now")
                        raise NotFoundError("data file of the checkpoint is missing", path=path)
                    try:
                        fd = self._fs.open_read(path)
                    except NotFoundError:
                        if known:  # it was there when the index was opened: the prefix was overwritten since
                            raise self._replaced(path, "the data file was deleted after the index was "
                                                       "opened") from None
                        raise
                    pinned = known and self._pin_handle(fd, recorded)  # then the identity costs no request
                    try:
                        now = self._identity(path, fd)
                        if not pinned:
                            self._pin_handle(fd, now)  # later reads see this version or fail
                    except BaseException:
                        self._fs.close(fd)
                        raise
                    if known and now != recorded:
                        self._fs.close(fd)
                        raise self._replaced(path, "the data file differs from the one present when the index "
                                                   f"was opened (identity {now} != {recorded})")
                    self._identities[shard_id] = now
                    size = int(now[0])
                self._fds[shard_id] = fd
                self._file_sizes[shard_id] = size
            return fd, self._file_sizes[shard_id]

    def _check_unchanged(self, shard_id: int) -> None:
        """After a read no checksum covers: raise if the data file changed since it was opened."""
        if self._identity_of is None:
            return
        path = self.data_path(shard_id)
        with self._lock:
            fd = self._fds.get(shard_id)
            recorded = self._identities.get(shard_id)
        try:
            now = self._identity(path, fd)
        except NotFoundError:  # (a local descriptor is checked with fstat and never gets here)
            raise self._replaced(path, "the data file was deleted") from None
        if now != recorded:
            raise self._replaced(path, f"the data file changed while it was read (identity {now} != {recorded})")

    def check_piece(self, piece: StoredPiece, dt: DType) -> None:
        """Check, reading no tensor bytes, that ``piece`` lies inside its data file and holds exactly its
        box of ``dt``; raises :class:`~shardckpt.errors.DataLossError` naming file and key otherwise."""
        self._locate(piece, dt)

    def _locate(self, piece: StoredPiece, dt: DType) -> Tuple[int, str]:
        """Open the piece's data file and check the entry fits in it and its size is right."""
        entry = piece.entry
        path = self.data_path(entry.shard_id)
        fd, file_size = self._fd(entry.shard_id)
        if entry.offset + entry.size > file_size:
            raise DataLossError(f"entry points past the end of the data file (offset {entry.offset} + "
                                f"size {entry.size} > file size {file_size})", path=path, **piece.where())
        if dt.itemsize is not None:
            expected = box_volume(piece.box) * dt.itemsize
            if entry.size != expected:
                raise DataLossError(f"entry holds {entry.size} bytes, shape {list(box_shape(piece.box))} of "
                                    f"{dt.name} needs {expected}", path=path, **piece.where())
        elif entry.size < box_volume(piece.box):
            raise DataLossError(f"entry holds {entry.size} bytes, too few for "
                                f"{box_volume(piece.box)} elements", path=path, **piece.where())
        _check_shape(entry, self.index_path, piece.tensor_key, dt.itemsize or 8)
        return fd, path

    def close(self) -> None:
        self._close_index()
        with self._lock:
            for fd in self._fds.values():
                self._fs.close(fd)
            self._fds.clear()

    def __enter__(self) -> "BundleReader":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- values ----------------------------------------------------------------
    def session(self, *, defer: bool = True) -> "ReadSession":
        """A :class:`ReadSession` over this reader (use it as a context manager)."""
        return ReadSession(self, defer=defer)

    @contextlib.contextmanager
    def deferred_verification(self) -> Iterator["ReadSession"]:
        """Kept for callers written against deferred checks: a non-deferring :class:`ReadSession`.

        Checksums are no longer deferred across reads: each whole-entry read is
        checksummed on several threads as its bytes arrive, and every read returns
        with its values complete and checked. Use :meth:`session` to defer reads.
        """
        with ReadSession(self, defer=False) as session:
            yield session

    def read(self, key: KeyLike, *, verify: bool = True, session: Optional["ReadSession"] = None) -> np.ndarray:
        """The whole tensor ``key`` (sliced tensors are assembled)."""
        return self.read_region(key, None, verify=verify, session=session)

    def read_region(self, key: KeyLike, region: Optional[Union[Box, TensorSlice, str]] = None,
                    out: Optional[np.ndarray] = None, *, verify: bool = True,
                    session: Optional["ReadSession"] = None) -> np.ndarray:
        """Read ``region`` of tensor ``key`` (the whole tensor when ``None``) into ``out``.

        ``region`` is a box of ``(start, stop)`` pairs, a :class:`TensorSlice` or
        its text form (``"0,5:-"``). ``out`` (allocated when omitted) must have the
        region's shape and the stored dtype. Only stored pieces that overlap the
        region are read; pieces read whole have their checksum verified, the others
        have their file's identity checked after the read. Within a deferring
        ``session`` the read may complete when the session does.
        """
        kb = _key_bytes(key)
        if region is None:
            if session is not None and session.defer and verify:  # the common case of a restore
                queued = self._whole_read(kb, out)
                if queued is not None:
                    session._queue(queued[1])
                    return queued[0]
            entry = self.entry(kb)
            if not entry.slices:  # one stored entry read whole
                return self._read_entry(kb, entry, out, verify, session)
        dt = self.dtype(kb)
        shape = self.shape(kb)
        box = region_box(region, shape, self.prefix, kb)
        overlaps = self._overlapping(kb, box)
        whole = len(overlaps) == 1 and overlaps[0][1] == box  # the common case: one piece holds it all
        if box_volume(box) > 0 and not whole:
            problem = boxes_tile([common for _, common in overlaps], box)
            if problem is not None:
                raise NotFoundError(f"does not have sufficient slices for region {list(box)}: {problem}",
                                    path=self.prefix, key=kb)
        region_shape = box_shape(box)
        located = [self._locate(piece, dt) for piece, _ in overlaps]  # sizes checked before allocating
        _check_shape(self.entry(kb), self.index_path, kb, dt.itemsize or 8)
        if out is None:
            out = np.empty(region_shape, dtype=dt.numpy)
        elif tuple(out.shape) != region_shape or out.dtype != dt.numpy:
            raise InvalidArgumentError(f"destination has shape {list(out.shape)} and dtype {out.dtype}; "
                                       f"expected {list(region_shape)} and {dt.numpy}",
                                       path=self.prefix, key=kb)
        for (piece, common), where in zip(overlaps, located):
            local = tuple((a - p0, b - p0) for (a, b), (p0, _) in zip(common, piece.box))
            index = tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(common, box))
            dest = out[index] if index else out
            self._read_piece(piece, dt, local, dest, verify, session, where)
        return out

    def _whole_read(self, kb: bytes, out: Optional[np.ndarray]) -> Optional[Tuple[np.ndarray, EntryRead]]:
        """A checksummed whole-tensor read of ``kb`` into ``out`` (allocated when ``None``), ready to queue on
        a pump; ``None`` when the key needs the general path (sliced, strings, byte-swapped, zero-sized
        dimensions, a store with its own request size, a destination that is not a C-contiguous
        array of the stored shape and dtype, or any check failing: the general path raises then).

        The restore planner's fast path, run once per tensor: the same checks as
        :meth:`read_region` (entry inside its file, byte count equal to shape times item
        size, shape an array can have), each done once, with no intermediate objects.
        """
        entry = self._entries.get(kb)
        if entry is None:
            entry = self.entry(kb)
        if entry.slices or self._fs.read_step is not None:
            return None
        dt = from_enum(entry.dtype)
        itemsize = dt.itemsize
        if itemsize is None or (dt.swap_unit and self.big_endian):
            return None
        shape = self._shapes[kb]
        count = math.prod(shape)
        size = entry.size
        if size != count * itemsize or len(shape) > _MAX_RANK or (count == 0 and shape):
            return None  # (a zero dimension: the general path checks the other dimensions' product)
        shard = entry.shard_id
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fd(shard)[0]
        offset = entry.offset
        if offset + size > self._file_sizes[shard]:
            return None
        if out is None:
            out = np.empty(shape, dtype=dt.numpy)
        elif out.shape != shape or out.dtype != dt.numpy or not out.flags.c_contiguous:
            return None
        path = self._paths.get(shard) or self.data_path(shard)
        flat = out.reshape(-1).view(np.uint8)
        return out, EntryRead(fd, path, offset, flat, True, crc.unmask(entry.crc32c), kb, shard)

    def _read_entry(self, kb: bytes, entry: pb.BundleEntryProto, out: Optional[np.ndarray], verify: bool,
                    session: Optional["ReadSession"]) -> np.ndarray:
        """:meth:`read_region` of a whole tensor stored as one entry (same checks, fewer steps)."""
        dt = from_enum(entry.dtype)
        shape = tuple(int(d.size) for d in entry.shape.dim)
        box = full_box(shape)
        piece = StoredPiece(box, kb, entry, kb)
        located = self._locate(piece, dt)  # sizes (and the shape) checked before allocating
        if out is None:
            out = np.empty(shape, dtype=dt.numpy)
        elif tuple(out.shape) != shape or out.dtype != dt.numpy:
            raise InvalidArgumentError(f"destination has shape {list(out.shape)} and dtype {out.dtype}; "
                                       f"expected {list(shape)} and {dt.numpy}", path=self.prefix, key=kb)
        self._read_piece(piece, dt, box, out, verify, session, located)
        return out

    def read_piece_region(self, piece: StoredPiece, local: Box, out: Optional[np.ndarray] = None, *,
                          verify: bool = True, session: Optional["ReadSession"] = None) -> np.ndarray:
        """Read the box ``local`` (relative to the piece) of one stored piece into ``out``.

        For callers that already hold the piece (a DCP read item names the stored
        chunk it reads from): no search over the tensor's other slices. ``out``
        (allocated when omitted; may be a strided view) must have the box's shape
        and the stored dtype. Only the byte runs of the box are read; a piece read
        whole has its checksum verified (within a deferring ``session``, when the
        session ends), a part has its file's identity checked after the read.
        """
        dt = from_enum(piece.entry.dtype, self.index_path, _key_str(piece.tensor_key))
        stored = box_shape(piece.box)
        local = tuple((int(a), int(b)) for a, b in local)
        if len(local) != len(stored) or any(not 0 <= a <= b <= d for (a, b), d in zip(local, stored)):
            raise InvalidArgumentError(f"region {list(local)} does not fit the stored piece's shape {list(stored)}",
                                       path=self.prefix, **piece.where())
        located = self._locate(piece, dt)
        if out is None:
            out = np.empty(box_shape(local), dtype=dt.numpy)
        elif tuple(out.shape) != box_shape(local) or out.dtype != dt.numpy:
            raise InvalidArgumentError(f"destination has shape {list(out.shape)} and dtype {out.dtype}; expected "
                                       f"{list(box_shape(local))} and {dt.numpy}", path=self.prefix, **piece.where())
        if box_volume(local) > 0:
            self._read_piece(piece, dt, local, out, verify, session, located)
        return out

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` does anything on this reader's store (callers may skip building the list)."""
        return self._fs.prefetches

    def prefetch(self, regions: Sequence[Tuple[KeyLike, Optional[Union[Box, TensorSlice, str]]]]) -> int:
        """Announce the reads of ``regions`` (``(key, region)``; ``None``: the whole tensor) to the store.

        Object stores then fetch the byte ranges those reads need (whole entries, or the
        runs of a region) in few large requests, in parallel, ahead of the reads
        (:meth:`~shardckpt.storage.fsspec_fs.FsspecFileSystem.prefetch`); the reads are
        unchanged and checked as always. Local files whose announced bytes leave gaps are
        read through a guide (:meth:`~shardckpt.storage.local.LocalFileSystem.prefetch`):
        the kernel reads the announced bytes, not the gaps. Nothing happens on stores that
        take no announcements. Only entries that fit their files (and, for regions, pass the
        reader's other checks) are announced; any problem is left for the read to report.
        Returns the number of requests planned.
        """
        if not self.prefetches:
            return 0
        reads: List[Tuple[StoredPiece, Optional[Box]]] = []
        for key, region in regions:
            try:
                kb = _key_bytes(key)
                entry = self.entry(kb)
                if region is None and not entry.slices:  # the common case, one entry read whole: no planning
                    reads.append((StoredPiece(full_box(self.shape(kb)), kb, entry, kb), None))
                    continue
                box = region_box(region, self.shape(kb), self.prefix, kb)
                for piece, common in self._overlapping(kb, box):
                    reads.append((piece, tuple((a - p0, b - p0) for (a, b), (p0, _) in zip(common, piece.box))))
            except ShardckptError:
                continue
        return self.prefetch_pieces(reads)

    def prefetch_pieces(self, reads: Sequence[Tuple[StoredPiece, Optional[Box]]]) -> int:
        """:meth:`prefetch` for callers that already hold the stored pieces (a DCP read item names
        its chunk): ``(piece, box relative to the piece)``, ``None`` for the whole piece. No key
        or slice is looked up again. Returns the number of requests planned."""
        if not self.prefetches:
            return 0
        hint = self._fs.prefetch
        files: Dict[int, Tuple[Any, str, int]] = {}  # shard -> (descriptor, path, size)
        # shard -> announced [start, end) pairs: of whole pieces (ints), of regions (arrays of runs)
        whole: Dict[int, Tuple[List[int], List[int]]] = {}
        runs: Dict[int, Tuple[List[np.ndarray], List[np.ndarray]]] = {}
        for piece, local in reads:
            try:
                entry = piece.entry
                stored = box_shape(piece.box) if local is not None else ()
                if local is not None and box_volume(local) == 0:
                    continue
                shard = int(entry.shard_id)
                if local is None or local == full_box(stored):  # read whole: its entry's bytes, if they fit
                    if shard not in files:
                        fd, size = self._fd(shard)
                        files[shard] = (fd, self.data_path(shard), size)
                    if entry.offset + entry.size <= files[shard][2]:
                        pairs = whole.setdefault(shard, ([], []))
                        pairs[0].append(int(entry.offset))
                        pairs[1].append(int(entry.offset + entry.size))
                    continue
                dt = from_enum(entry.dtype)
                fd, path = self._locate(piece, dt)  # opened, and the entry checked against the file
                if dt.itemsize is None:
                    starts = np.array([int(entry.offset)], dtype=np.int64)
                    run = int(entry.size)
                else:
                    starts, run, _ = _box_runs(int(entry.offset), stored, tuple(local), dt.itemsize)
                files.setdefault(shard, (fd, path, self._file_sizes[shard]))
                arrays = runs.setdefault(shard, ([], []))
                arrays[0].append(starts)
                arrays[1].append(starts + run)
            except ShardckptError:
                continue
        planned = 0
        for shard in whole.keys() | runs.keys():
            one_starts, one_ends = whole.get(shard, ([], []))
            many_starts, many_ends = runs.get(shard, ([], []))
            fd, path, _ = files[shard]
            starts_all = np.concatenate([np.asarray(one_starts, dtype=np.int64)] + many_starts)
            ends_all = np.concatenate([np.asarray(one_ends, dtype=np.int64)] + many_ends)
            planned += int(hint(fd, starts_all, ends_all, path) or 0)
        return planned

    def verify(self, key: KeyLike) -> None:
        """Check the checksum of every stored piece of ``key`` (raises :class:`DataLossError`)."""
        for piece in self.pieces(key):
            self.verify_piece(piece)

    def verify_piece(self, piece: StoredPiece) -> None:
        """Read one stored piece whole and check its size and checksum."""
        dt = from_enum(piece.entry.dtype)
        self._locate(piece, dt)
        dest = np.empty(box_shape(piece.box), dtype=dt.numpy)
        self._read_piece(piece, dt, full_box(box_shape(piece.box)), dest, True, None)

    def raw_bytes(self, piece: StoredPiece) -> bytes:
        """The stored bytes of one piece (no checks beyond bounds and the file's identity)."""
        dt = from_enum(piece.entry.dtype)
        fd, path = self._locate(piece, dt)
        buf = bytearray(piece.entry.size)
        self._fs.pread_into(fd, memoryview(buf), piece.entry.offset, path)
        self._check_unchanged(piece.entry.shard_id)
        return bytes(buf)

    def _read_piece(self, piece: StoredPiece, dt: DType, local: Box, dest: np.ndarray, verify: bool,
                    session: Optional["ReadSession"], located: Optional[Tuple[Any, str]] = None) -> None:
        fd, path = located if located is not None else self._locate(piece, dt)
        stored_shape = box_shape(piece.box)
        if not dt.is_numeric:
            values = self._decode_objects(piece, dt, fd, path, verify)
            dest[...] = values.reshape(stored_shape)[tuple(slice(a, b) for a, b in local)]
            return
        whole = local == full_box(stored_shape)
        swap = bool(self.big_endian and dt.swap_unit)
        if whole and dest.flags.c_contiguous:
            defer = session if session is not None and session.defer and verify and not swap else None
            self._read_whole(piece, fd, path, dest, verify, defer)
        elif whole:
            tmp = np.empty(stored_shape, dtype=dt.numpy)
            self._read_whole(piece, fd, path, tmp, verify, None)
            dest[...] = tmp
        else:
            self._read_box(piece.entry.offset, stored_shape, local, dt, fd, path, dest)
            self._check_unchanged(piece.entry.shard_id)
        if swap:
            view = dest.reshape(-1).view(np.dtype(f"u{dt.swap_unit}")) if dest.flags.c_contiguous else None
            if view is not None:
                view.byteswap(inplace=True)
            else:
                swapped = np.ascontiguousarray(dest)
                swapped.view(np.dtype(f"u{dt.swap_unit}")).byteswap(inplace=True)
                dest[...] = swapped

    def _read_whole(self, piece: StoredPiece, fd: Any, path: str, dest: np.ndarray, verify: bool,
                    session: Optional["ReadSession"]) -> None:
        """Read one entry whole into ``dest``: queued on the session's pump (or a pump of its own), read
        in units on several threads, each piece checksummed as it lands (see :mod:`.whole_reads`)."""
        if self._fs.read_step is not None:  # stores with their own request size: units of that size
            self._read_whole_units(piece, fd, path, dest, verify, session)
            return
        flat = dest.reshape(-1).view(np.uint8)
        entry = piece.entry
        offset = int(entry.offset)
        if session is None and len(flat) < 2 * self._min_unit:  # one unit: no pump, no helpers
            computed = read_range(self._fs, fd, path, offset, flat, self._sub, verify)
            self._check_read(piece, path, verify, computed)
            return
        read = EntryRead(fd, path, offset, flat, verify, crc.unmask(entry.crc32c), piece, int(entry.shard_id))
        if session is not None:  # read by the session's helpers; checked when the session finishes
            session._queue(read)
            return
        pump = self._pump()
        pump.add(read)
        pump.drain()
        self._check_entry(read)

    def _pump(self) -> ReadPump:
        return ReadPump(self._fs, lambda: self._context.executor, self._context.workers, unit=self._unit,
                        min_unit=self._min_unit, sub=self._sub)

    def _check_read(self, piece: StoredPiece, path: str, verify: bool, computed: int) -> None:
        if not verify:
            self._check_unchanged(piece.entry.shard_id)
            return
        expected = crc.unmask(piece.entry.crc32c)
        if computed != expected:
            self._check_unchanged(piece.entry.shard_id)  # a replaced file says so
            raise DataLossError(f"checksum does not match: stored 0x{expected:08x}, computed "
                                f"0x{computed:08x}", path=path, **piece.where())

    def _check_entry(self, read: EntryRead) -> None:
        """Raise what went wrong with a queued whole-entry read: a failed read, a replaced file, a checksum."""
        if read.error is not None:
            raise read.error
        if not read.verify:
            self._check_unchanged(read.shard)
            return
        problem = read.mismatch()
        if problem is not None:
            self._check_unchanged(read.shard)  # a replaced file says so
            where = read.tag.where() if isinstance(read.tag, StoredPiece) else {"key": read.tag}
            raise DataLossError(problem, path=read.path, **where)

    def _read_whole_units(self, piece: StoredPiece, fd: Any, path: str, dest: np.ndarray, verify: bool,
                          session: Optional["ReadSession"]) -> None:
        """Read one entry whole in units of the store's request size, on several threads."""
        size = int(piece.entry.size)
        if session is None and size <= self._sub:  # one small read: no job, no helpers
            flat = byte_view(dest)
            self._fs.pread_into(fd, flat, int(piece.entry.offset), path)
            self._check_read(piece, path, verify, crc.value(flat) if verify else 0)
            return
        job = _EntryJob(self, piece, fd, path, byte_view(dest), verify)
        job.run(self._context.executor if self._context.workers else None)  # this thread reads units too
        if session is not None:  # units still in flight on helpers are waited for by the session
            session._add(job)
            return
        job.finish()

    def _read_box(self, offset: int, shape: Tuple[int, ...], local: Box, dt: DType, fd: Any,
                  path: str, dest: np.ndarray) -> None:
        """Read the sub-box ``local`` of a row-major block stored at ``offset``."""
        itemsize = dt.itemsize
        assert itemsize is not None
        if not dest.flags.c_contiguous:  # e.g. columns of a tensor: scattered straight into its rows
            scattered = _scatter_runs(offset, shape, local, itemsize, dest)
            if scattered is not None:
                self._fs.pread_batch(fd, scattered, path)
                return
        offsets, run_bytes, contiguous = _box_runs(offset, shape, local, itemsize)
        if contiguous:  # one contiguous run (e.g. leading rows, or the whole block)
            self._pread_to(fd, path, int(offsets[0]), dest)
            return
        target = dest if dest.flags.c_contiguous else np.empty(dest.shape, dtype=dest.dtype)
        cover = None
        if run_bytes < _PAGE:  # tiny runs: the rows that hold them, for stores where bytes are cheaper than calls
            row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
            cover = (offset + local[0][0] * row_bytes, (local[0][1] - local[0][0]) * row_bytes)
        self._fs.pread_batch(fd, RunBatch(offsets, run_bytes, byte_view(target), cover), path)
        if target is not dest:
            dest[...] = target

    def _pread_to(self, fd: Any, path: str, start: int, target: np.ndarray) -> None:
        if target.flags.c_contiguous:
            self._fs.pread_into(fd, byte_view(target), start, path)
        else:
            tmp = np.empty(target.shape, dtype=target.dtype)
            self._fs.pread_into(fd, byte_view(tmp), start, path)
            target[...] = tmp

    def _decode_objects(self, piece: StoredPiece, dt: DType, fd: int, path: str, verify: bool) -> np.ndarray:
        entry = piece.entry
        buf = bytearray(entry.size)
        self._fs.pread_into(fd, memoryview(buf), entry.offset, path)
        count = box_volume(piece.box)
        data = bytes(buf)
        try:
            if dt.is_string:
                items = decode_strings(data, count, entry.crc32c, big_endian=self.big_endian)
            else:
                items = decode_variants(data, count, entry.crc32c)
        except DataLossError as exc:
            raise DataLossError(exc.message, path=path, **piece.where()) from None
        values = np.empty(count, dtype=object)
        values[:] = items
        return values


class _EntryJob:
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
        self._jobs: List[_EntryJob] = []
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
            kb = _key_bytes(key)
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

    def _add(self, job: _EntryJob) -> None:
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


def _check_shape(entry: pb.BundleEntryProto, path: str, key: bytes, itemsize: Optional[int]) -> Tuple[int, ...]:
    """A shape an array can have: known rank <= 64, no negative size, byte count within int64.

    With ``itemsize`` ``None`` only what any shape must satisfy is checked (no negative
    size); the rest is checked before an array of the shape is made. Returns the shape.
    """
    dims = tuple([d.size for d in entry.shape.dim])
    if entry.shape.unknown_rank or (dims and min(dims) < 0):
        raise CorruptIndexError(f"invalid tensor shape {list(dims[:_MAX_RANK + 1])}", path=path, key=key)
    if itemsize is None:
        return dims
    if len(dims) > _MAX_RANK:
        raise CorruptIndexError(f"tensor of rank {len(dims)}: more than the {_MAX_RANK} dimensions an array "
                                "can have", path=path, key=key)
    count = itemsize
    for d in dims:  # every dimension counts, a zero one included (NumPy refuses such shapes too)
        count *= max(d, 1)
        if count > _MAX_ELEMENTS:
            raise CorruptIndexError(f"tensor shape {list(dims)} is too large (its dimensions, zero ones "
                                    "ignored, multiply to more than 2**63 bytes)", path=path, key=key)
    return dims


def iter_tensors(reader: BundleReader) -> Iterator[Tuple[bytes, np.ndarray]]:
    """Every tensor of a bundle, in key order (slices assembled)."""
    for key in reader.keys():
        yield key, reader.read(key)
