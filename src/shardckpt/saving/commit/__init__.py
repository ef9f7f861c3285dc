"""Commit protocols, one :class:`Committer` per storage kind; the only commit policy of the project.

* :class:`RenameCommitter` (:mod:`.rename`): stores with atomic rename (local POSIX):
  shards in a temporary folder, merged by renames, the index rename commits.
* :class:`IndexLastCommitter` (:mod:`.index_last`): object stores: data objects under
  their final names, the index PUT last commits.
* incremental saves (:mod:`.link`): :class:`LinkRenameCommitter` (rename-commit, unchanged
  data files hard-linked from the previous checkpoint) and :class:`CopyIndexLastCommitter`
  (index-last, unchanged data objects copied server-side).

:func:`committer_for` picks one from the store, once per save; the engine never asks
which store it writes to. It is the only place that asks ``FileSystem.supports_rename``:
a store without atomic rename must be an :class:`~shardckpt.storage.object_store.ObjectStore`,
and the index-last committers are typed against it. :func:`files_committer_for` makes the
same choice for a set of plain files (a converted output, :mod:`.files`).
:mod:`.leftovers` knows what dead saves leave behind; :mod:`.deletion` deletes committed
checkpoints (retention, the manager's folder), the only code that does.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ...errors import UnsupportedError
from ...storage.base import FileSystem
from ...storage.location import Location
from ...storage.object_store import ObjectStore
from .base import BundleMaker, Committer, Setup, Written
from .deletion import clean_directory, delete_checkpoint
from .files import FilesCommitter, InPlaceFilesCommitter, RenameFilesCommitter
from .index_last import IndexLastCommitter
from .leftovers import clean_leftovers, committed_num_shards, existing_shard_counts
from .link import CopyIndexLastCommitter, LinkRenameCommitter
from .rename import RenameCommitter, merge_bundles

__all__ = ["Committer", "RenameCommitter", "IndexLastCommitter", "LinkRenameCommitter", "CopyIndexLastCommitter",
           "committer_for", "merge_bundles", "BundleMaker",
           "Setup", "Written", "clean_leftovers", "committed_num_shards", "existing_shard_counts",
           "files_committer_for", "FilesCommitter", "delete_checkpoint", "clean_directory"]


def committer_for(location: Location, *, fsync: bool = True, incremental: bool = False) -> Committer:
    """The committer of one save to ``location``: rename-commit where the store renames atomically,
    index-last otherwise; their incremental forms (link / server-side copy) with ``incremental``."""
    if _object_store(location.fs, location.prefix) is None:
        return (LinkRenameCommitter if incremental else RenameCommitter)(location, fsync=fsync)
    return (CopyIndexLastCommitter if incremental else IndexLastCommitter)(location, fsync=fsync)


def files_committer_for(fs: FileSystem, directory: str, name: str, retire: Sequence[str] = ()) -> FilesCommitter:
    """The committer of one output of plain files named ``name`` in ``directory`` (see :mod:`.files`):
    staged and renamed where the store renames atomically, uploaded in place on object stores.
    ``retire``: paths of the previous output removed before any new file is published."""
    store = _object_store(fs, directory)
    if store is None:
        return RenameFilesCommitter(fs, directory, name, retire)
    return InPlaceFilesCommitter(store, directory, name, retire)


def _object_store(fs: FileSystem, path: str) -> Optional[ObjectStore]:
    """``None`` where ``fs`` renames atomically (rename commits), else ``fs`` as the object store it must be."""
    if fs.supports_rename:
        return None
    if isinstance(fs, ObjectStore):
        return fs
    raise UnsupportedError(f"{type(fs).__name__} has neither atomic rename nor the object-store interface: "
                           "no commit protocol for it", path=path)
