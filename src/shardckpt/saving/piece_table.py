"""A client's piece descriptions as they travel to the io client: one packed table of arrays.

Every client of a collective save describes its pieces (per key: dtype enum, global
shape, boxes; :func:`shardckpt.saving.agreement.describe_pieces`) and sends them to the
io client, which checks all of them (:mod:`.piece_check`). At 1 000 clients x 1 000
tensors that is 10^6 pieces, so the description is a table of columns the io client
reads with numpy, not a JSON object it would turn into 10^6 Python lists.

The table (all integers little-endian), zlib-compressed and base64-encoded (the
coordinator carries JSON)::

    b"SCPT"   magic, then u32 K (keys)
    u32[K]    the keys' lengths (UTF-8 bytes)       \\ the "key section": clients that hold
    bytes     the keys, concatenated, in table order / the same keys send the same bytes
    i32[K]    dtype enum per key
    u8[K]     number of dimensions per key (n_k)
    u32[K]    number of boxes per key (b_k)
    i64[...]  global shapes: n_k values per key, in key order
    i64[...]  boxes: per key, b_k boxes of n_k (start, stop) pairs

~4-5 bytes a piece for parameters sliced alike (the JSON of the same took ~84). Nothing
here is written to disk.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from ..errors import ShardingValidationError

__all__ = ["PieceTable", "pack_table", "unpack_table"]

_MAGIC = b"SCPT"
_HEAD = struct.Struct("<4sI")
_MAX_RANK = 255


@dataclass(frozen=True)
class PieceTable:
    """One client's decoded table: column arrays (read-only views of the decompressed bytes)."""

    key_section: bytes  #: the key lengths and key bytes, as sent (compared whole between clients)
    key_lengths: np.ndarray  #: u32[K]
    key_bytes: bytes  #: the keys, concatenated
    dtypes: np.ndarray  #: i32[K]
    ndims: np.ndarray  #: u8[K]
    nboxes: np.ndarray  #: u32[K]
    shapes: np.ndarray  #: i64[sum ndims]
    boxes: np.ndarray  #: i64[sum nboxes * ndims * 2]

    def __len__(self) -> int:
        return int(self.dtypes.shape[0])

    def keys(self) -> List[str]:
        """The keys, in table order (decoded)."""
        ends = np.cumsum(self.key_lengths, dtype=np.int64).tolist()
        starts = [0] + ends[:-1]
        try:
            return [self.key_bytes[a:b].decode("utf-8") for a, b in zip(starts, ends)]
        except UnicodeDecodeError as exc:
            raise ShardingValidationError(f"a key is not UTF-8 ({exc})") from None

    def entries(self, positions: Sequence[int]) -> List[Tuple[int, Tuple[int, ...], List[Tuple[Tuple[int, int], ...]]]]:
        """``(dtype, shape, boxes)`` of the keys at ``positions`` (Python ints), for messages."""
        nd = self.ndims.astype(np.int64)
        nb = self.nboxes.astype(np.int64)
        shape_at = np.concatenate(([0], np.cumsum(nd)))
        box_at = np.concatenate(([0], np.cumsum(nb * nd * 2)))
        out = []
        for i in positions:
            n, b = int(nd[i]), int(nb[i])
            shape = tuple(int(v) for v in self.shapes[shape_at[i]:shape_at[i] + n])
            flat = [int(v) for v in self.boxes[box_at[i]:box_at[i] + 2 * n * b]]
            boxes: List[Tuple[Tuple[int, int], ...]] = [()] * b  # a scalar's boxes have no dimensions
            if n:
                boxes = [tuple((flat[j + 2 * d], flat[j + 2 * d + 1]) for d in range(n))
                         for j in range(0, 2 * n * b, 2 * n)]
            out.append((int(self.dtypes[i]), shape, boxes))
        return out


def pack_table(described: Mapping[str, Sequence[Any]]) -> str:
    """``{key: [dtype enum, global shape, [box, ...]]}`` as a packed table (see the module docstring)."""
    keys = [k.encode("utf-8") for k in described]
    values = list(described.values())
    ndims = [len(shape) for _, shape, _ in values]
    if any(n > _MAX_RANK for n in ndims):
        raise ShardingValidationError(f"a piece has more than {_MAX_RANK} dimensions")
    for key, (n, (_, _, boxes)) in zip(described, zip(ndims, values)):
        if any(len(box) != n or any(len(pair) != 2 for pair in box) for box in boxes):
            raise ShardingValidationError(f"key {key!r}: a box is not {n} (start, stop) pairs (its global shape's "
                                          "rank)")
    try:
        parts = [_HEAD.pack(_MAGIC, len(keys)),
                 np.asarray([len(k) for k in keys], dtype="<u4").tobytes(), b"".join(keys),
                 np.asarray([int(d) for d, _, _ in values], dtype="<i4").tobytes(),
                 np.asarray(ndims, dtype="<u1").tobytes(),
                 np.asarray([len(boxes) for _, _, boxes in values], dtype="<u4").tobytes(),
                 np.asarray([int(v) for _, shape, _ in values for v in shape], dtype="<i8").tobytes(),
                 np.asarray([int(v) for _, _, boxes in values for box in boxes for pair in box for v in pair],
                            dtype="<i8").tobytes()]
    except OverflowError as exc:
        raise ShardingValidationError(f"piece descriptions hold a number out of range ({exc})") from None
    return base64.b64encode(zlib.compress(b"".join(parts), 6)).decode("ascii")


def unpack_table(packed: str) -> PieceTable:
    """What :func:`pack_table` packed; :class:`ShardingValidationError` when it is not such a table."""
    try:
        raw = zlib.decompress(base64.b64decode(packed, validate=True))
    except (ValueError, TypeError, binascii.Error, zlib.error) as exc:
        raise ShardingValidationError(f"piece descriptions do not decode ({exc})") from None
    if len(raw) < _HEAD.size:
        raise ShardingValidationError("piece descriptions do not decode (truncated table)")
    magic, k = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        raise ShardingValidationError("piece descriptions do not decode (not a piece table)")
    at = _HEAD.size

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal at
        size = np.dtype(dtype).itemsize * count
        if count < 0 or at + size > len(raw):
            raise ShardingValidationError("piece descriptions do not decode (truncated table)")
        out = np.frombuffer(raw, dtype=dtype, count=count, offset=at)
        at += size
        return out

    section_start = at
    key_lengths = take("<u4", k)
    key_total = int(key_lengths.sum(dtype=np.int64))
    key_bytes = take("u1", key_total).tobytes()
    key_section = raw[section_start:at]
    dtypes = take("<i4", k)
    ndims = take("<u1", k)
    nboxes = take("<u4", k)
    nd = ndims.astype(np.int64)
    shapes = take("<i8", int(nd.sum()))
    boxes = take("<i8", int((nboxes.astype(np.int64) * nd).sum()) * 2)
    if at != len(raw):
        raise ShardingValidationError(f"piece descriptions do not decode ({len(raw) - at} bytes after the table)")
    return PieceTable(key_section, key_lengths, key_bytes, dtypes, ndims, nboxes, shapes, boxes)


def table_as_dict(table: PieceTable) -> Dict[str, List[Any]]:
    """``{key: [dtype enum, global shape, [box, ...]]}`` (lists, as :func:`pack_table` takes it)."""
    out: Dict[str, List[Any]] = {}
    for key, (dtype, shape, boxes) in zip(table.keys(), table.entries(range(len(table)))):
        if key in out:
            raise ShardingValidationError(f"piece descriptions name key {key!r} twice")
        out[key] = [dtype, list(shape), [[list(pair) for pair in box] for box in boxes]]
    return out
