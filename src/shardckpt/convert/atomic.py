"""Committing converted files so that a failed or killed conversion leaves nothing that looks complete.

Local files are written into a hidden temporary folder in the destination directory,
``.NAME.tmp-<12 hex>/`` (``NAME``: the output's name), as hidden files (``.FILE``; nothing
in there looks like a checkpoint to a recursive search), and renamed out of it onto their
final names once complete and fsynced; the small files written last (an index) go the
same way, in order, then the folder is removed. On disk at each moment:

* while writing: the previous output, untouched, beside the temporary folder;
* at the commit: ``retire`` paths removed first (a Hugging Face folder's old index:
  the folder stops looking complete before any of its shards is replaced), then each
  file renamed into place, the index last;
* after: the new output only.

A failure before the commit (a bad source tensor, a full disk, an interrupt) removes
the temporary folder and leaves the previous output exactly as it was.

A conversion holds a claim (``FileSystem.claim``: a shared ``flock``, which the kernel
drops when the process dies) on its temporary folder while it lives. Before it makes
its own, it removes the temporary folders of earlier conversions to the same
destination that nobody claims: those of conversions that were killed (each held up
to a whole output). A live conversion's folder is claimed and left alone. Creating
and claiming a folder, and cleaning, happen under the directory's exclusive lock, so
a cleaner never sees a live folder before its claim. :func:`temp_folder` gives the
same to a writer that fills a folder itself (the PyTorch DCP sink).

Object stores have no rename, but an object appears only when its upload completes,
so files are uploaded under their final names (a killed upload leaves nothing), and
``retire`` paths are removed before the first upload.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Iterable, List, Sequence, Tuple

import numpy as np

from ..format.bundle_writer import byte_chunks
from ..storage import FileSystem, get_fs

__all__ = ["StagedFiles", "OutputFile", "temp_folder", "clean_dead_temporaries"]


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


def _temp_pattern(name: str) -> "re.Pattern[str]":
    return re.compile(r"\." + re.escape(name) + r"\.tmp-[0-9a-f]{12}")


def clean_dead_temporaries(fs: FileSystem, directory: str, name: str) -> List[str]:
    """Remove the temporary folders of conversions to ``directory/name`` that no live process claims
    (call under ``fs.exclusive(directory)``); returns the removed paths."""
    pattern = _temp_pattern(name)
    removed = []
    for entry in fs.listdir(directory):
        path = fs.join(directory, entry)
        if pattern.fullmatch(entry) and fs.isdir(path) and not fs.claimed(path):
            fs.remove_tree(path)
            removed.append(path)
    return removed


def temp_folder(fs: FileSystem, directory: str, name: str) -> Tuple[str, Any]:
    """A new claimed temporary folder for an output ``directory/name``: ``(path, claim)``, made after
    removing dead ones (see the module docstring). Give it back with ``fs.release(claim)``."""
    fs.makedirs(directory)
    with fs.exclusive(directory):
        clean_dead_temporaries(fs, directory, name)
        path = fs.join(directory, f".{name}.tmp-{secrets.token_hex(6)}")
        fs.makedirs(path)
        return path, fs.claim(path)


class StagedFiles:
    """The files of one output named ``name`` in ``directory``, committed together at the end.

    ``retire``: paths of the previous output removed just before the first file takes its
    final name (see the module docstring).
    """

    def __init__(self, directory: str, name: str, retire: Sequence[str] = ()) -> None:
        self.fs = get_fs(directory)
        self.directory = directory
        self.files: List[OutputFile] = []
        self.retire = list(retire)
        self.fs.makedirs(directory)
        self.temp = ""
        self.claim: Any = None
        if self.fs.supports_rename:
            self.temp, self.claim = temp_folder(self.fs, directory, name)
        else:
            self._retire()

    def path(self, name: str) -> str:
        return self.fs.join(self.directory, name)

    def open(self, name: str) -> OutputFile:
        temp = self.fs.join(self.temp, "." + name) if self.temp else self.path(name)  # hidden in there too
        out = OutputFile(self.fs, self.path(name), temp)
        self.files.append(out)
        return out

    def _retire(self) -> None:
        for path in self.retire:
            self.fs.remove(path)
        self.retire = []

    def commit(self, last: Iterable[Tuple[str, bytes]] = ()) -> List[str]:
        """Move every finished file to its final name, then the ``last`` small files (an index), in order."""
        for name, data in last:
            out = self.open(name)
            out.write(data)
        for f in self.files:
            f.close()
        if self.temp:
            self._retire()
            for f in self.files:
                self.fs.rename(f.temp, f.final)
            self.fs.fsync_dir(self.directory)
            self._drop_temp()
        done = [f.final for f in self.files]
        self.files = []
        return done

    def abort(self) -> None:
        for f in self.files:
            f.discard()
        self.files = []
        self._drop_temp()

    def _drop_temp(self) -> None:
        if self.temp:
            try:
                self.fs.remove_tree(self.temp)
            finally:
                self.fs.release(self.claim)
                self.temp, self.claim = "", None
