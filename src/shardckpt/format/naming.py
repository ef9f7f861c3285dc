"""File names of a tensor bundle: ``<prefix>.index`` and ``<prefix>.data-NNNNN-of-NNNNN``."""

from __future__ import annotations

import re
from typing import Optional, Tuple

__all__ = ["index_filename", "data_filename", "sharded_filename", "parse_data_filename", "DATA_SUFFIX_PATTERN"]

#: The suffix of a data file's name after its prefix: ``.data-<shard>-of-<count>``.
DATA_SUFFIX_PATTERN = r"\.data-(\d+)-of-(\d+)"
_DATA_SUFFIX = re.compile(DATA_SUFFIX_PATTERN)


def index_filename(prefix: str) -> str:
    """``<prefix>.index``."""
    return f"{prefix}.index"


def data_filename(prefix: str, shard_id: int, num_shards: int) -> str:
    """``<prefix>.data-%05d-of-%05d`` (more digits when the numbers need them)."""
    return "%s.data-%05d-of-%05d" % (prefix, shard_id, num_shards)


def sharded_filename(prefix: str, shard: int, num_shards: int) -> str:
    """``<prefix>-%05d-of-%05d``, TensorFlow's ``ShardedFilename`` op."""
    return "%s-%05d-of-%05d" % (prefix, shard, num_shards)


def parse_data_filename(name: str, basename: str) -> Optional[Tuple[int, int]]:
    """``(shard_id, num_shards)`` when ``name`` is a data file of the prefix whose last component is
    ``basename``; ``None`` for any other name."""
    if not name.startswith(basename):
        return None
    m = _DATA_SUFFIX.fullmatch(name, len(basename))
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))
