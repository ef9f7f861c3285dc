"""Protobuf-style base-128 varints, as used by the SSTable and string tensors."""

from __future__ import annotations

from ..errors import CorruptIndexError

__all__ = ["encode", "decode"]


def encode(value: int) -> bytes:
    """Encode a non-negative integer as a varint."""
    if value < 0:
        raise ValueError(f"varint of a negative value {value}")
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode(buf: "bytes | bytearray | memoryview", pos: int, limit: int, max_bytes: int = 10) -> "tuple[int, int]":
    """Decode a varint at ``buf[pos:limit]``; return ``(value, new_pos)``.

    Raises :class:`CorruptIndexError` on a truncated or over-long varint; callers
    that know the file re-raise it with their own context.
    """
    result = 0
    shift = 0
    end = min(limit, pos + max_bytes)
    while pos < end:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise CorruptIndexError("truncated or over-long varint")
