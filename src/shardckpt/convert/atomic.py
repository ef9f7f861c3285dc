"""Committing converted files so that a killed conversion leaves nothing that looks complete.

Local files are written under a hidden temporary sibling name (``.NAME.tmp-<random>``)
in the destination directory and renamed over the final name once complete and
fsynced. Object stores have no rename, but an object appears only when its upload
completes, so files are uploaded under their final names; a killed upload leaves
nothing. :class:`StagedFiles` tracks every file of one output and removes the
temporaries when anything fails.
"""

from __future__ import annotations

import secrets
from typing import Any, Iterable, List, Tuple

import numpy as np

from ..format.bundle_writer import byte_chunks
from ..storage import FileSystem, get_fs

__all__ = ["StagedFiles", "OutputFile"]


class OutputFile:
    """One file being written: ``write(bytes | array)``, then :meth:`StagedFiles.commit`."""

    def __init__(self, fs: FileSystem, final: str, temp: str) -> None:
        self.fs = fs
        self.final = final
        self.temp = temp
        self.handle: Any = fs.open_write(temp)
        self.written = 0

    def write(self, data: Any) -> None:
        """Append bytes, or the raw little-endian C-order bytes of an array."""
        if isinstance(data, np.ndarray):
            if data.dtype.byteorder == ">":
                data = data.astype(data.dtype.newbyteorder("<"))
            for chunk in byte_chunks(data):
                self.fs.write_all(self.handle, chunk, self.temp)
                self.written += len(chunk)
            return
        view = memoryview(data).cast("B")
        self.fs.write_all(self.handle, view, self.temp)
        self.written += len(view)

    def tell(self) -> int:
        return self.written

    def close(self) -> None:
        """Flush and close (on an object store: complete the upload)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            if self.fs.supports_rename:
                self.fs.fsync(handle, self.temp)
            self.fs.close(handle)

    def discard(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            try:
                self.fs.discard(handle)
            except Exception:  # pragma: no cover - cleanup after a failure
                pass
        try:
            self.fs.remove(self.temp)
        except Exception:  # pragma: no cover
            pass


class StagedFiles:
    """The files of one output: opened under temporary names, committed in order at the end."""

    def __init__(self, directory: str) -> None:
        self.fs = get_fs(directory)
        self.directory = directory
        self.files: List[OutputFile] = []
        self.fs.makedirs(directory)

    def path(self, name: str) -> str:
        return self.fs.join(self.directory, name)

    def open(self, name: str) -> OutputFile:
        final = self.path(name)
        temp = self.path(f".{name}.tmp-{secrets.token_hex(6)}") if self.fs.supports_rename else final
        out = OutputFile(self.fs, final, temp)
        self.files.append(out)
        return out

    def commit(self, last: Iterable[Tuple[str, bytes]] = ()) -> List[str]:
        """Rename every finished file to its final name, then write the ``last`` small files (an index)."""
        for f in self.files:
            f.close()
        if self.fs.supports_rename:
            for f in self.files:
                self.fs.rename(f.temp, f.final)
        done = [f.final for f in self.files]
        for name, data in last:
            self.fs.write_atomic(self.path(name), data, fsync=True)
            done.append(self.path(name))
        if self.fs.supports_rename:
            self.fs.fsync_dir(self.directory)
        self.files = []
        return done

    def abort(self) -> None:
        for f in self.files:
            f.discard()
        self.files = []
