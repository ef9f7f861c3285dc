"""Encoding of DT_STRING and DT_VARIANT tensor data, with TF's checksum rules.

A string tensor of ``n`` elements is stored as::

    varint64 len[0] ... len[n-1]   uint32 mask(crc of lengths)   bytes s[0] ... s[n-1]

The checksums are computed over each length as a fixed-width little-endian
uint32 (uint64 above 2**32-1), not over the varint bytes: the length checksum
covers the lengths; the entry checksum is one running CRC over the lengths, the
4 stored checksum bytes and the string bytes.
"""

from __future__ import annotations

import struct
from typing import List, Sequence, Tuple

import numpy as np

from ..errors import DataLossError, InvalidArgumentError
from . import crc, varint

__all__ = ["encode_strings", "decode_strings", "decode_variants", "as_bytes_elements"]

_U32_MAX = 0xFFFFFFFF


def as_bytes_elements(array: np.ndarray) -> List[bytes]:
    """Row-major list of the elements of a string array as ``bytes`` (``str`` is UTF-8 encoded)."""
    out = []
    for item in np.asarray(array, dtype=object).reshape(-1):
        if isinstance(item, bytes):
            out.append(item)
        elif isinstance(item, str):
            try:
                out.append(item.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError(f"string tensor element {item[:64]!r} is not valid Unicode text "
                                           f"({exc.reason}); strings are stored as UTF-8") from None
        elif isinstance(item, (bytearray, memoryview, np.bytes_)):
            out.append(bytes(item))
        else:
            raise TypeError(f"string tensor element of type {type(item).__name__}; expected bytes or str")
    return out


def _length_word(n: int, big_endian: bool) -> bytes:
    order = ">" if big_endian else "<"
    return struct.pack(order + ("I" if n <= _U32_MAX else "Q"), n)


def encode_strings(elements: Sequence[bytes], *, big_endian: bool = False) -> Tuple[bytes, int]:
    """Encode the elements; return ``(data, masked entry crc32c)``.

    ``big_endian`` writes what a big-endian host writes: the length words that are
    checksummed, and the stored length checksum, are big-endian.
    """
    lengths = bytearray()
    running = 0
    for item in elements:
        lengths += varint.encode(len(item))
        running = crc.extend(running, _length_word(len(item), big_endian))
    length_checksum = struct.pack(">I" if big_endian else "<I", crc.mask(running))
    running = crc.extend(running, length_checksum)
    parts = [bytes(lengths), length_checksum]
    for item in elements:
        parts.append(item)
        running = crc.extend(running, item)
    return b"".join(parts), crc.mask(running)


def decode_strings(data: bytes, count: int, stored_crc: int, *, big_endian: bool = False) -> List[bytes]:
    """Decode ``count`` strings from an entry's ``data``, checking both checksums."""
    if len(data) < count + 4:
        raise DataLossError(f"string tensor of {count} elements needs at least {count + 4} bytes, "
                            f"entry has {len(data)}")
    pos = 0
    lengths = []
    running = 0
    try:
        for _ in range(count):
            n, pos = varint.decode(data, pos, len(data))
            if n > len(data):
                raise DataLossError(f"string element of {n} bytes in an entry of {len(data)} bytes")
            lengths.append(n)
            running = crc.extend(running, _length_word(n, big_endian))
    except DataLossError:
        raise
    except Exception:
        raise DataLossError("truncated string lengths") from None
    if pos + 4 > len(data):
        raise DataLossError("truncated string length checksum")
    (length_checksum,) = struct.unpack_from(">I" if big_endian else "<I", data, pos)
    if crc.unmask(length_checksum) != running:
        raise DataLossError("string length checksum does not match")
    running = crc.extend(running, data[pos:pos + 4])
    pos += 4
    if pos + sum(lengths) != len(data):
        raise DataLossError(f"string lengths add up to {pos + sum(lengths)} bytes, entry has {len(data)}")
    out = []
    for n in lengths:
        item = data[pos:pos + n]
        out.append(item)
        pos += n
    running = crc.extend(running, memoryview(data)[len(data) - sum(lengths):])
    if running != crc.unmask(stored_crc):
        raise DataLossError(f"checksum does not match (stored 0x{crc.unmask(stored_crc):08x}, "
                            f"computed 0x{running:08x})")
    return out


def decode_variants(data: bytes, count: int, stored_crc: int) -> List[bytes]:
    """Decode ``count`` DT_VARIANT elements (serialized ``VariantTensorDataProto`` each)."""
    pos = 0
    running = 0
    out = []
    for _ in range(count):
        try:
            n, new_pos = varint.decode(data, pos, len(data))
        except Exception:
            raise DataLossError("truncated variant length") from None
        if n > len(data):  # also keeps n within the 64 bits the checksum covers
            raise DataLossError(f"variant element of {n} bytes in an entry of {len(data)} bytes")
        running = crc.extend(running, struct.pack("<Q", n))
        pos = new_pos
        if pos + n + 4 > len(data):
            raise DataLossError("truncated variant element")
        payload = data[pos:pos + n]
        running = crc.extend(running, payload)
        pos += n
        (elem_crc,) = struct.unpack_from("<I", data, pos)
        if crc.unmask(elem_crc) != running:
            raise DataLossError("variant element checksum does not match")
        running = crc.extend(running, data[pos:pos + 4])
        pos += 4
        out.append(payload)
    if pos != len(data) or running != crc.unmask(stored_crc):
        raise DataLossError("variant tensor checksum does not match")
    return out
