"""The LevelDB-style SSTable that holds a tensor bundle's ``.index``.

:class:`TableWriter` produces the exact bytes TensorFlow's ``TableBuilder`` writes
(256 KiB blocks, restart interval 16 for data blocks and 1 for the index block,
no compression, an empty metaindex block, TF's key shortening rules).
:class:`read_table` accepts any valid LevelDB table: other block sizes and
restart intervals, and Snappy-compressed blocks.

Layout (all integers little-endian)::

    [data block][trailer]... [metaindex block][trailer] [index block][trailer] [footer 48 B]
    block   = entries, uint32 restart offsets, uint32 number of restarts
    entry   = varint shared, varint non_shared, varint value_len, key suffix, value
    trailer = 1 byte type (0 raw, 1 snappy), uint32 masked crc32c(block + type)
    footer  = metaindex handle, index handle (varint offset, size), zero pad to 40, magic
"""

from __future__ import annotations

import bisect
import itertools
import operator
import struct
import threading
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

from ..errors import CorruptIndexError, InvalidArgumentError, UnsupportedError
from . import crc, varint

__all__ = [
    "TableWriter",
    "read_table",
    "TableReader",
    "TABLE_MAGIC",
    "FOOTER_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_RESTART_INTERVAL",
]

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
BLOCK_TRAILER_SIZE = 5
DEFAULT_BLOCK_SIZE = 262144
DEFAULT_RESTART_INTERVAL = 16
_NO_COMPRESSION = 0
_SNAPPY_COMPRESSION = 1
_EMPTY_BLOCK = b"\x00\x00\x00\x00\x01\x00\x00\x00"
# Prefix compression lets a small table decode to huge keys. With a restart every 16
# entries (what TF writes) keys total at most ~16x the file; beyond this budget the
# table is rejected rather than exhausting memory.
_KEY_BYTES_BASE = 64 << 20
_KEY_BYTES_PER_BYTE = 16
_TAIL_READ = 64 << 10  # TableReader's first request: the footer and, usually, the index block with it
_CACHE_BYTES = 32 << 20  # decoded data blocks TableReader keeps (least recently used dropped first)


class _BlockBuilder:
    """Prefix-compressed entries with restart points, as LevelDB's BlockBuilder."""

    def __init__(self, restart_interval: int) -> None:
        self._interval = restart_interval
        self._buf = bytearray()
        self._restarts: List[int] = [0]
        self._counter = 0
        self._last_key = b""

    def empty(self) -> bool:
        return not self._buf

    def size_estimate(self) -> int:
        return len(self._buf) + 4 * len(self._restarts) + 4

    def add(self, key: bytes, value: "bytes | bytearray") -> None:
        buf = self._buf
        if self._counter < self._interval:
            shared = _shared_prefix(self._last_key, key)
        else:
            self._restarts.append(len(buf))
            self._counter = 0
            shared = 0
        non_shared = len(key) - shared
        value_len = len(value)
        if non_shared < 0x80 and value_len < 0x80:  # shared <= len(key): the usual one-byte lengths
            buf += _THREE_BYTES.pack(shared, non_shared, value_len) if shared < 0x80 else \
                varint.encode(shared) + _TWO_BYTES.pack(non_shared, value_len)
        else:
            buf += varint.encode(shared)
            buf += varint.encode(non_shared)
            buf += varint.encode(value_len)
        buf += key[shared:] if shared else key
        buf += value
        self._last_key = key
        self._counter += 1

    def finish(self) -> bytes:
        out = bytes(self._buf) + struct.pack(f"<{len(self._restarts)}I", *self._restarts)
        out += struct.pack("<I", len(self._restarts))
        self._buf = bytearray()
        self._restarts = [0]
        self._counter = 0
        self._last_key = b""
        return out


_THREE_BYTES = struct.Struct("<BBB")
_TWO_BYTES = struct.Struct("<BB")


def _shared_prefix(a: bytes, b: bytes) -> int:
    """Length of the common prefix of ``a`` and ``b`` (compared as big integers: no loop per byte)."""
    n = min(len(a), len(b))
    head_a = a[:n]
    head_b = b[:n]
    if head_a == head_b:
        return n
    diff = int.from_bytes(head_a, "big") ^ int.from_bytes(head_b, "big")
    return n - ((diff.bit_length() + 7) >> 3)


def _shortest_separator(start: bytes, limit: bytes) -> bytes:
    """A short key ``k`` with ``start <= k < limit`` (LevelDB's bytewise rule)."""
    n = min(len(start), len(limit))
    i = 0
    while i < n and start[i] == limit[i]:
        i += 1
    if i < n:
        byte = start[i]
        if byte < 0xFF and byte + 1 < limit[i]:
            return start[:i] + bytes((byte + 1,))
    return start


def _short_successor(key: bytes) -> bytes:
    """A short key ``k >= key`` (LevelDB's bytewise rule)."""
    for i, byte in enumerate(key):
        if byte != 0xFF:
            return key[:i] + bytes((byte + 1,))
    return key


def _encode_handle(offset: int, size: int) -> bytes:
    return varint.encode(offset) + varint.encode(size)


class TableWriter:
    """Build an SSTable in memory; keys must be added in strictly increasing bytewise order.

    >>> w = TableWriter(); w.add(b"a", b"1"); data = w.finish()
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE,
                 restart_interval: int = DEFAULT_RESTART_INTERVAL) -> None:
        if block_size <= 0 or restart_interval <= 0:
            raise InvalidArgumentError("block_size and restart_interval must be positive")
        self._block_size = block_size
        self._out: List[bytes] = []
        self._offset = 0
        self._data_block = _BlockBuilder(restart_interval)
        self._index_block = _BlockBuilder(1)
        self._last_key: Optional[bytes] = None
        self._pending_handle: Optional[bytes] = None
        self._finished = False

    def add(self, key: bytes, value: "bytes | bytearray") -> None:
        if self._finished:
            raise InvalidArgumentError("table already finished")
        if self._last_key is not None:
            if key <= self._last_key:
                raise InvalidArgumentError(
                    f"table keys must be strictly increasing: {key!r} after {self._last_key!r}")
            if len(key) + len(value) >= 2 * self._block_size:
                self._flush()
        if self._pending_handle is not None:
            assert self._last_key is not None
            self._index_block.add(_shortest_separator(self._last_key, key), self._pending_handle)
            self._pending_handle = None
        self._last_key = key
        self._data_block.add(key, value)
        if self._data_block.size_estimate() >= self._block_size:
            self._flush()

    def extend(self, items: Iterable[Tuple[bytes, "bytes | bytearray"]]) -> None:
        """:meth:`add` each ``(key, value)`` in turn (the same bytes; the data block built inline, for many entries)."""
        if self._finished:
            raise InvalidArgumentError("table already finished")
        iterator = iter(items)
        if self._last_key is None:  # the first entry of the table: nothing to compare with
            for key, value in iterator:
                self.add(key, value)
                break
        if self._last_key is None:
            return
        block = self._data_block
        interval = block._interval
        block_size = self._block_size
        big = 2 * block_size
        pack = _THREE_BYTES.pack
        encode = varint.encode
        from_bytes = int.from_bytes
        buf, restarts, counter, previous = block._buf, block._restarts, block._counter, block._last_key
        room = block_size - 4 * len(restarts) - 4  # bytes the entries may take before the block is full
        last = self._last_key
        try:
            for key, value in iterator:
                key_len = len(key)
                value_len = len(value)
                if key <= last:
                    raise InvalidArgumentError(f"table keys must be strictly increasing: {key!r} after {last!r}")
                if key_len + value_len >= big and buf:
                    block._counter, block._last_key = counter, previous
                    self._flush()
                    buf, restarts, counter, previous = block._buf, block._restarts, block._counter, block._last_key
                    room = block_size - 4 * len(restarts) - 4
                if self._pending_handle is not None:
                    self._index_block.add(_shortest_separator(last, key), self._pending_handle)
                    self._pending_handle = None
                if counter < interval:
                    n = key_len if key_len < len(previous) else len(previous)
                    mine = key[:n]
                    theirs = previous[:n]
                    if mine == theirs:
                        shared = n
                    else:
                        shared = n - (((from_bytes(mine, "big") ^ from_bytes(theirs, "big")).bit_length() + 7) >> 3)
                    counter += 1
                else:
                    restarts.append(len(buf))
                    room -= 4
                    counter = 1
                    shared = 0
                non_shared = key_len - shared
                if (shared | non_shared | value_len) < 0x80:
                    buf += pack(shared, non_shared, value_len)
                    buf += key[shared:] if shared else key
                else:
                    buf += encode(shared)
                    buf += encode(non_shared)
                    buf += encode(value_len)
                    buf += key[shared:]
                buf += value
                previous = last = key
                if len(buf) >= room:
                    block._counter, block._last_key = counter, previous
                    self._last_key = last
                    self._flush()
                    buf, restarts, counter, previous = block._buf, block._restarts, block._counter, block._last_key
                    room = block_size - 4 * len(restarts) - 4
        finally:
            block._counter, block._last_key = counter, previous
            self._last_key = last

    def _write_block(self, contents: bytes) -> bytes:
        handle = _encode_handle(self._offset, len(contents))
        type_byte = bytes((_NO_COMPRESSION,))
        checksum = crc.mask(crc.extend(crc.value(contents), type_byte))
        self._out.append(contents)
        self._out.append(type_byte + struct.pack("<I", checksum))
        self._offset += len(contents) + BLOCK_TRAILER_SIZE
        return handle

    def _flush(self) -> None:
        if self._data_block.empty():
            return
        self._pending_handle = self._write_block(self._data_block.finish())

    def finish(self) -> bytes:
        """Write the remaining blocks and the footer; return the whole table."""
        self._flush()
        metaindex_handle = self._write_block(_EMPTY_BLOCK)
        if self._pending_handle is not None:
            assert self._last_key is not None
            self._index_block.add(_short_successor(self._last_key), self._pending_handle)
            self._pending_handle = None
        index_handle = self._write_block(self._index_block.finish())
        footer = metaindex_handle + index_handle
        footer += b"\x00" * (40 - len(footer)) + struct.pack("<Q", TABLE_MAGIC)
        self._out.append(footer)
        self._finished = True
        return b"".join(self._out)


def _corrupt(path: str, what: str) -> CorruptIndexError:
    return CorruptIndexError(f"corrupt index: {what}", path=path)


def _decode_handle(buf: bytes, pos: int, limit: int, path: str) -> Tuple[int, int, int]:
    try:
        offset, pos = varint.decode(buf, pos, limit)
        size, pos = varint.decode(buf, pos, limit)
    except CorruptIndexError:
        raise _corrupt(path, "bad block handle") from None
    return offset, size, pos


def _check_handle(offset: int, size: int, file_size: int, path: str, what: str) -> None:
    end = offset + size
    if end + BLOCK_TRAILER_SIZE > file_size - FOOTER_SIZE:
        raise _corrupt(path, f"{what} block [{offset}, {end}) lies outside the file ({file_size} bytes)")


def _decode_block(buf: bytes, start: int, size: int, offset: int, path: str, what: str) -> bytes:
    """Check the trailer of the block at ``buf[start:start + size]`` (file offset ``offset``); its contents."""
    end = start + size
    contents = buf[start:end]
    block_type = buf[end]
    (stored,) = struct.unpack_from("<I", buf, end + 1)
    actual = crc.extend(crc.value(contents), bytes((block_type,)))
    if crc.unmask(stored) != actual:
        raise _corrupt(path, f"{what} block at offset {offset}: checksum mismatch "
                             f"(stored 0x{crc.unmask(stored):08x}, computed 0x{actual:08x})")
    if block_type == _NO_COMPRESSION:
        return contents
    if block_type == _SNAPPY_COMPRESSION:
        try:
            import cramjam
        except ImportError:  # pragma: no cover - cramjam is a required dependency
            raise UnsupportedError("snappy-compressed index block but no snappy codec "
                                   "(install cramjam)", path=path) from None
        try:
            return bytes(cramjam.snappy.decompress_raw(contents))
        except Exception as exc:  # cramjam raises its own error type
            raise _corrupt(path, f"{what} block at offset {offset}: bad snappy data ({exc})") from None
    raise _corrupt(path, f"{what} block at offset {offset}: bad block type {block_type}")


def _read_block(data: bytes, offset: int, size: int, path: str, what: str) -> bytes:
    _check_handle(offset, size, len(data), path, what)
    return _decode_block(data, offset, size, offset, path, what)


def _entries_end(block: bytes, path: str, what: str) -> int:
    """Where ``block``'s entries end (its restart array and count follow), checked."""
    if len(block) < 4:
        raise _corrupt(path, f"{what} block too short ({len(block)} bytes)")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 - 4 * num_restarts
    if num_restarts == 0 or limit < 0:
        raise _corrupt(path, f"{what} block: bad restart count {num_restarts}")
    return limit


def _iter_block(block: bytes, path: str, what: str) -> Iterator[Tuple[bytes, bytes]]:
    limit = _entries_end(block, path, what)
    pos = 0
    key = b""
    try:
        while pos < limit:
            shared, pos = varint.decode(block, pos, limit, 5)
            non_shared, pos = varint.decode(block, pos, limit, 5)
            value_len, pos = varint.decode(block, pos, limit, 5)
            if shared > len(key) or pos + non_shared + value_len > limit:
                raise _corrupt(path, f"{what} block: bad entry at offset {pos}")
            key = key[:shared] + block[pos:pos + non_shared]
            pos += non_shared
            yield key, block[pos:pos + value_len]
            pos += value_len
    except CorruptIndexError as exc:
        if exc.path is None:
            raise _corrupt(path, f"{what} block: {exc}") from None
        raise


def _block_lists(block: bytes, path: str, what: str, budget: int) -> Tuple[List[bytes], List[bytes], int]:
    """Every key and value of ``block`` (as :func:`_iter_block`, all at once), and ``budget`` less their key bytes.

    Raises the prefix-compression-bomb error as soon as the keys exceed ``budget``.
    Keys are not checked for order here.
    """
    limit = _entries_end(block, path, what)
    keys: List[bytes] = []
    values: List[bytes] = []
    add_key = keys.append
    add_value = values.append
    pos = 0
    key = b""
    try:
        while pos < limit:
            if pos + 3 <= limit and (block[pos] | block[pos + 1] | block[pos + 2]) < 0x80:
                shared = block[pos]  # the usual case: three one-byte varints
                non_shared = block[pos + 1]
                value_len = block[pos + 2]
                pos += 3
            else:
                shared, pos = varint.decode(block, pos, limit, 5)
                non_shared, pos = varint.decode(block, pos, limit, 5)
                value_len, pos = varint.decode(block, pos, limit, 5)
            end = pos + non_shared
            if shared > len(key) or end + value_len > limit:
                raise _corrupt(path, f"{what} block: bad entry at offset {pos}")
            key = key[:shared] + block[pos:end] if shared else block[pos:end]
            budget -= shared + non_shared
            if budget < 0:
                raise _corrupt(path, "keys decode to far more bytes than the file holds (prefix-compression bomb?)")
            add_key(key)
            pos = end + value_len
            add_value(block[end:pos])
    except CorruptIndexError as exc:
        if exc.path is None:
            raise _corrupt(path, f"{what} block: {exc}") from None
        raise
    return keys, values, budget


def _strictly_increasing(keys: List[bytes], last: Optional[bytes], path: str) -> None:
    """Raise the out-of-order error unless ``last`` (if any) and ``keys`` are strictly increasing."""
    if last is not None and keys and keys[0] <= last:
        raise _corrupt(path, f"keys out of order: {keys[0][:64]!r} after {last[:64]!r}")
    if all(map(operator.lt, keys, itertools.islice(keys, 1, None))):
        return
    for before, key in zip(keys, keys[1:]):
        if key <= before:
            raise _corrupt(path, f"keys out of order: {key[:64]!r} after {before[:64]!r}")


def _footer_cut_at(data: bytes) -> Optional[int]:
    """Where the footer began if the file lost part of it: the index block ends there."""
    for start in range(max(0, len(data) - FOOTER_SIZE + 1), len(data)):
        try:
            _, _, pos = _decode_handle(data, start, len(data), "")
            index_offset, index_size, _ = _decode_handle(data, pos, len(data), "")
        except CorruptIndexError:
            continue
        end = index_offset + index_size
        if end + BLOCK_TRAILER_SIZE == start and index_size >= 4:
            (stored,) = struct.unpack_from("<I", data, end + 1)
            if crc.unmask(stored) == crc.extend(crc.value(data[index_offset:end]), data[end:end + 1]):
                return start
    return None


def _starts_like_table(data: bytes, scan: int = 128 << 10) -> bool:
    """Whether ``data`` begins with a block whose trailer checksum matches (so it was an index once)."""
    running = 0
    for end in range(0, min(len(data) - BLOCK_TRAILER_SIZE, scan)):
        if end >= 4 and data[end] in (_NO_COMPRESSION, _SNAPPY_COMPRESSION):
            (stored,) = struct.unpack_from("<I", data, end + 1)
            if crc.unmask(stored) == crc.extend(running, data[end:end + 1]):
                return True
        running = crc.extend(running, data[end:end + 1])
    return False


def _no_footer(data: bytes, magic: int) -> str:
    """Why there is no table footer at the end: a cut tail (with sizes when known), or not an index."""
    cut = _footer_cut_at(data)
    if cut is not None:
        return (f"index is truncated: expected {cut + FOOTER_SIZE} bytes (its footer starts at {cut}), "
                f"the file has {len(data)}")
    if _starts_like_table(data):
        return (f"index is truncated: the file ({len(data)} bytes) begins with valid table blocks but its "
                f"{FOOTER_SIZE}-byte footer (ending in the magic number 0x{TABLE_MAGIC:016x}) is missing")
    return (f"bad magic number 0x{magic:016x} (expected 0x{TABLE_MAGIC:016x}): not a tensor-bundle index, "
            f"or truncated ({len(data)} bytes)")


def read_table(data: bytes, path: str = "<memory>") -> Iterator[Tuple[bytes, bytes]]:
    """Yield ``(key, value)`` pairs of an SSTable held in ``data``, in stored order.

    Every block's CRC is checked; keys must be strictly increasing. Errors are
    :class:`CorruptIndexError` naming ``path``.
    """
    if len(data) < FOOTER_SIZE:
        truncated = "index is truncated: " if _starts_like_table(data) else ""
        raise _corrupt(path, f"{truncated}file is {len(data)} bytes, shorter than the {FOOTER_SIZE}-byte footer")
    footer_at = len(data) - FOOTER_SIZE
    (magic,) = struct.unpack_from("<Q", data, footer_at + 40)
    if magic != TABLE_MAGIC:
        raise _corrupt(path, _no_footer(data, magic))
    _, _, pos = _decode_handle(data, footer_at, footer_at + 40, path)  # metaindex: ignored
    index_offset, index_size, _ = _decode_handle(data, pos, footer_at + 40, path)
    index_block = _read_block(data, index_offset, index_size, path, "index")
    last_key: Optional[bytes] = None
    key_budget = _KEY_BYTES_BASE + _KEY_BYTES_PER_BYTE * len(data)
    for _, handle in _iter_block(index_block, path, "index"):
        offset, size, _ = _decode_handle(handle, 0, len(handle), path)
        block = _read_block(data, offset, size, path, "data")
        keys, values, key_budget = _block_lists(block, path, "data", key_budget)
        _strictly_increasing(keys, last_key, path)
        if keys:
            last_key = keys[-1]
        yield from zip(keys, values)



def _block_entries(block: bytes, path: str, what: str) -> Tuple[List[bytes], List[bytes]]:
    """Every entry of one block: keys strictly increasing, key bytes within the block's budget."""
    keys: List[bytes] = []
    values: List[bytes] = []
    budget = _KEY_BYTES_BASE + _KEY_BYTES_PER_BYTE * len(block)
    last: Optional[bytes] = None
    for key, value in _iter_block(block, path, what):
        if last is not None and key <= last:
            raise _corrupt(path, f"keys out of order in a {what} block: {key[:64]!r} after {last[:64]!r}")
        budget -= len(key)
        if budget < 0:
            raise _corrupt(path, f"keys of a {what} block decode to far more bytes than the block holds "
                                 "(prefix-compression bomb?)")
        keys.append(key)
        values.append(value)
        last = key
    return keys, values


class _Block:
    """One data block read for lookups: its restart keys checked up front, its groups decoded when needed.

    Every restart point must start an entry with nothing shared, restart keys must be
    strictly increasing and lie between the index keys around the block, and each group
    of entries (from one restart point to the next) must end exactly where the next one
    starts, with keys strictly increasing and below the next restart key. A group is
    decoded (and checked) the first time a lookup lands in it.
    """

    __slots__ = ("data", "limit", "starts", "restart_keys", "groups", "held", "path", "offset", "upper")

    def __init__(self, data: bytes, path: str, offset: int, lower: Optional[bytes], upper: bytes) -> None:
        self.data = data
        self.path = path
        self.offset = offset
        self.upper = upper
        what = f"data block at offset {offset}"
        if len(data) < 4:
            raise _corrupt(path, f"{what} too short ({len(data)} bytes)")
        (count,) = struct.unpack_from("<I", data, len(data) - 4)
        self.limit = len(data) - 4 - 4 * count
        if count == 0 or self.limit < 0:
            raise _corrupt(path, f"{what}: bad restart count {count}")
        self.starts = list(struct.unpack_from(f"<{count}I", data, self.limit))
        self.restart_keys: List[bytes] = []
        self.groups: dict = {}
        self.held = len(data)
        if self.limit == 0:  # an empty block: one restart at 0, no entries
            self.starts = []
            return
        previous = -1
        for start in self.starts:
            if start <= previous or start >= self.limit:
                raise _corrupt(path, f"{what}: bad restart offset {start}")
            previous = start
        if self.starts[0] != 0:
            raise _corrupt(path, f"{what}: first restart offset is {self.starts[0]}, not 0")
        last = lower
        try:
            for start in self.starts:
                shared, pos = varint.decode(data, start, self.limit, 5)
                non_shared, pos = varint.decode(data, pos, self.limit, 5)
                value_len, pos = varint.decode(data, pos, self.limit, 5)
                if shared != 0 or pos + non_shared + value_len > self.limit:
                    raise _corrupt(path, f"{what}: bad entry at restart offset {start}")
                key = data[pos:pos + non_shared]
                if last is not None and key <= last:
                    raise _corrupt(path, f"keys out of order: {key[:64]!r} after {last[:64]!r} ({what})")
                self.restart_keys.append(key)
                last = key
        except CorruptIndexError as exc:
            if exc.path is None:
                raise _corrupt(path, f"{what}: {exc}") from None
            raise
        if last is not None and last > upper:
            raise _corrupt(path, f"keys out of order: {what} holds keys past its index key")

    def group(self, r: int) -> Tuple[List[bytes], List[bytes]]:
        """The keys and values of group ``r`` (checked; decoded once)."""
        found = self.groups.get(r)
        if found is not None:
            return found
        data = self.data
        end = self.starts[r + 1] if r + 1 < len(self.starts) else self.limit
        bound = self.restart_keys[r + 1] if r + 1 < len(self.starts) else None
        what = f"data block at offset {self.offset}"
        keys: List[bytes] = []
        values: List[bytes] = []
        budget = _KEY_BYTES_BASE + _KEY_BYTES_PER_BYTE * len(data)
        pos = self.starts[r]
        key = b""
        try:
            while pos < end:
                shared, pos = varint.decode(data, pos, end, 5)
                non_shared, pos = varint.decode(data, pos, end, 5)
                value_len, pos = varint.decode(data, pos, end, 5)
                if shared > len(key) or pos + non_shared + value_len > end:
                    raise _corrupt(self.path, f"{what}: bad entry at offset {pos}")
                new = key[:shared] + data[pos:pos + non_shared]
                if keys and new <= key:
                    raise _corrupt(self.path, f"keys out of order: {new[:64]!r} after {key[:64]!r} ({what})")
                key = new
                budget -= len(key)
                if budget < 0:
                    raise _corrupt(self.path, f"keys of a {what} decode to far more bytes than the block "
                                              "holds (prefix-compression bomb?)")
                pos += non_shared
                keys.append(key)
                values.append(data[pos:pos + value_len])
                pos += value_len
        except CorruptIndexError as exc:
            if exc.path is None:
                raise _corrupt(self.path, f"{what}: {exc}") from None
            raise
        if (bound is not None and key >= bound) or key > self.upper:
            raise _corrupt(self.path, f"keys out of order: {key[:64]!r} lies past the next restart key "
                                      f"or the index key ({what})")
        self.groups[r] = (keys, values)
        self.held += sum(map(len, keys)) + sum(map(len, values))
        return keys, values

    def get(self, key: bytes) -> Optional[bytes]:
        r = bisect.bisect_right(self.restart_keys, key) - 1
        if r < 0:
            return None
        keys, values = self.group(r)
        j = bisect.bisect_left(keys, key)
        if j < len(keys) and keys[j] == key:
            return values[j]
        return None


class TableReader:
    """Random access to an SSTable without reading all of it: the footer, the index block, and the
    data blocks that lookups need.

    ``read(offset, size)`` returns ``size`` bytes of the table file (``size`` bytes long);
    the caller checks that the file did not change between reads. Opening costs one
    request of at most 64 KiB (footer and index block; a second one when the index block
    is larger). :meth:`get` binary-searches the index block for the one data block that
    may hold a key, reads it, checks its CRC and decodes it (a few decoded blocks are
    kept). Each data block is checked as :func:`read_table` checks the whole table: CRC,
    well-formed entries, keys strictly increasing within the block and lying between the
    index keys around it (so blocks are ordered too), key bytes within a budget per
    block. Blocks never looked at are never checked: use :func:`read_table` to check all.
    Errors are :class:`CorruptIndexError` naming ``path``. Safe to share between threads.
    """

    def __init__(self, read: Callable[[int, int], bytes], size: int, path: str = "<memory>", *,
                 cache_bytes: int = _CACHE_BYTES) -> None:
        self._read = read
        self.size = size
        self.path = path
        self._cache: "OrderedDict[int, _Block]" = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        self._lock = threading.Lock()
        if size < FOOTER_SIZE:
            data = read(0, size)
            truncated = "index is truncated: " if _starts_like_table(data) else ""
            raise _corrupt(path, f"{truncated}file is {size} bytes, shorter than the {FOOTER_SIZE}-byte footer")
        tail_len = min(size, _TAIL_READ)
        tail_at = size - tail_len
        tail = read(tail_at, tail_len)
        footer_at = tail_len - FOOTER_SIZE
        (magic,) = struct.unpack_from("<Q", tail, footer_at + 40)
        if magic != TABLE_MAGIC:
            raise _corrupt(path, _no_footer(read(0, size), magic))
        _, _, pos = _decode_handle(tail, footer_at, footer_at + 40, path)  # metaindex: ignored
        index_offset, index_size, _ = _decode_handle(tail, pos, footer_at + 40, path)
        _check_handle(index_offset, index_size, size, path, "index")
        if index_offset >= tail_at:
            block = _decode_block(tail, index_offset - tail_at, index_size, index_offset, path, "index")
        else:
            raw = read(index_offset, index_size + BLOCK_TRAILER_SIZE)
            block = _decode_block(raw, 0, index_size, index_offset, path, "index")
        self._seps, handles = _block_entries(block, path, "index")
        self._handles: List[Tuple[int, int]] = []
        for handle in handles:
            offset, length, _ = _decode_handle(handle, 0, len(handle), path)
            _check_handle(offset, length, size, path, "data")
            self._handles.append((offset, length))

    @property
    def num_blocks(self) -> int:
        return len(self._handles)

    def get(self, key: bytes) -> Optional[bytes]:
        """The value stored under ``key``, or ``None``."""
        i = bisect.bisect_left(self._seps, key)
        if i == len(self._seps):
            return None
        with self._lock:
            block = self._block(i)
            before = block.held
            value = block.get(key)
            self._cached += block.held - before
            return value

    def _block(self, i: int) -> _Block:
        found = self._cache.get(i)
        if found is not None:
            self._cache.move_to_end(i)
            return found
        offset, length = self._handles[i]
        raw = self._read(offset, length + BLOCK_TRAILER_SIZE)
        contents = _decode_block(raw, 0, length, offset, self.path, "data")
        block = _Block(contents, self.path, offset, self._seps[i - 1] if i else None, self._seps[i])
        self._cache[i] = block
        self._cached += block.held
        while self._cached > self._cache_bytes and len(self._cache) > 1:
            self._cached -= self._cache.popitem(last=False)[1].held
        return block
