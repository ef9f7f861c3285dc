"""Committing converted files so that a failed or killed conversion leaves nothing that looks complete.

The commit protocol is the saving room's (:mod:`shardckpt.saving.commit.files`, chosen by
:func:`~shardckpt.saving.commit.files_committer_for` from the destination's store): local
files staged in a hidden claimed temporary folder and renamed into place, the index last;
object stores uploading under final names after the previous output's ``retire`` paths
are removed. What is on disk at each moment is described there. This module keeps the
converters' names for it.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

from ..saving.commit import files_committer_for
from ..saving.commit.files import OutputFile, clean_dead_temporaries, temp_folder
from ..storage import get_fs

__all__ = ["StagedFiles", "OutputFile", "temp_folder", "clean_dead_temporaries"]


class StagedFiles:
    """The files of one output named ``name`` in ``directory``, committed together at the end.

    ``retire``: paths of the previous output removed just before the first file takes its
    final name (see :mod:`shardckpt.saving.commit.files`).
    """

    def __init__(self, directory: str, name: str, retire: Sequence[str] = ()) -> None:
        self.fs = get_fs(directory)
        self.directory = directory
        self.committer = files_committer_for(self.fs, directory, name, retire)

    def path(self, name: str) -> str:
        return self.committer.path(name)

    def open(self, name: str) -> OutputFile:
        return self.committer.open(name)

    def commit(self, last: Iterable[Tuple[str, bytes]] = ()) -> List[str]:
        """Publish every finished file, then the ``last`` small files (an index), in order."""
        return self.committer.commit(last)

    def abort(self) -> None:
        self.committer.abort()
