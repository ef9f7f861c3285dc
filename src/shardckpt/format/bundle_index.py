"""The ``.index`` of a tensor bundle: its header, checked by one parser, and its entries by key.

:func:`parse_header` is the one header parser: every reader of an index (the
:class:`~shardckpt.format.bundle_reader.BundleReader`, merges, incremental saves, the
leftover scan) takes the header through it, so a header one of them refuses (no shard,
more than 2^24 shards, an unknown byte order, a version this format does not read) is
refused by all, as :class:`~shardckpt.errors.CorruptIndexError` or
:class:`~shardckpt.errors.UnsupportedError` naming the index file. :func:`read_index`
reads an index whole (header and raw entries); :func:`read_index_header` reads only the
header entry (the footer and index block, then the first data block, whatever the
index's size).

:class:`BundleIndex` is an index opened for lookups, with the identity of the checkpoint
it belongs to. A small index is read and checked whole when it opens; a large one is not
read: its SSTable's footer and index block are, and each lookup reads (and checks) the
one data block that may hold its key (see :class:`~shardckpt.format.sstable.TableReader`).
When it opens, the identity of the index and of every data file (inode/size/mtime
locally, size and ETag on object stores) is recorded: an open that finds the index
replaced meanwhile starts again, data file names included (they follow the shard count
of the index that is kept). Entries are parsed and checked on first lookup (dtype known,
shape an array may have, location inside the bundle's shards); nothing is allocated from
a size the files have not confirmed.

Nothing here writes a file, and nothing looks a store up: the caller hands the store in.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ..errors import (
    CheckpointReplacedError,
    CorruptIndexError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from ..storage.base import FileSystem
from ..storage.object_store import ObjectStore
from .dtypes import DType, from_enum
from .naming import data_filename, index_filename
from .ordered_code import is_slice_key
from .protos import tensor_bundle_pb2 as pb
from .sstable import TableReader, read_table

__all__ = ["BundleIndex", "parse_header", "header_from_entry", "read_index", "read_index_header", "check_shape",
           "key_bytes", "key_str", "replaced", "KeyLike", "MAX_SUPPORTED_VERSION", "MAX_SHARDS"]

MAX_SUPPORTED_VERSION = 1  # the bundle format's producer/consumer version
MAX_SHARDS = 1 << 24  # more data files than this in one bundle: a corrupt header
MAX_RANK = 64  # NumPy's limit (TensorFlow allows 254; such tensors cannot be arrays here)
_MAX_ELEMENTS = (1 << 63) - 1
_EAGER_IDENTITY = 1024  # data files whose identity is recorded when the index is opened
_OPEN_ATTEMPTS = 3
EAGER_INDEX_BYTES = 1 << 20  # index files up to this size are read and checked whole when opened

KeyLike = Union[str, bytes]


def parse_header(value: bytes, path: str) -> pb.BundleHeaderProto:
    """The checked ``BundleHeaderProto`` stored as ``value`` in the index ``path``.

    Raises :class:`CorruptIndexError` (unparsable, ``num_shards`` outside 1..2^24) or
    :class:`UnsupportedError` (unknown endianness, a version this reader cannot read),
    each naming ``path``.
    """
    header = pb.BundleHeaderProto()
    try:
        header.ParseFromString(value)
    except Exception:
        raise CorruptIndexError("unparsable bundle header", path=path) from None
    if not 1 <= header.num_shards <= MAX_SHARDS:
        raise CorruptIndexError(f"bad num_shards {header.num_shards} in header", path=path)
    if header.endianness not in (pb.BundleHeaderProto.LITTLE, pb.BundleHeaderProto.BIG):
        raise UnsupportedError(f"unknown endianness {header.endianness}", path=path)
    version = header.version
    if version.producer < 0 or version.min_consumer > MAX_SUPPORTED_VERSION or \
            MAX_SUPPORTED_VERSION in version.bad_consumers:
        raise UnsupportedError(
            f"bundle version producer={version.producer} min_consumer={version.min_consumer} "
            f"bad_consumers={list(version.bad_consumers)} is not readable by format version "
            f"{MAX_SUPPORTED_VERSION}", path=path)
    return header


def header_from_entry(key: Optional[bytes], value: Optional[bytes], path: str) -> pb.BundleHeaderProto:
    """The checked header from the first entry ``(key, value)`` of the index ``path`` (``None``: the index
    has no entry); :class:`CorruptIndexError` when that entry is not the header (its key is not ``""``)."""
    if key != b"" or value is None:
        raise CorruptIndexError("index has no header entry (empty key)", path=path)
    return parse_header(value, path)


def read_index(prefix: str, fs: FileSystem) -> Tuple[pb.BundleHeaderProto, List[Tuple[bytes, bytes]]]:
    """The checked header and the ``(key, serialized entry)`` pairs of the bundle at ``prefix`` on ``fs``."""
    path = index_filename(prefix)
    items = list(read_table(fs.read_bytes(path), path))
    first = items[0] if items else (None, None)
    return header_from_entry(first[0], first[1], path), items[1:]


def read_index_header(prefix: str, fs: FileSystem) -> pb.BundleHeaderProto:
    """Only the checked header of ``<prefix>.index`` on ``fs``: a small index in one request, a
    large one through its footer and index block and the first data block.

    The header is the table's first entry (its key, ``""``, sorts first), so a large
    index is never read whole.
    """
    path = index_filename(prefix)
    total = fs.size(path)
    if total <= EAGER_INDEX_BYTES:  # one request (object stores): the first entry parses without the rest
        for key, value in read_table(fs.read_bytes(path), path):
            return header_from_entry(key, value, path)
        return header_from_entry(None, None, path)
    handle = fs.open_read(path)
    try:
        def read(offset: int, size: int) -> bytes:
            buf = bytearray(size)
            fs.pread_into(handle, memoryview(buf), offset, path)
            return bytes(buf)

        table = TableReader(read, total, path)
        return header_from_entry(b"", table.get(b""), path)
    finally:
        fs.close(handle)


def check_shape(entry: pb.BundleEntryProto, path: str, key: bytes, itemsize: Optional[int]) -> Tuple[int, ...]:
    """A shape an array can have: known rank <= 64, no negative size, byte count within int64.

    With ``itemsize`` ``None`` only what any shape must satisfy is checked (no negative
    size); the rest is checked before an array of the shape is made. Returns the shape.
    """
    dims = tuple([d.size for d in entry.shape.dim])
    if entry.shape.unknown_rank or (dims and min(dims) < 0):
        raise CorruptIndexError(f"invalid tensor shape {list(dims[:MAX_RANK + 1])}", path=path, key=key)
    if itemsize is None:
        return dims
    if len(dims) > MAX_RANK:
        raise CorruptIndexError(f"tensor of rank {len(dims)}: more than the {MAX_RANK} dimensions an array "
                                "can have", path=path, key=key)
    count = itemsize
    for d in dims:  # every dimension counts, a zero one included (NumPy refuses such shapes too)
        count *= max(d, 1)
        if count > _MAX_ELEMENTS:
            raise CorruptIndexError(f"tensor shape {list(dims)} is too large (its dimensions, zero ones "
                                    "ignored, multiply to more than 2**63 bytes)", path=path, key=key)
    return dims


def key_bytes(key: KeyLike) -> bytes:
    """A key as stored: ``str`` keys are UTF-8."""
    if isinstance(key, bytes):
        return key
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"key {key!r} is not valid Unicode text ({exc.reason}); keys are UTF-8") from None


def key_str(key: bytes) -> str:
    """A stored key as text for messages (undecodable bytes escaped)."""
    return key.decode("utf-8", "backslashreplace")


def replaced(path: str, what: str) -> CheckpointReplacedError:
    """The error of a checkpoint whose file ``path`` is not the one opened."""
    return CheckpointReplacedError(f"checkpoint was replaced while open: {what} (open the checkpoint again "
                                   "to read what is there now)", path=path)


class BundleIndex:
    """The index of the bundle at ``prefix`` on ``fs``, opened for lookups (see the module's docstring).

    ``identity_of(path, handle)`` gives a file's identity (``None``: the store has none and
    nothing is recorded); ``pin(handle, identity)`` holds a handle's reads to that version
    where the store can. ``load_index``: ``True`` reads the whole index and checks all of it
    now; ``False`` reads only its footer and index block, then the data blocks lookups need;
    ``None`` reads it whole when it is at most 1 MiB. After opening, ``data_identities``
    maps shard ids to their data file's identity at open (``None``: missing then; absent:
    not recorded). Safe to share between threads.
    """

    def __init__(self, prefix: str, fs: FileSystem, *, identity_of: Optional[Callable[..., Any]],
                 pin: Optional[Callable[[Any, Any], bool]], load_index: Optional[bool]) -> None:
        self.prefix = prefix
        self.index_path = index_filename(prefix)
        self._fs = fs
        self._identity_of = identity_of
        self._pin = pin
        self._load_index = load_index
        self._lock = threading.Lock()
        self._raw: Optional[Dict[bytes, bytes]] = None  # every entry, once read whole
        self._table: Optional[TableReader] = None  # lookups through the index block (index not read whole)
        self._index_fd: Any = None
        self._index_identity: Any = None
        self._index_size = 0
        self.data_identities: Dict[int, Any] = {}
        for _attempt in range(_OPEN_ATTEMPTS):
            try:
                opened = self._open()
            except BaseException:
                self.close()  # a lazily opened index that fails a check keeps no file open
                raise
            if opened:
                break
        else:
            self.close()
            raise CheckpointReplacedError(f"the checkpoint was replaced while it was being opened "
                                          f"({_OPEN_ATTEMPTS} attempts)", path=self.index_path)

    def _identity(self, path: str, handle: Any = None) -> Any:
        assert self._identity_of is not None
        return self._identity_of(path, handle)

    def pin_handle(self, fd: Any, identity: Any) -> bool:
        """Hold the reads of ``fd`` to ``identity`` where the store can (then its identity costs no request)."""
        return bool(self._pin is not None and identity is not None and self._pin(fd, identity))

    def data_path(self, shard_id: int) -> str:
        """The data file of shard ``shard_id`` of this index's bundle."""
        return data_filename(self.prefix, shard_id, self.num_shards)

    def _open(self) -> bool:
        """Read the index and record the identity of it and the data files; False if it changed meanwhile.

        A small index (or ``load_index=True``) is read and checked whole. A large one (or
        ``load_index=False``) stays on storage: its footer and index block are read now,
        data blocks when a lookup needs them (each checked then, see
        :class:`~shardckpt.format.sstable.TableReader`); the whole index is read only
        for :meth:`keys`.
        """
        fs = self._fs
        self.close()  # from an earlier attempt
        self._raw, self._table = None, None
        # Object stores that list and pin: one round trip lists the identity of the index and
        # of every data object, and reads the index's first bytes with the identity of the
        # version read. Both name the same index, or the open starts again; later reads are
        # pinned to the identities (a replaced object fails the read), so no HEAD is needed.
        both = fs.list_and_read if isinstance(fs, ObjectStore) and self._pin is not None else None
        got = both(self.prefix + ".", self.index_path, EAGER_INDEX_BYTES) if both is not None else None
        listed, head = got if got is not None else (None, None)
        before: Any
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
            lazy = size > EAGER_INDEX_BYTES
        if lazy:
            try:
                header_bytes = self._open_lazily(before)
            except CheckpointReplacedError:
                self.close()
                return False
            if header_bytes is None:
                raise CorruptIndexError("index has no header entry (empty key)", path=self.index_path)
        else:
            if head is not None and len(head[0]) >= int(before[0]):
                data = head[0][:int(before[0])]  # all of it came with the listing
            else:
                try:
                    data = self._read_whole(before, pinned=head is not None)
                except CheckpointReplacedError:
                    return False
            raw = dict(read_table(data, self.index_path))
            header_bytes = raw.pop(b"", None)
            if header_bytes is None:
                raise CorruptIndexError("index has no header entry (empty key)", path=self.index_path)
            self._raw = raw
            if before is not None and before[0] != len(data):
                return False
        self.header = parse_header(header_bytes, self.index_path)
        self.num_shards = int(self.header.num_shards)
        self.big_endian = self.header.endianness == pb.BundleHeaderProto.BIG
        self.entries: Dict[bytes, pb.BundleEntryProto] = {}
        self.shapes: Dict[bytes, Tuple[int, ...]] = {}  # of every entry in entries
        # data file names follow this index's shard count: an earlier attempt's (another index's, when
        # the prefix was overwritten meanwhile) would pair this index with another checkpoint's files
        self.data_identities = {}
        if self._identity_of is None:
            return True
        identities = self.data_identities
        if listed is not None:  # the listing that named the index's version names its data objects
            for shard in range(self.num_shards):
                path = self.data_path(shard)
                if path in listed:
                    identities[shard] = listed[path]
                elif self.num_shards <= _EAGER_IDENTITY:  # not listed: ask the object before calling it missing
                    try:
                        identities[shard] = self._identity(path)
                    except NotFoundError:
                        identities[shard] = None
            return True
        if self.num_shards <= _EAGER_IDENTITY:
            paths = [self.data_path(shard) for shard in range(self.num_shards)]
            found = self._fs.identities(paths)  # e.g. one listing on an object store
            self.data_identities = {shard: found.get(path) for shard, path in enumerate(paths)}
        return self._identity(self.index_path) == before

    def _read_whole(self, before: Any, pinned: bool) -> bytes:
        """The whole index file; with ``pinned``, read held to the identity ``before`` (raises
        :class:`CheckpointReplacedError` when the index is another one now)."""
        if not pinned:
            return self._fs.read_bytes(self.index_path)
        fd = self._fs.open_read(self.index_path)
        try:
            if not self.pin_handle(fd, before):
                return self._fs.read_bytes(self.index_path)
            buf = bytearray(int(before[0]))
            self._fs.pread_into(fd, memoryview(buf), 0, self.index_path)
            return bytes(buf)
        finally:
            self._fs.close(fd)

    def _open_lazily(self, before: Any) -> Optional[bytes]:
        """Open the index for lookups through its index block; the header entry's value."""
        self._index_identity = before
        self._index_size = int(before[0]) if before is not None else self._fs.size(self.index_path)
        self._handle()
        self._table = TableReader(self._read, self._index_size, self.index_path)
        return self._table.get(b"")

    def _handle(self) -> Any:
        """The open index file (opened again after :meth:`close`; it must still be the same file)."""
        with self._lock:
            if self._index_fd is None:
                fd = self._fs.open_read(self.index_path)
                if self._identity_of is not None:
                    self.pin_handle(fd, self._index_identity)
                    try:
                        now = self._identity(self.index_path, fd)
                    except BaseException:
                        self._fs.close(fd)
                        raise
                    if now != self._index_identity:
                        self._fs.close(fd)
                        raise replaced(self.index_path, "the index differs from the one opened "
                                                        f"(identity {now} != {self._index_identity})")
                self._index_fd = fd
            return self._index_fd

    def _read(self, offset: int, size: int) -> bytes:
        """``size`` bytes of the index file at ``offset`` (the file must be the one opened)."""
        fd = self._handle()
        buf = bytearray(size)
        self._fs.pread_into(fd, memoryview(buf), offset, self.index_path)
        if self._identity_of is not None:
            now = self._identity(self.index_path, fd)
            if now != self._index_identity:
                raise replaced(self.index_path, f"the index changed (identity {now} != {self._index_identity})")
        return bytes(buf)

    def close(self) -> None:
        """Close the index file, if one is open (a later lookup opens it again)."""
        with self._lock:
            if self._index_fd is not None:
                self._fs.close(self._index_fd)
                self._index_fd = None

    def _all_entries(self) -> Dict[bytes, bytes]:
        """Every entry but the header (the whole index is read and checked on first use)."""
        raw = self._raw
        if raw is None:
            raw = dict(read_table(self._read(0, self._index_size), self.index_path))
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

    def keys(self, include_slices: bool = False) -> List[bytes]:
        """All keys in index order; slice entries only with ``include_slices``."""
        return [k for k in self._all_entries() if include_slices or not is_slice_key(k)]

    def __contains__(self, key: KeyLike) -> bool:
        return self._value(key_bytes(key)) is not None

    def entry(self, key: KeyLike) -> pb.BundleEntryProto:
        """The parsed and checked ``BundleEntryProto`` of ``key``."""
        kb = key_bytes(key)
        cached = self.entries.get(kb)
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
            from_enum(entry.dtype, self.index_path, key_str(kb))  # raises again, naming the key
        self.shapes[kb] = check_shape(entry, self.index_path, kb, None)
        if not entry.slices:
            if entry.offset < 0 or entry.size < 0 or not 0 <= entry.shard_id < self.num_shards:
                raise CorruptIndexError(
                    f"bad location shard_id={entry.shard_id} offset={entry.offset} size={entry.size} "
                    f"(bundle has {self.num_shards} shards)", path=self.index_path, key=kb)
        self.entries[kb] = entry
        return entry

    def dtype(self, key: KeyLike) -> DType:
        """The stored dtype of ``key``."""
        return from_enum(self.entry(key).dtype)

    def shape(self, key: KeyLike) -> Tuple[int, ...]:
        """The stored (global) shape of ``key``."""
        kb = key_bytes(key)
        shape = self.shapes.get(kb)
        if shape is None:
            self.entry(kb)
            shape = self.shapes[kb]
        return shape
