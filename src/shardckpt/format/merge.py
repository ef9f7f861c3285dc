"""Merging bundle indexes: the pure part of TensorFlow's ``MergeV2Checkpoints``.

Nothing here moves or writes a file (that is commit policy: see
:mod:`shardckpt.saving.commit`). What is here:

* :func:`read_index` — a bundle's header and raw entries; :func:`read_index_header`
  reads only the header entry (three small reads, whatever the index's size);
* :func:`plan_merge` — combine several bundles' entries: each input's data files get
  new shard ids in order of first use; slices of one tensor spread over several
  inputs are combined; a key stored whole in two inputs is an error;
* :func:`merge_entries` — the same for entries held in memory;
* :func:`index_bytes` — the ``.index`` file of merged entries.

``num_shards`` of a merge is the number of data files its entries use; for inputs
that all hold entries (every save does) this is TensorFlow's sum of the inputs'
``num_shards``. (For an input with no entries TensorFlow counts a data file it never
renames, and its result cannot be read.)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import AlreadyExistsError, CorruptIndexError, InvalidArgumentError
from ..storage.base import FileSystem
from . import sstable
from .bundle_writer import make_header
from .naming import data_filename, index_filename
from .protos import tensor_bundle_pb2 as pb
from .sstable import TableWriter, read_table

__all__ = ["merge_entries", "index_bytes", "read_index", "read_index_header", "plan_merge", "MergePlan",
           "MergeInput"]


def _combine(merged: Dict[bytes, pb.BundleEntryProto], key: bytes, entry: pb.BundleEntryProto,
             source: str, path: Optional[str] = None) -> bool:
    """Add ``entry`` to ``merged``; False when it only added slices to an existing entry."""
    existing = merged.get(key)
    if existing is None:
        merged[key] = entry
        return True
    if not existing.slices or not entry.slices:
        raise AlreadyExistsError(f"duplicate tensor encountered when merging prefix {source}",
                                 path=path or source, key=key)
    if existing.dtype != entry.dtype or existing.shape != entry.shape:
        raise InvalidArgumentError("slices of one tensor disagree on dtype or shape across "
                                   f"merged prefix {source}", path=path or source, key=key)
    existing.slices.extend(entry.slices)
    return False


def merge_entries(parts: Iterable[Tuple[str, Iterable[Tuple[bytes, pb.BundleEntryProto]]]]
                  ) -> Dict[bytes, pb.BundleEntryProto]:
    """Merge bundle entries held in memory (object-store saves), by the rules of :func:`merge_bundles`.

    ``parts`` are ``(name, entries)`` whose ``shard_id`` already is the merged
    bundle's; slices of one tensor combine, a key stored whole twice is an error.
    """
    merged: Dict[bytes, pb.BundleEntryProto] = {}
    for name, entries in parts:
        for key, entry in entries:
            _combine(merged, key, entry, name)
    return merged


def index_bytes(entries: Dict[bytes, pb.BundleEntryProto], num_shards: int, big_endian: bool = False) -> bytes:
    """The ``.index`` file of a bundle with ``entries`` and ``num_shards`` data files."""
    table = TableWriter()
    table.add(b"", make_header(num_shards, big_endian))
    for key in sorted(entries):
        table.add(key, entries[key].SerializeToString())
    return table.finish()


def _parse_header(key: bytes, value: bytes, path: str) -> pb.BundleHeaderProto:
    if key != b"":
        raise CorruptIndexError("index has no header entry", path=path)
    header = pb.BundleHeaderProto()
    try:
        header.ParseFromString(value)
    except Exception:
        raise CorruptIndexError("unparsable bundle header", path=path) from None
    return header


def read_index(prefix: str, fs: FileSystem) -> Tuple[pb.BundleHeaderProto, List[Tuple[bytes, bytes]]]:
    """The header and the ``(key, serialized entry)`` pairs of the bundle at ``prefix``."""
    path = index_filename(prefix)
    items = list(read_table(fs.read_bytes(path), path))
    if not items:
        raise CorruptIndexError("index has no header entry", path=path)
    return _parse_header(items[0][0], items[0][1], path), items[1:]


def _read_block_at(fs: FileSystem, handle: object, path: str, offset: int, size: int, what: str) -> bytes:
    buf = bytearray(size + sstable.BLOCK_TRAILER_SIZE)
    fs.pread_into(handle, memoryview(buf), offset, path)
    # the block reader checks bounds against a whole file: give it the block, its trailer and room for a footer
    return sstable._read_block(bytes(buf) + bytes(sstable.FOOTER_SIZE), 0, size, path, what)


_SMALL_INDEX = 1 << 20


def read_index_header(prefix: str, fs: FileSystem) -> pb.BundleHeaderProto:
    """Only the header entry of ``<prefix>.index``: the footer, the index block and the first data block.

    The header is the table's first entry (its key, ``""``, sorts first), so a large
    index is never read whole. Errors are :class:`~shardckpt.errors.CorruptIndexError`.
    """
    path = index_filename(prefix)
    total = fs.size(path)
    if total < sstable.FOOTER_SIZE:
        raise CorruptIndexError(f"index is {total} bytes, shorter than the {sstable.FOOTER_SIZE}-byte footer "
                                "(truncated?)", path=path)
    if total <= _SMALL_INDEX:  # one request (object stores): the first entry parses without the rest
        for key, value in read_table(fs.read_bytes(path), path):
            return _parse_header(key, value, path)
        raise CorruptIndexError("index has no header entry", path=path)
    handle = fs.open_read(path)
    try:
        footer = bytearray(sstable.FOOTER_SIZE)
        fs.pread_into(handle, memoryview(footer), total - sstable.FOOTER_SIZE, path)
        (magic,) = struct.unpack_from("<Q", footer, 40)
        if magic != sstable.TABLE_MAGIC:
            raise CorruptIndexError(f"bad magic number 0x{magic:016x} (not a tensor-bundle index)", path=path)
        _, _, pos = sstable._decode_handle(bytes(footer), 0, 40, path)
        index_offset, index_size, _ = sstable._decode_handle(bytes(footer), pos, 40, path)
        if index_offset + index_size + sstable.BLOCK_TRAILER_SIZE > total - sstable.FOOTER_SIZE:
            raise CorruptIndexError(f"index block [{index_offset}, {index_offset + index_size}) lies outside "
                                    f"the file ({total} bytes)", path=path)
        index_block = _read_block_at(fs, handle, path, index_offset, index_size, "index")
        for _, value in sstable._iter_block(index_block, path, "index"):
            offset, size, _ = sstable._decode_handle(value, 0, len(value), path)
            if offset + size + sstable.BLOCK_TRAILER_SIZE > total - sstable.FOOTER_SIZE:
                raise CorruptIndexError(f"data block [{offset}, {offset + size}) lies outside the file "
                                        f"({total} bytes)", path=path)
            block = _read_block_at(fs, handle, path, offset, size, "data")
            for key, entry in sstable._iter_block(block, path, "data"):
                return _parse_header(key, entry, path)
            break
    finally:
        fs.close(handle)
    raise CorruptIndexError("index has no header entry", path=path)


MergeInput = Tuple[str, pb.BundleHeaderProto, Sequence[Tuple[bytes, bytes]]]


@dataclass(frozen=True)
class MergePlan:
    """What a merge produces: the merged entries (shard ids renumbered) and where each data file goes.

    ``sources`` lists the inputs' data files in order of first use: source ``i``
    becomes shard ``i`` of the merged bundle. ``big_endian`` is the inputs' byte order.
    """

    entries: Dict[bytes, pb.BundleEntryProto]
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
    entries parse, no key stored whole twice) before any caller moves a file.
    """
    merged: Dict[bytes, pb.BundleEntryProto] = {}
    new_ids: Dict[str, int] = {}
    first: Optional[pb.BundleHeaderProto] = None
    for prefix, header, items in inputs:
        path = index_filename(prefix)
        if not 1 <= header.num_shards <= 1 << 24:
            raise CorruptIndexError(f"bad num_shards {header.num_shards} in header", path=path)
        if first is None:
            first = header
        elif header.endianness != first.endianness or \
                header.version.SerializeToString() != first.version.SerializeToString():
            raise InvalidArgumentError("merge inputs disagree on endianness or version", path=path)
        for key, value in items:
            entry = pb.BundleEntryProto()
            try:
                entry.ParseFromString(value)
            except Exception:
                raise CorruptIndexError("unparsable entry", path=path, key=key) from None
            if key in merged:
                _combine(merged, key, entry, prefix, path)
                continue
            # As in TF, the full entry of a sliced tensor gets its bundle's shard id too
            # (meaningless, ignored by readers), so merged indexes are byte-identical.
            if not 0 <= entry.shard_id < header.num_shards:
                raise CorruptIndexError(f"shard_id {entry.shard_id} out of range (bundle has "
                                        f"{header.num_shards} shards)", path=path, key=key)
            source = data_filename(prefix, entry.shard_id, header.num_shards)
            if source not in new_ids:
                new_ids[source] = len(new_ids)
            entry.shard_id = new_ids[source]
            merged[key] = entry
    if first is None:
        raise InvalidArgumentError("merge needs at least one input bundle")
    return MergePlan(merged, list(new_ids), first.endianness == pb.BundleHeaderProto.BIG)


