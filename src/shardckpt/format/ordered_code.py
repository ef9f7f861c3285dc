"""TensorFlow's ``OrderedCode`` pieces and the slice-key encoding built from them.

A slice of tensor ``name`` is stored under::

    NumIncreasing(0) + String(name) + NumIncreasing(rank)
    + for each dim: SignedNumIncreasing(start) + SignedNumIncreasing(length)

where a whole dimension is (start 0, length -1). The leading ``0x00`` makes every
slice key sort after the header key ``""`` and before all ordinary keys.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from ..errors import InvalidArgumentError

__all__ = ["encode_tensor_name_slice", "decode_tensor_name_slice", "is_slice_key",
           "write_num_increasing", "write_signed_num_increasing"]


def write_num_increasing(value: int) -> bytes:
    if value < 0 or value >= 1 << 64:
        raise InvalidArgumentError(f"NumIncreasing out of range: {value}")
    body = value.to_bytes(8, "big").lstrip(b"\x00")
    return bytes((len(body),)) + body


def _escape(data: bytes) -> bytes:
    if b"\x00" not in data and b"\xff" not in data:
        return bytes(data)
    out = bytearray()
    for byte in data:
        if byte == 0x00:
            out += b"\x00\xff"
        elif byte == 0xFF:
            out += b"\xff\x00"
        else:
            out.append(byte)
    return bytes(out)


def write_signed_num_increasing(value: int) -> bytes:
    if not -(1 << 63) <= value < (1 << 63):
        raise InvalidArgumentError(f"SignedNumIncreasing out of range: {value}")
    magnitude = ~value if value < 0 else value
    n = magnitude.bit_length() // 7 + 1
    raw = (value & ((1 << (8 * n)) - 1)).to_bytes(n, "big")
    # XOR the top n bits (spread over the first one or two bytes) with ones.
    top_mask = ((1 << n) - 1) << (8 * n - n)
    return (int.from_bytes(raw, "big") ^ top_mask).to_bytes(n, "big")


def encode_tensor_name_slice(name: bytes, extents: Sequence[Tuple[int, int]]) -> bytes:
    """Key of a slice of ``name``; ``extents`` are ``(start, length)``, length -1 = whole dim."""
    parts = [write_num_increasing(0), _escape(name) + b"\x00\x01", write_num_increasing(len(extents))]
    for start, length in extents:
        parts.append(write_signed_num_increasing(start))
        parts.append(write_signed_num_increasing(length))
    return b"".join(parts)


def is_slice_key(key: bytes) -> bool:
    return key[:1] == b"\x00"


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise InvalidArgumentError("truncated slice key")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


def _read_num_increasing(cur: _Cursor) -> int:
    n = cur.take(1)[0]
    if n > 8:
        raise InvalidArgumentError("bad NumIncreasing length in slice key")
    return int.from_bytes(cur.take(n), "big")


def _read_string(cur: _Cursor) -> bytes:
    out = bytearray()
    while True:
        byte = cur.take(1)[0]
        if byte == 0x00:
            nxt = cur.take(1)[0]
            if nxt == 0x01:
                return bytes(out)
            if nxt != 0xFF:
                raise InvalidArgumentError("bad escape in slice key")
            out.append(0x00)
        elif byte == 0xFF:
            if cur.take(1)[0] != 0x00:
                raise InvalidArgumentError("bad escape in slice key")
            out.append(0xFF)
        else:
            out.append(byte)


def _read_signed_num_increasing(cur: _Cursor) -> int:
    first = cur.data[cur.pos:cur.pos + 2]
    if not first:
        raise InvalidArgumentError("truncated slice key")
    negative = not first[0] & 0x80
    inv = 0xFF if negative else 0x00
    word = ((first[0] ^ inv) << 8) | ((first[1] ^ inv) if len(first) > 1 else 0)
    n = 0
    while n < 10 and n < 16 and word & (0x8000 >> n):
        n += 1
    n = min(n, 10)
    if n == 0:
        raise InvalidArgumentError("bad SignedNumIncreasing in slice key")
    raw = int.from_bytes(cur.take(n), "big")
    top_mask = ((1 << n) - 1) << (8 * n - n)
    raw ^= top_mask
    if negative:
        raw -= 1 << (8 * n)
    return raw


def decode_tensor_name_slice(key: bytes) -> Tuple[bytes, List[Tuple[int, int]]]:
    """Inverse of :func:`encode_tensor_name_slice`."""
    cur = _Cursor(key)
    if _read_num_increasing(cur) != 0:
        raise InvalidArgumentError("not a slice key")
    name = _read_string(cur)
    rank = _read_num_increasing(cur)
    extents = [(_read_signed_num_increasing(cur), _read_signed_num_increasing(cur)) for _ in range(rank)]
    if cur.pos != len(key):
        raise InvalidArgumentError("trailing bytes in slice key")
    return name, extents
