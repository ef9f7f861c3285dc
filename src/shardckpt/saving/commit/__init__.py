"""Commit protocols, one :class:`Committer` per storage kind; the only commit policy of the project.

* :class:`RenameCommitter` (:mod:`.rename`): stores with atomic rename (local POSIX):
  shards in a temporary folder, merged by renames, the index rename commits.
* :class:`IndexLastCommitter` (:mod:`.index_last`): object stores: data objects under
  their final names, the index PUT last commits.
* incremental saves (:mod:`.link`): :class:`LinkRenameCommitter` (rename-commit, unchanged
  data files hard-linked from the previous checkpoint) and :class:`CopyIndexLastCommitter`
  (index-last, unchanged data objects copied server-side).

:func:`committer_for` picks one from the store, once per save; the engine never asks
which store it writes to. :mod:`.leftovers` knows what dead saves leave behind.
"""

from __future__ import annotations

from ...storage.location import Location
from .base import BundleMaker, Committer, Setup, Written
from .index_last import IndexLastCommitter
from .leftovers import clean_leftovers, committed_num_shards, existing_shard_counts
from .link import CopyIndexLastCommitter, LinkRenameCommitter
from .rename import RenameCommitter, merge_bundles

__all__ = ["Committer", "RenameCommitter", "IndexLastCommitter", "LinkRenameCommitter", "CopyIndexLastCommitter",
           "committer_for", "merge_bundles", "BundleMaker",
           "Setup", "Written", "clean_leftovers", "committed_num_shards", "existing_shard_counts"]


def committer_for(location: Location, *, fsync: bool = True, incremental: bool = False) -> Committer:
    """The committer of one save to ``location``: rename-commit where the store renames atomically,
    index-last otherwise; their incremental forms (link / server-side copy) with ``incremental``."""
    if location.fs.supports_rename:
        return (LinkRenameCommitter if incremental else RenameCommitter)(location, fsync=fsync)
    return (CopyIndexLastCommitter if incremental else IndexLastCommitter)(location, fsync=fsync)
