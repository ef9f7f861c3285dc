"""The incremental committers: unchanged data files are linked (POSIX) or copied server-side (object stores).

The third commit protocol (``CheckpointOptions(incremental=True)``), built on the other two:
the engine's arrange step (:func:`shardckpt.saving.incremental.arrange`) turns each data
file of the previous checkpoint worth linking (most of its bytes still in use: pieces that
did not change) into a shard carrying a :class:`~shardckpt.saving.plan.Reuse` that names
only those pieces; every other shard is written as usual.

:class:`LinkRenameCommitter` (stores with atomic rename), on top of rename-commit
(:mod:`.rename`). What is on disk at each moment, besides rename-commit's steps:

1. ``write_shard`` of a reused shard: the previous checkpoint's data file is hard-linked
   to ``<temp>/part-I-of-N.data-00000-of-00001`` (where links are impossible: a reflink,
   else a copy, made durable; said once in the log). No part index is written: the
   reused entries (offsets, sizes, checksums as the previous index has them) travel to
   the io client with the shard's report and go to the merge in memory (the bytes of pieces
   that changed since stay in the linked file, named by no entry). The previous
   checkpoint is never touched: a link is a new name for the same bytes, and nothing
   ever writes into a committed data file.
2. ``commit``: the merge renames the parts' data files to ``<prefix>.data-I-of-M`` as for
   any save; then ``<prefix>.hashes.json`` (the sidecar, naming the index bytes it
   belongs to, and each data file's stamp: a written file's taken now, under its final
   name; a linked file's the one the arrange step checked before linking it, so a file
   changed meanwhile reads as changed) is written atomically (not fsynced: a lost or torn
   sidecar fails its checks and only makes the next save a full one), and the index
   rename commits. A crash between the
   two leaves a sidecar whose index is not there: it is ignored, and the next save
   removes the unreferenced data files as usual.

Because the new checkpoint holds its own names for every byte it uses, deleting the
previous checkpoint (retention, ``max_to_keep``) only drops one of two names: the data
stays alive under the newer one.

:class:`CopyIndexLastCommitter` (object stores), on top of index-last (:mod:`.index_last`):
a reused shard is a server-side copy (S3 ``CopyObject``; no byte passes through the
client) of the previous data object to ``<prefix>.data-I-of-N``, its ETag read back for
the check before the commit; the sidecar object is written (every data object's size and
ETag, from one listing), then the index PUT commits.
Deleting the previous checkpoint's objects afterwards leaves the copies intact.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

from ...format.naming import data_filename
from ...format.protos import tensor_bundle_pb2 as pb
from ..incremental import piece_records, sidecar_bytes, sidecar_filename
from ..plan import Reuse, ShardPlan
from .base import Written
from .index_last import IndexLastCommitter, _decode_entries, _encode_entries, encode_pairs
from .rename import RenameCommitter

__all__ = ["LinkRenameCommitter", "CopyIndexLastCommitter"]

_log = logging.getLogger("shardckpt")


def _entries(reuse: Reuse, shard_id: int) -> Dict[bytes, pb.BundleEntryProto]:
    out = {}
    for key, value in reuse.entries:
        entry = pb.BundleEntryProto.FromString(value)
        if not entry.slices:
            entry.shard_id = shard_id
        out[key] = entry
    return out


def _reused(shard: ShardPlan, how: str, **where: Any) -> Written:
    """What reusing a previous data file for ``shard`` produced (``where``: the committer's fields)."""
    assert shard.reuse is not None and shard.hashes is not None
    return Written(0, reused=shard.reuse.size, how=how, source=shard.reuse.source,
                   pieces=piece_records(shard, shard.hashes), file=dict(shard.reuse.record), **where)


class LinkRenameCommitter(RenameCommitter):
    """Rename-commit where unchanged data files are hard-linked from the previous checkpoint.

    Its data files stay packed (no ``page_phase`` gaps): whether a file is linked depends on
    the share of its bytes that entries still name, and gaps would count as unused bytes."""

    page_phase = None

    def write_shard(self, shard: ShardPlan, shard_id: int) -> Written:
        if shard.reuse is None:
            return super().write_shard(shard, shard_id)
        part = self._part(shard_id)
        how = self.location.fs.copy_file(shard.reuse.source, data_filename(part, 0, 1), fsync=self.fsync)
        # no part index: the merge takes the entries (shard id 0, offsets into the linked file) from here
        return _reused(shard, how, part=part, index_entries=encode_pairs(shard.reuse.entries))

    def _in_memory(self, written: List[Written]) -> Dict[str, List[Tuple[bytes, bytes]]]:
        return {str(w.part): _decode_entries(w.index_entries, str(w.part))
                for w in written if w.index_entries is not None}

    def _before_index(self, written: List[Written], index: bytes) -> None:
        # Not fsynced on its own: the directory fsync after the index rename covers its name, and a
        # sidecar lost or torn by a crash only fails its checks (JSON, the index's hash) and makes the
        # next save a full one; it never makes a checkpoint wrong.
        self.location.fs.write_atomic(sidecar_filename(self.location.prefix),
                                      sidecar_bytes(written, index, self.location.fs, self.location.prefix))


class CopyIndexLastCommitter(IndexLastCommitter):
    """Index-last where unchanged data objects are copied server-side from the previous checkpoint."""

    def write_shard(self, shard: ShardPlan, shard_id: int) -> Written:
        if shard.reuse is None:
            return super().write_shard(shard, shard_id)
        fs = self.store
        path = data_filename(self.location.prefix, shard_id, self.num_shards)
        how = fs.copy_file(shard.reuse.source, path)
        etag = fs.head_etag(path) if self._conditional else None
        if etag is not None:
            self._mine[path] = etag
        return _reused(shard, how, entries=_encode_entries(_entries(shard.reuse, shard_id)), etag=etag)

    def _before_index(self, written: List[Written], index: bytes) -> None:
        self.location.fs.write_atomic(sidecar_filename(self.location.prefix),
                                      sidecar_bytes(written, index, self.location.fs, self.location.prefix))
