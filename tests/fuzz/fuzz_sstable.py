"""Fuzz the SSTable (``.index``) reader: every input is a whole index file.

Outcome rule: all of ``read_table`` is consumed, or a ``shardckpt.errors`` exception.
"""

from __future__ import annotations

import _common  # noqa: F401  (puts src/ on sys.path)
import atheris

with atheris.instrument_imports(include=["shardckpt"]):
    from shardckpt.format import sstable


def test_one_input(data: bytes) -> None:
    _common.allowed(lambda: sum(1 for _ in sstable.read_table(data, "<fuzz>.index")))


if __name__ == "__main__":
    _common.main(test_one_input)
