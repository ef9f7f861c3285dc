"""What filesystem holds a local path: whether its files already live in memory.

A file on a RAM disk (``tmpfs``, ``ramfs``: ``/dev/shm``, a node-local tier) is read by copying
pages that are already in memory; nothing a store does ahead of the reads (announcing them,
guiding the kernel's reads, :mod:`.guided`) can make that faster, so a restore skips planning
the announcements (:meth:`~.local.LocalFileSystem.prefetches_in`). The mount table is read from
``/proc/self/mounts`` at each call (a few dozen lines; mounts come and go), and the longest
mount point holding the path's real path decides. Where there is no such table (not Linux), or
it cannot be read, no path is in memory.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

__all__ = ["filesystem_type", "in_memory", "MEMORY_FILESYSTEMS"]

#: filesystem types whose files live in memory
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})

_MOUNTS = "/proc/self/mounts"
_ESCAPE = re.compile(r"\\([0-7]{3})")  # the table writes a space in a path as \040


def _mounts() -> List[Tuple[str, str]]:
    """``(mount point, filesystem type)`` of every mount (empty when the table cannot be read)."""
    try:
        with open(_MOUNTS, "r", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            out.append((_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[1]), fields[2]))
    return out


def filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem holding ``path`` (``"tmpfs"``, ``"ext4"``...; the longest mount point
    holding its real path), or ``None`` when the mount table is not known."""
    real = os.path.realpath(path)
    best: Optional[Tuple[str, str]] = None
    for point, kind in _mounts():
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, kind)
    return None if best is None else best[1]


def in_memory(path: str) -> bool:
    """Whether ``path``'s files live in memory (a ``tmpfs`` or ``ramfs``)."""
    return filesystem_type(path) in MEMORY_FILESYSTEMS
