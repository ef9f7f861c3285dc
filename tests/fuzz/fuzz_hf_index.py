"""Fuzz the Hugging Face folder reader: an input is ``model.safetensors.index.json`` and one shard.

The two files (see ``_common.pack_files``) are written as the index and as
``model-00001-of-00001.safetensors`` in a fresh folder; the harness opens the folder
(``HFSource``: index JSON, weight_map checks against the shard's header) and reads every
tensor (at most 32). Outcome rule: values, or ``shardckpt.errors``.
"""

from __future__ import annotations

import os
import shutil

import _common
import atheris

with atheris.instrument_imports(include=["shardckpt"]):
    from shardckpt.convert.hf import INDEX_NAME, HFSource

_MAX_TENSORS = 32
SHARD = "model-00001-of-00001.safetensors"


def _exercise(folder: str) -> None:
    src = HFSource(folder)
    try:
        src.metadata()
        for info in src.tensors()[:_MAX_TENSORS]:
            _common.allowed(src.read, info.name)
    finally:
        src.close()


def test_one_input(data: bytes) -> None:
    index, shard = _common.unpack_files(data, 2)
    folder = os.path.join(_common.scratch(), "hf")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    _common.write(os.path.join(folder, INDEX_NAME), index)
    _common.write(os.path.join(folder, SHARD), shard)
    _common.allowed(_exercise, folder)


if __name__ == "__main__":
    _common.main(test_one_input)
