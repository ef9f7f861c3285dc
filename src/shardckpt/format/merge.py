"""Merging bundle indexes: the pure part of TensorFlow's ``MergeV2Checkpoints``.

Nothing here moves or writes a file (that is commit policy: see
:mod:`shardckpt.saving.commit`). What is here:

* :func:`read_index` — a bundle's header and raw entries; :func:`read_index_header`
  reads only the header entry (both from :mod:`.bundle_index`, re-exported here: the one
  header parser, so a header the reader refuses no merge accepts);
* :func:`plan_merge` — combine several bundles' entries: each input's data files get
  new shard ids in order of first use; slices of one tensor spread over several
  inputs are combined; a key stored whole in two inputs is an error;
* :func:`merge_entries` — the same for serialized entries held in memory;
* :func:`index_bytes` — the ``.index`` file of merged entries.

``num_shards`` of a merge is the number of data files its entries use; for inputs
that all hold entries (every save does) this is TensorFlow's sum of the inputs'
``num_shards``. (For an input with no entries TensorFlow counts a data file it never
renames, and its result cannot be read.)

Entries stay serialized ``BundleEntryProto`` bytes from the input index to the merged
one: a protobuf object per entry costs ~1-3 KiB and a parse and a serialization, which
at 10^6 entries (1 024 clients x 1 000 sliced tensors) is gigabytes and seconds. An entry
laid out as protobuf serializes it (fields in number order, ``slices`` last) is edited in
place: the ``shard_id`` field (after ``dtype`` and ``shape``) is replaced, and the
``slices`` records of the same tensor's entries in later inputs are appended to the
first one's. Every field is checked to be well-formed (the ``shape`` and slice messages
are parsed once per distinct value), so whatever would not parse is still rejected before
any file moves. An entry laid out otherwise (unknown fields, fields out of order) takes
the protobuf path, as a message, and comes out as protobuf serializes it. For entries that
protobuf wrote, the merged index is byte for byte what parsing, editing and serializing
every entry gives (what TensorFlow's merge writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from ..errors import AlreadyExistsError, CorruptIndexError, InvalidArgumentError
from . import varint
from .bundle_index import MAX_SHARDS, read_index, read_index_header
from .bundle_writer import make_header
from .naming import data_filename, index_filename
from .protos import tensor_bundle_pb2 as pb
from .sstable import TableWriter

__all__ = ["merge_entries", "index_bytes", "read_index", "read_index_header", "plan_merge", "MergePlan",
           "MergeInput", "EntryValue"]

#: A merged entry: serialized (``bytearray`` once slices were appended to it).
EntryValue = Union[bytes, bytearray]

_DTYPE_TAG = 0x08  # the tags (field number << 3 | wire type) of BundleEntryProto's fields
_SHAPE_TAG = 0x12
_SHARD_TAG = 0x18
_OFFSET_TAG = 0x20
_SIZE_TAG = 0x28
_CRC_TAG = 0x35
_SLICE_TAG = 0x3A
_MOST = 9  # varint bytes of a non-negative int64
_CHECKED_LIMIT = 1 << 16  # distinct slice messages (and entries) remembered as well-formed


class _Layouts:
    """Where the fields of serialized entries lie; shape and slice messages parsed once per distinct value.

    An entry is taken as protobuf lays it out: fields in number order, each at most once
    (slices: any number of records, last), tags of one byte, varints of at most
    ``_MOST`` bytes (a negative or huge value takes the protobuf path), a ``dtype``
    below 2^14, a ``shape`` shorter than 128 bytes. The ``shape`` and ``slices``
    messages are checked by parsing them (once per distinct record); the other fields
    need no check beyond their bounds. Anything else is ``None``: the protobuf path.
    """

    def __init__(self) -> None:
        self._shapes: Set[bytes] = set()
        self._slices: Set[bytes] = set()

    @staticmethod
    def _check(seen: Set[bytes], record: bytes, message: bytes, kind: type) -> bool:
        try:
            kind.FromString(message)  # type: ignore[attr-defined]
        except Exception:  # protobuf's DecodeError: the protobuf path reports it
            return False
        if len(seen) >= _CHECKED_LIMIT:
            seen.clear()
        seen.add(record)
        return True

    def of(self, value: bytes) -> Optional[Tuple[int, int, int, int]]:
        """``(head, shard_id, shard_end, slices)`` of an entry laid out as protobuf writes it, else ``None``.

        ``value[:head]`` holds ``dtype`` and ``shape``; the ``shard_id`` field, if any,
        spans ``value[head:shard_end]``; the ``slices`` records span ``value[slices:]``.
        """
        n = len(value)
        try:  # an entry cut short raises IndexError: the protobuf path
            pos = 0
            if n and value[0] == _DTYPE_TAG:  # dtype
                pos = 2 if value[1] < 0x80 else 3 if value[2] < 0x80 else n + 1
            if pos >= n:  # nothing past the dtype
                return (n, 0, n, n) if pos == n else None
            head = pos
            if value[pos] == _SHAPE_TAG:  # shape
                head = pos + 2 + value[pos + 1]
                if value[pos + 1] >= 0x80 or head > n:
                    return None
                record = value[pos:head]
                if record not in self._shapes and \
                        not self._check(self._shapes, record, value[pos + 2:head], pb.TensorShapeProto):
                    return None
            pos = head
            shard = 0
            if pos < n and value[pos] == _SHARD_TAG:  # shard_id: below 2^28 here (a count is below 2^24)
                start = pos = pos + 1
                while value[pos] >= 0x80:
                    pos += 1
                pos += 1
                if pos - start == 1:
                    shard = value[start]
                elif pos - start <= 4:
                    shard = varint.decode(value, start, pos)[0]
                else:
                    return None
            shard_end = pos
            if pos < n and value[pos] == _OFFSET_TAG:  # offset: non-negative
                start = pos = pos + 1
                while value[pos] >= 0x80:
                    pos += 1
                pos += 1
                if pos - start > _MOST:
                    return None
            if pos < n and value[pos] == _SIZE_TAG:  # size: non-negative
                start = pos = pos + 1
                while value[pos] >= 0x80:
                    pos += 1
                pos += 1
                if pos - start > _MOST:
                    return None
            if pos < n and value[pos] == _CRC_TAG:  # crc32c: four bytes
                pos += 5
                if pos > n:
                    return None
        except IndexError:
            return None
        if pos == n:
            return head, shard, shard_end, n
        slices = pos
        seen = self._slices
        while pos < n:  # slice records: tag, length, TensorSliceProto
            if value[pos] != _SLICE_TAG or pos + 1 == n:
                return None
            if value[pos + 1] < 0x80:
                start = pos + 2
                end = start + value[pos + 1]
            else:
                try:
                    size, start = varint.decode(value, pos + 1, n, _MOST)
                except CorruptIndexError:
                    return None
                end = start + size
            if end > n:
                return None
            record = value[pos:end]
            if record not in seen and not self._check(seen, record, value[start:end], pb.TensorSliceProto):
                return None
            pos = end
        return head, shard, shard_end, slices


def _shard_field(shard_id: int) -> bytes:
    """The serialized ``shard_id`` field (none for 0, as protobuf writes it)."""
    return b"\x18" + varint.encode(shard_id) if shard_id else b""


def _parse(value: EntryValue, path: str, key: bytes) -> pb.BundleEntryProto:
    entry = pb.BundleEntryProto()
    try:
        entry.ParseFromString(bytes(value))
    except Exception:
        raise CorruptIndexError("unparsable entry", path=path, key=key) from None
    return entry


class _Merged:
    """Merged entries by key: serialized, or a message for entries off the protobuf layout."""

    def __init__(self) -> None:
        self.entries: Dict[bytes, Union[EntryValue, pb.BundleEntryProto]] = {}
        self.layouts = _Layouts()
        self.heads: Dict[bytes, bytes] = {}  # combined entries: key -> their dtype and shape fields
        # entries whose slices were appended: value -> (head, slices) of its layout (full entries of
        # tensors of one shape repeat, one per client and layout)
        self.known: Dict[bytes, Tuple[int, int]] = {}

    def combine(self, key: bytes, value: bytes, source: str, path: Optional[str] = None) -> None:
        """Add the slices of ``value`` to the entry already held under ``key``."""
        existing = self.entries[key]
        if isinstance(existing, bytearray):  # the usual case: an entry like one seen (and checked) before
            known = self.known.get(value)
            if known is not None:
                head = self.heads[key]
                if known[0] == len(head) and value.startswith(head):
                    existing += value[known[1]:]
                    return
        self._combine(key, existing, value, source, path or source)

    def _combine(self, key: bytes, existing: Union[EntryValue, pb.BundleEntryProto], value: bytes, source: str,
                 where: str) -> None:
        if isinstance(existing, pb.BundleEntryProto):
            self._combine_messages(key, existing, _parse(value, where, key), source, where)
            return
        if isinstance(existing, bytearray):
            head: Optional[bytes] = self.heads[key]
            has_slices = True
        else:
            held = self.layouts.of(existing)
            head = existing[:held[0]] if held is not None else None
            has_slices = held is not None and held[3] < len(existing)
        laid = self.layouts.of(value)
        if laid is None or head is None:
            self._combine_messages(key, self._as_message(key), _parse(value, where, key), source, where)
            return
        if not has_slices or laid[3] == len(value):
            raise AlreadyExistsError(f"duplicate tensor encountered when merging prefix {source}",
                                     path=where, key=key)
        if value[:laid[0]] != head:  # equal dtype and shape serialize alike, unless written unlike protobuf
            theirs = _parse(value, where, key)
            ours = _parse(existing, where, key)
            if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
                raise InvalidArgumentError("slices of one tensor disagree on dtype or shape across "
                                           f"merged prefix {source}", path=where, key=key)
        if isinstance(existing, bytes):
            existing = bytearray(existing)
            self.entries[key] = existing
            self.heads[key] = head
        existing += value[laid[3]:]
        if len(self.known) >= _CHECKED_LIMIT:
            self.known.clear()
        self.known[value] = (laid[0], laid[3])

    def _as_message(self, key: bytes) -> pb.BundleEntryProto:
        held = self.entries[key]
        if isinstance(held, pb.BundleEntryProto):
            return held
        message = pb.BundleEntryProto.FromString(bytes(held))  # held entries parse: checked or ours
        self.entries[key] = message
        self.heads.pop(key, None)
        return message

    @staticmethod
    def _combine_messages(key: bytes, existing: pb.BundleEntryProto, entry: pb.BundleEntryProto, source: str,
                          path: str) -> None:
        if not existing.slices or not entry.slices:
            raise AlreadyExistsError(f"duplicate tensor encountered when merging prefix {source}",
                                     path=path, key=key)
        if existing.dtype != entry.dtype or existing.shape != entry.shape:
            raise InvalidArgumentError("slices of one tensor disagree on dtype or shape across "
                                       f"merged prefix {source}", path=path, key=key)
        existing.slices.extend(entry.slices)

    def serialized(self) -> Dict[bytes, EntryValue]:
        """The entries, every one serialized (those held as messages serialized now)."""
        entries = self.entries
        for key in [k for k, v in entries.items() if isinstance(v, pb.BundleEntryProto)]:
            entries[key] = entries[key].SerializeToString()  # type: ignore[union-attr]
        self.heads.clear()
        return entries  # type: ignore[return-value]


def merge_entries(parts: Iterable[Tuple[str, Iterable[Tuple[bytes, bytes]]]]) -> Dict[bytes, EntryValue]:
    """Merge serialized bundle entries held in memory (object-store saves), by the rules of :func:`plan_merge`.

    ``parts`` are ``(name, (key, serialized entry) pairs)`` whose ``shard_id`` already is
    the merged bundle's (each is consumed before the next is asked for); slices of one
    tensor combine, a key stored whole twice is an error.
    """
    merged = _Merged()
    entries = merged.entries
    known = merged.known
    heads = merged.heads
    for name, items in parts:
        for key, value in items:
            existing = entries.get(key)
            if existing is None:
                entries[key] = value
                continue
            if existing.__class__ is bytearray:  # merged.combine's usual case, inline
                seen = known.get(value)
                if seen is not None:
                    same = heads[key]
                    if seen[0] == len(same) and value.startswith(same):
                        existing += value[seen[1]:]  # type: ignore[operator]
                        continue
            merged.combine(key, value, name)
    return merged.serialized()


def index_bytes(entries: Mapping[bytes, EntryValue], num_shards: int, big_endian: bool = False) -> bytes:
    """The ``.index`` file of a bundle with serialized ``entries`` and ``num_shards`` data files."""
    table = TableWriter()
    table.add(b"", make_header(num_shards, big_endian))
    keys = sorted(entries)
    table.extend(zip(keys, map(entries.__getitem__, keys)))
    return table.finish()


MergeInput = Tuple[str, pb.BundleHeaderProto, Sequence[Tuple[bytes, bytes]]]


@dataclass(frozen=True)
class MergePlan:
    """What a merge produces: the merged entries (serialized, shard ids renumbered) and where each data file goes.

    ``sources`` lists the inputs' data files in order of first use: source ``i``
    becomes shard ``i`` of the merged bundle. ``big_endian`` is the inputs' byte order.
    """

    entries: Dict[bytes, EntryValue]
    sources: List[str]
    big_endian: bool

    @property
    def count(self) -> int:
        """Number of data files the merged entries use."""
        return len(self.sources)

    def index(self, num_shards: int) -> bytes:
        """The merged ``.index`` for a bundle of ``num_shards`` data files (``>= count``: padding)."""
        return index_bytes(self.entries, num_shards, self.big_endian)


def plan_merge(inputs: Iterable[MergeInput]) -> MergePlan:
    """Combine the bundles ``inputs`` (``(prefix, header, items)``, in order) into one set of entries.

    Checks everything (headers agree on endianness and version, shard ids in range,
    entries parse, no key stored whole twice) before any caller moves a file. Each
    input's items are done with before the next input is asked for (a generator of
    inputs holds one part index at a time).
    """
    merged = _Merged()
    new_ids: Dict[str, int] = {}
    first: Optional[pb.BundleHeaderProto] = None
    for prefix, header, items in inputs:
        path = index_filename(prefix)
        if not 1 <= header.num_shards <= MAX_SHARDS:
            raise CorruptIndexError(f"bad num_shards {header.num_shards} in header", path=path)
        if first is None:
            first = header
        elif header.endianness != first.endianness or \
                header.version.SerializeToString() != first.version.SerializeToString():
            raise InvalidArgumentError("merge inputs disagree on endianness or version", path=path)
        _merge_input(merged, prefix, header.num_shards, items, new_ids)
    if first is None:
        raise InvalidArgumentError("merge needs at least one input bundle")
    return MergePlan(merged.serialized(), list(new_ids), first.endianness == pb.BundleHeaderProto.BIG)


def _merge_input(merged: _Merged, prefix: str, num_shards: int, items: Iterable[Tuple[bytes, bytes]],
                 new_ids: Dict[str, int]) -> None:
    """Add one input bundle's entries to ``merged``, its data files numbered on from ``new_ids``."""
    path = index_filename(prefix)
    entries = merged.entries
    layout = merged.layouts.of
    renumbered: Dict[int, int] = {}  # this input's shard id -> the merged bundle's
    fields: Dict[int, bytes] = {}  # ... and its serialized shard_id field

    def new_id(shard: int, key: bytes) -> int:
        # As in TF, the full entry of a sliced tensor gets its bundle's shard id too
        # (meaningless, ignored by readers), so merged indexes are byte-identical.
        if not 0 <= shard < num_shards:
            raise CorruptIndexError(f"shard_id {shard} out of range (bundle has {num_shards} shards)",
                                    path=path, key=key)
        source = data_filename(prefix, shard, num_shards)
        if source not in new_ids:
            new_ids[source] = len(new_ids)
        renumbered[shard] = new_ids[source]
        fields[shard] = _shard_field(new_ids[source])
        return new_ids[source]

    known = merged.known
    heads = merged.heads
    for key, value in items:
        existing = entries.get(key)
        if existing is not None:
            if existing.__class__ is bytearray:  # merged.combine's usual case, inline
                seen = known.get(value)
                if seen is not None:
                    same = heads[key]
                    if seen[0] == len(same) and value.startswith(same):
                        existing += value[seen[1]:]  # type: ignore[operator]
                        continue
            merged.combine(key, value, prefix, path)
            continue
        laid = layout(value)
        if laid is None:  # off the protobuf layout: as a message
            entry = _parse(value, path, key)
            shard = renumbered.get(entry.shard_id)
            entry.shard_id = new_id(entry.shard_id, key) if shard is None else shard
            entries[key] = entry
            continue
        head, old, end, _ = laid
        shard = renumbered.get(old)
        if shard is None:
            shard = new_id(old, key)
        if shard != old:
            value = value[:head] + fields[old] + value[end:]
        entries[key] = value
