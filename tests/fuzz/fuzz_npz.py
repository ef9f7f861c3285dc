"""Fuzz the ``.npz`` reader: an input is one ``.npz`` (zip) archive.

The harness opens it (``NpzSource``: the zip directory and every ``.npy`` member's
header), then reads every array (at most 32) and converts the archive to a tensor
bundle. Outcome rule: values, or ``shardckpt.errors``; never pickle, never an
allocation larger than the archive justifies (a member's declared size is checked
against its stored size before anything is inflated).
"""

from __future__ import annotations

import os
import shutil

import _common
import atheris

with atheris.instrument_imports(include=["shardckpt"]):
    from shardckpt.convert import convert
    from shardckpt.convert.npz import NpzSource

_MAX_ARRAYS = 32


def _exercise(path: str) -> None:
    src = NpzSource(path)
    try:
        for info in src.tensors()[:_MAX_ARRAYS]:
            _common.allowed(src.read, info.name)
    finally:
        src.close()


def test_one_input(data: bytes) -> None:
    folder = _common.scratch()
    path = os.path.join(folder, "x.npz")
    _common.write(path, data)
    _common.allowed(_exercise, path)
    out = os.path.join(folder, "npz-out")
    shutil.rmtree(out, ignore_errors=True)
    _common.allowed(convert, path, out, src_format="npz", dst_format="tf")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    _common.main(test_one_input)
