"""A client's piece descriptions as they travel to the io client: one packed table of arrays.

Every client of a collective save describes its pieces (per key: dtype enum, global
shape, boxes; :func:`shardckpt.saving.agreement.describe_pieces`) and sends them to the
io client, which checks all of them (:mod:`.piece_check`). At 1 000 clients x 1 000
tensors that is 10^6 pieces, so the description is a table of columns the io client
reads with numpy, not a JSON object it would turn into 10^6 Python lists.

The table travels as base64 (the coordinator carries JSON) of (integers little-endian)::

    b"SCPT"   magic;  u32 K (keys);  u32 Z (bytes of the compressed key stream)
    Z bytes   the key stream, zlib'd:  u32[K] the keys' lengths (UTF-8 bytes), then the keys,
              concatenated, in table order. Clients that hold the same keys send the same
              bytes here, so the io client decodes them once (it compares the compressed bytes)
    rest      the column stream, zlib'd:
                i32[K]    dtype enum per key
                u8[K]     number of dimensions per key (n_k)
                u32[K]    number of boxes per key (b_k)
                u8        width W of the next two columns: 4 (i32) or 8 (i64)
                iW[...]   global shapes: n_k values per key, in key order
                iW[...]   boxes: per key, b_k boxes of n_k (start, stop) pairs

~4 bytes a piece for parameters sliced alike (the JSON of the same took ~84). Nothing
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
from ..format.bundle_writer import encode_key

__all__ = ["PieceTable", "pack_table", "unpack_table"]

_MAGIC = b"SCPT"
_HEAD = struct.Struct("<4sII")
_MAX_RANK = 255


@dataclass(frozen=True)
class PieceTable:
    """One client's decoded table: column arrays (read-only views of the decompressed bytes)."""

    key_section: bytes  #: the compressed key stream, as sent (compared whole between clients)
    dtypes: np.ndarray  #: i32[K]
    ndims: np.ndarray  #: u8[K]
    nboxes: np.ndarray  #: u32[K]
    shapes: np.ndarray  #: i32 or i64 [sum ndims]
    boxes: np.ndarray  #: i32 or i64 [sum nboxes * ndims * 2]

    def __len__(self) -> int:
        return int(self.dtypes.shape[0])

    def keys(self) -> List[str]:
        """The keys, in table order (decoded from the key stream)."""
        k = len(self)
        try:
            raw = zlib.decompress(self.key_section)
        except zlib.error as exc:
            raise ShardingValidationError(f"piece descriptions do not decode (keys: {exc})") from None
        if len(raw) < 4 * k:
            raise ShardingValidationError("piece descriptions do not decode (truncated keys)")
        ends = np.cumsum(np.frombuffer(raw, "<u4", count=k), dtype=np.int64)
        if (ends[-1] if k else 0) != len(raw) - 4 * k:
            raise ShardingValidationError("piece descriptions do not decode (key lengths do not add up)")
        text = raw[4 * k:]
        starts = [0] + ends[:-1].tolist()
        try:
            return [text[a:b].decode("utf-8") for a, b in zip(starts, ends.tolist())]
        except UnicodeDecodeError as exc:
            raise ShardingValidationError(f"piece descriptions do not decode (a key is not UTF-8: {exc})") from None

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
    keys = [encode_key(k) for k in described]
    values = list(described.values())
    ndims = [len(shape) for _, shape, _ in values]
    if any(n > _MAX_RANK for n in ndims):
        raise ShardingValidationError(f"a piece has more than {_MAX_RANK} dimensions")
    for key, (n, (_, _, boxes)) in zip(described, zip(ndims, values)):
        if any(len(box) != n or any(len(pair) != 2 for pair in box) for box in boxes):
            raise ShardingValidationError(f"key {key!r}: a box is not {n} (start, stop) pairs (its global shape's "
                                          "rank)")
    try:
        shapes = np.asarray([int(v) for _, shape, _ in values for v in shape], dtype=np.int64)
        boxes = np.asarray([int(v) for _, _, bs in values for box in bs for pair in box for v in pair], dtype=np.int64)
    except OverflowError as exc:
        raise ShardingValidationError(f"piece descriptions hold a number out of range ({exc})") from None
    narrow = all(a.shape[0] == 0 or (int(a.min()) >= -2**31 and int(a.max()) < 2**31) for a in (shapes, boxes))
    width = "<i4" if narrow else "<i8"
    key_stream = zlib.compress(np.asarray([len(k) for k in keys], dtype="<u4").tobytes() + b"".join(keys), 6)
    columns = zlib.compress(b"".join([
        np.asarray([int(d) for d, _, _ in values], dtype="<i4").tobytes(),
        np.asarray(ndims, dtype="<u1").tobytes(),
        np.asarray([len(bs) for _, _, bs in values], dtype="<u4").tobytes(),
        bytes([np.dtype(width).itemsize]),
        shapes.astype(width).tobytes(), boxes.astype(width).tobytes()]), 6)
    return base64.b64encode(_HEAD.pack(_MAGIC, len(keys), len(key_stream)) + key_stream + columns).decode("ascii")


def unpack_table(packed: str) -> PieceTable:
    """What :func:`pack_table` packed; :class:`ShardingValidationError` when it is not such a table.

    The key stream stays compressed (:meth:`PieceTable.keys` decodes it when asked)."""
    try:
        raw = base64.b64decode(packed, validate=True)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise ShardingValidationError(f"piece descriptions do not decode ({exc})") from None
    if len(raw) < _HEAD.size:
        raise ShardingValidationError("piece descriptions do not decode (truncated table)")
    magic, k, z = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        raise ShardingValidationError("piece descriptions do not decode (not a piece table)")
    if _HEAD.size + z > len(raw):
        raise ShardingValidationError("piece descriptions do not decode (truncated table)")
    key_section = raw[_HEAD.size:_HEAD.size + z]
    try:
        cols = zlib.decompress(raw[_HEAD.size + z:])
    except zlib.error as exc:
        raise ShardingValidationError(f"piece descriptions do not decode ({exc})") from None
    at = 0

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal at
        size = np.dtype(dtype).itemsize * count
        if at + size > len(cols):
            raise ShardingValidationError("piece descriptions do not decode (truncated table)")
        out = np.frombuffer(cols, dtype=dtype, count=count, offset=at)
        at += size
        return out

    dtypes = take("<i4", k)
    ndims = take("<u1", k)
    nboxes = take("<u4", k)
    code = int(take("u1", 1)[0])
    if code not in (4, 8):
        raise ShardingValidationError(f"piece descriptions do not decode (integer width {code})")
    width = f"<i{code}"
    nd = ndims.astype(np.int64)
    shapes = take(width, int(nd.sum()))
    boxes = take(width, int((nboxes.astype(np.int64) * nd).sum()) * 2)
    if at != len(cols):
        raise ShardingValidationError(f"piece descriptions do not decode ({len(cols) - at} bytes after the table)")
    return PieceTable(key_section, dtypes, ndims, nboxes, shapes, boxes)


def table_as_dict(table: PieceTable) -> Dict[str, List[Any]]:
    """``{key: [dtype enum, global shape, [box, ...]]}`` (lists, as :func:`pack_table` takes it)."""
    out: Dict[str, List[Any]] = {}
    for key, (dtype, shape, boxes) in zip(table.keys(), table.entries(range(len(table)))):
        if key in out:
            raise ShardingValidationError(f"piece descriptions name key {key!r} twice")
        out[key] = [dtype, list(shape), [[list(pair) for pair in box] for box in boxes]]
    return out
