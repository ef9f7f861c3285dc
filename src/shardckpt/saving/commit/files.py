"""Committing a set of plain files (a converted output) so that a failed or killed writer leaves
nothing that looks complete: the file-set form of the two commit protocols.

:func:`shardckpt.saving.commit.files_committer_for` picks one from the store, as
:func:`~shardckpt.saving.commit.committer_for` does for checkpoints. Both give files to
write (:meth:`FilesCommitter.open`) and publish them with :meth:`FilesCommitter.commit`;
``retire`` names paths of the previous output that go before any new file is published
(a Hugging Face folder's old index: the folder stops looking complete before any of its
shards is replaced).

:class:`RenameFilesCommitter` (stores with atomic rename: local disks). Files are
written into a hidden temporary folder in the destination directory,
``.NAME.tmp-<12 hex>/`` (``NAME``: the output's name), as hidden files (``.FILE``;
nothing in there looks like a checkpoint to a recursive search), fsynced, and renamed
out of it onto their final names; the small files written last (an index) go the same
way, in order, then the folder is removed. On disk at each moment:

* while writing: the previous output, untouched, beside the temporary folder;
* at the commit: ``retire`` paths removed first, then each file renamed into place,
  the index last;
* after: the new output only.

A failure before the commit removes the temporary folder and leaves the previous output
exactly as it was. The writer holds a claim (``FileSystem.claim``: a shared ``flock``,
which the kernel drops when the process dies) on its temporary folder while it lives.
Before it makes its own, it removes the temporary folders of earlier writers to the same
destination that nobody claims (killed ones, each holding up to a whole output).
Creating and claiming a folder, and cleaning, happen under the directory's exclusive
lock, so a cleaner never sees a live folder before its claim. :func:`temp_folder` gives
the same to a writer that fills a folder itself (the PyTorch DCP sink).

:class:`InPlaceFilesCommitter` (an :class:`~shardckpt.storage.object_store.ObjectStore`:
no rename, but an object appears only when its upload completes). ``retire`` paths are
removed first; files are uploaded under their final names (a killed upload leaves
nothing), the last ones in order.
"""

from __future__ import annotations

import abc
import re
import secrets
from typing import Any, Iterable, List, Sequence, Tuple

import numpy as np

from ...format.bundle_writer import byte_chunks
from ...storage.base import FileSystem
from ...storage.object_store import ObjectStore

__all__ = ["FilesCommitter", "RenameFilesCommitter", "InPlaceFilesCommitter", "OutputFile", "temp_folder",
           "clean_dead_temporaries"]


class OutputFile:
    """One file being written: ``write(bytes | array)``, then :meth:`FilesCommitter.commit`.

    ``durable``: its bytes are fsynced before it is closed (files that a rename publishes).
    """

    def __init__(self, fs: FileSystem, final: str, temp: str, durable: bool = False) -> None:
        self.fs = fs
        self.final = final
        self.temp = temp
        self.durable = durable
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
            if self.durable:
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
    """Remove the temporary folders of writers of ``directory/name`` that no live process claims
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


class FilesCommitter(abc.ABC):
    """The files of one output named ``name`` in ``directory``, published together by :meth:`commit`.

    Call sequence: ``open`` (any number; write each file and leave it open) -> ``commit``
    (the ``last`` small files written and published after the others, in order) or ``abort``.
    """

    def __init__(self, fs: FileSystem, directory: str, name: str, retire: Sequence[str] = ()) -> None:
        self.fs = fs
        self.directory = directory
        self.name = name
        self.files: List[OutputFile] = []
        self.retire = list(retire)
        fs.makedirs(directory)

    def path(self, name: str) -> str:
        """The final path of the output file ``name``."""
        return self.fs.join(self.directory, name)

    @abc.abstractmethod
    def open(self, name: str) -> OutputFile:
        """A new file of the output, published under :meth:`path` ``(name)`` by :meth:`commit`."""

    @abc.abstractmethod
    def commit(self, last: Iterable[Tuple[str, bytes]] = ()) -> List[str]:
        """Publish every file, then the ``last`` small files (an index), in order; the final paths."""

    def abort(self) -> None:
        """After a failure: drop every file written; the previous output stays as it was."""
        for f in self.files:
            f.discard()
        self.files = []

    def _retire(self) -> None:
        for path in self.retire:
            self.fs.remove(path)
        self.retire = []

    def _write_last(self, last: Iterable[Tuple[str, bytes]]) -> None:
        for name, data in last:
            self.open(name).write(data)
        for f in self.files:
            f.close()


class RenameFilesCommitter(FilesCommitter):
    """Files staged in a claimed temporary folder, fsynced, renamed into place (see the module docstring)."""

    def __init__(self, fs: FileSystem, directory: str, name: str, retire: Sequence[str] = ()) -> None:
        super().__init__(fs, directory, name, retire)
        self.temp, self.claim = temp_folder(fs, directory, name)

    def open(self, name: str) -> OutputFile:
        out = OutputFile(self.fs, self.path(name), self.fs.join(self.temp, "." + name), durable=True)  # hidden
        self.files.append(out)
        return out

    def commit(self, last: Iterable[Tuple[str, bytes]] = ()) -> List[str]:
        self._write_last(last)
        self._retire()
        for f in self.files:
            self.fs.rename(f.temp, f.final)
        self.fs.fsync_dir(self.directory)
        self._drop_temp()
        done = [f.final for f in self.files]
        self.files = []
        return done

    def abort(self) -> None:
        super().abort()
        self._drop_temp()

    def _drop_temp(self) -> None:
        if self.temp:
            try:
                self.fs.remove_tree(self.temp)
            finally:
                self.fs.release(self.claim)
                self.temp, self.claim = "", None


class InPlaceFilesCommitter(FilesCommitter):
    """Objects uploaded under their final names, ``retire`` paths removed first (see the module docstring)."""

    def __init__(self, fs: ObjectStore, directory: str, name: str, retire: Sequence[str] = ()) -> None:
        super().__init__(fs, directory, name, retire)
        self._retire()

    def open(self, name: str) -> OutputFile:
        out = OutputFile(self.fs, self.path(name), self.path(name))
        self.files.append(out)
        return out

    def commit(self, last: Iterable[Tuple[str, bytes]] = ()) -> List[str]:
        self._write_last(last)
        done = [f.final for f in self.files]
        self.files = []
        return done
