"""What clients send each other in a save's all-gathers, packed: index entries (object-store commits) and
piece descriptions (the agreement check). Every client receives every client's, so their size per
entry is what a save at 1 000 clients moves."""

from __future__ import annotations

from typing import Dict

import pytest
from helpers.reference_pieces import pieces_problem

from shardckpt.errors import CorruptIndexError, ShardingValidationError
from shardckpt.format.protos import tensor_bundle_pb2 as pb
from shardckpt.saving.agreement import pack_pieces, unpack_pieces
from shardckpt.saving.commit.index_last import _decode_entries, _encode_entries, encode_pairs

KEYS = [f"model/layer_{i // 16}/w{i % 16}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(1000)]


def test_gathered_entries_round_trip_compactly() -> None:
    entries: Dict[bytes, pb.BundleEntryProto] = {}
    for i, key in enumerate(KEYS):
        entry = pb.BundleEntryProto(dtype=pb.DT_FLOAT, shard_id=517, offset=32 * i, size=32, crc32c=0x12345678 + i)
        entry.shape.dim.add(size=2)
        entry.shape.dim.add(size=4)
        entries[key.encode()] = entry
    text = _encode_entries(entries)
    assert _decode_entries(text) == sorted((k, e.SerializeToString()) for k, e in entries.items())
    assert len(text) / len(entries) < 20  # JSON pairs of base64 strings took ~106 bytes an entry
    with pytest.raises(CorruptIndexError, match="gathered"):
        _decode_entries(text[:-8] + "AAAAAAA=", "<gathered>")
    with pytest.raises(CorruptIndexError, match="gathered"):
        _decode_entries("not base64!", "<gathered>")
    assert _decode_entries(encode_pairs([])) == []


def test_piece_descriptions_round_trip_compactly() -> None:
    described = {key: [1, [2048, 4], [[[2 * 7, 2 * 8], [0, 4]]]] for key in KEYS}
    packed = pack_pieces(described)
    assert unpack_pieces(packed) == described
    assert len(packed) / len(described) < 10  # as JSON: ~84 bytes a piece
    other = {key: [1, [2048, 4], [[[0, 2 * 7], [0, 4]], [[2 * 8, 2048], [0, 4]]]] for key in KEYS}
    assert pieces_problem([unpack_pieces(packed), unpack_pieces(pack_pieces(other))]) is None
    with pytest.raises(ShardingValidationError, match="do not decode"):
        unpack_pieces(packed[:-8])
    with pytest.raises(ShardingValidationError, match="not a mapping"):
        unpack_pieces(pack_pieces([]))  # type: ignore[arg-type]
