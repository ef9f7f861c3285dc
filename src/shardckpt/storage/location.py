"""A checkpoint's place: the store that holds it and its prefix, resolved once.

Front doors turn a user's path into a :class:`Location` (:meth:`Location.of`) and pass
it down; the engine, the committers and the readers use ``location.fs`` and never
look the store up again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from .base import FileSystem, normalize
from .registry import get_fs

__all__ = ["Location"]


@dataclass(frozen=True)
class Location:
    """``prefix`` on the store ``fs`` (e.g. ``/ckpt/model-3`` locally, ``s3://bucket/run/model-3``)."""

    fs: FileSystem
    prefix: str

    @classmethod
    def of(cls, path: Any, fs: Optional[FileSystem] = None) -> "Location":
        """Resolve ``path`` (a string or ``os.PathLike``; ``file://`` is local) to its store."""
        if isinstance(path, Location):
            return path
        prefix = normalize(os.fspath(path))
        return cls(fs if fs is not None else get_fs(prefix), prefix)

    @cached_property
    def directory(self) -> str:
        """The folder holding the checkpoint's files (``"."`` for a bare name)."""
        return self.fs.dirname(self.prefix) or "."

    @cached_property
    def basename(self) -> str:
        """The prefix's last component: every file of the checkpoint starts with it."""
        return self.fs.basename(self.prefix)

    def sibling(self, name: str) -> str:
        """The path of ``name`` in the checkpoint's folder."""
        return self.fs.join(self.directory, name)
