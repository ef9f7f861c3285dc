"""Fuzz the bundle reader: an input is an index file and one data file (see ``_common.pack_files``).

For every key (at most 32) the harness reads the whole tensor, a leading-corner region,
a strided-column region (several runs), the raw bytes of each piece and ``verify``;
then ``restore_tensors`` of all keys. The same keys are then read by name through a reader
that does not load the index (``load_index=False``: lookups through the index block), and
its ``keys()``. Outcome rule: values, or ``shardckpt.errors``.
"""

from __future__ import annotations

import os

import _common
import atheris

with atheris.instrument_imports(include=["shardckpt"]):
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.restoring import restore_tensors
    from shardckpt.storage.location import Location

_MAX_KEYS = 32


def _regions(shape: tuple) -> list:
    corner = tuple((0, (d + 1) // 2) for d in shape)
    column = None
    if shape and shape[-1]:
        column = tuple((0, d) for d in shape[:-1]) + ((shape[-1] // 3, shape[-1] // 3 + 1),)
    return [r for r in (corner, column) if r is not None]


def _exercise(prefix: str) -> list:
    with BundleReader(Location.of(prefix)) as reader:
        keys = reader.keys()[:_MAX_KEYS]
        for key in keys:
            _common.allowed(reader.read, key)
            shape = _common.allowed(reader.shape, key)
            for region in _regions(shape) if shape is not None else []:
                _common.allowed(reader.read_region, key, region)
            pieces = _common.allowed(reader.pieces, key) or []
            for piece in pieces:
                _common.allowed(reader.raw_bytes, piece)
            _common.allowed(reader.verify, key)
        _common.allowed(restore_tensors, prefix, [k.decode("utf-8", "replace") for k in keys], reader=reader)
    return keys


def _exercise_lazily(prefix: str, keys: list) -> None:
    with BundleReader(Location.of(prefix), load_index=False) as reader:
        for key in keys + [b"", b"\x00", b"\xff" * 3]:
            _common.allowed(reader.read, key)
            _common.allowed(reader.__contains__, key)
        reader.keys()


def test_one_input(data: bytes) -> None:
    index, shard = _common.unpack_files(data, 2)
    prefix = os.path.join(_common.scratch(), "ck")
    _common.write(prefix + ".index", index)
    _common.write(prefix + ".data-00000-of-00001", shard)
    keys = _common.allowed(_exercise, prefix) or []
    _common.allowed(_exercise_lazily, prefix, keys)


if __name__ == "__main__":
    _common.main(test_one_input)
