"""Fuzz the safetensors reader: an input is one ``.safetensors`` file.

The harness opens it (``SafetensorsSource``: header parse and checks), then for every
tensor (at most 32) reads it whole, reads its first row (``read_rows``) and reads it
into a buffer the size its header promises (``read_into``, as the converter does);
finally it converts the file to a tensor bundle (string tensors kept in ``__metadata__``
become tensors again) and to ``.npz`` (values read into the converter's reused buffer).
Outcome rule: values, or ``shardckpt.errors``.
"""

from __future__ import annotations

import os
import shutil

import _common
import atheris

with atheris.instrument_imports(include=["shardckpt"]):
    import numpy as np

    from shardckpt.convert import convert
    from shardckpt.convert.safetensors import SafetensorsSource

_MAX_TENSORS = 32


def _exercise(path: str) -> None:
    src = SafetensorsSource(path)
    try:
        src.metadata()
        for info in src.tensors()[:_MAX_TENSORS]:
            _common.allowed(src.read, info.name)
            if info.shape:
                _common.allowed(src.read_rows, info.name, 0, min(1, info.shape[0]))
            buf = np.empty(info.nbytes, np.uint8)
            _common.allowed(src.read_into, info.name, buf)
    finally:
        src.close()


def test_one_input(data: bytes) -> None:
    folder = _common.scratch()
    path = os.path.join(folder, "x.safetensors")
    _common.write(path, data)
    _common.allowed(_exercise, path)
    out = os.path.join(folder, "st-out")
    shutil.rmtree(out, ignore_errors=True)
    _common.allowed(convert, path, out, src_format="safetensors", dst_format="tf")
    shutil.rmtree(out, ignore_errors=True)
    npz = os.path.join(folder, "st-out.npz")
    _common.allowed(convert, path, npz, src_format="safetensors", dst_format="npz")
    if os.path.exists(npz):
        os.remove(npz)


if __name__ == "__main__":
    _common.main(test_one_input)
