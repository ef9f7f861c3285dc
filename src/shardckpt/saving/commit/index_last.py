"""Index-last commit: the commit protocol on a store without rename (object stores).

TensorFlow's ``s3://`` flow writes ``<prefix>.part-*`` bundles and merges them by
renaming, which on an object store copies every byte. Here nothing is renamed.
What is in the store at each moment of a save to ``<prefix>``:

1. ``prepare`` [io client]: one listing of the prefix's folder. Data objects of a
   count no index uses (a dead save's) and ``.tempstate`` objects are removed; the
   index is read only when the listing shows something to judge. The counts left
   (the committed checkpoint's) are to be avoided. Registered savers write their
   bundles into a local temporary folder; their data files take shard ids ``0..k-1``.
2. ``plan`` [every client]: the shard count ``N`` is fixed before any byte is written:
   all clients' shards plus ``k``, raised past the counts to avoid (empty padding).
3. ``write_shard`` [every client]: each shard is uploaded straight to its final name
   ``<prefix>.data-<id>-of-N`` (a multipart upload streamed from the values). An
   object appears only when its upload completes; a failed writer aborts its upload.
   The shard's index entries travel to the io client as JSON.
4. ``commit`` [io client]: the registered savers' data files are uploaded, empty
   padding objects are added for ids past the shards, and the merged ``.index``
   object is written with one PUT: **the commit**. Before it a reader sees the
   previous checkpoint (whose data objects have another count, never touched) or none.
5. ``finish`` [io client]: the previous checkpoint's data objects are removed.

``abort`` (failure before the commit): this save's count-``N`` objects are removed
unless the index turns out to name them.
"""

from __future__ import annotations

import base64
import logging
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple

from ...format.bundle_writer import BundleWriter
from ...format.crc import shared_executor
from ...format.merge import index_bytes, merge_entries, read_index
from ...format.naming import data_filename, index_filename
from ...format.protos import tensor_bundle_pb2 as pb
from ...storage.local import local_fs
from ...storage.location import Location
from ..plan import ShardPlan
from .base import BundleMaker, Committer, Setup, Written
from .leftovers import committed_num_shards, remove_data_files, scan_in_place
from .writing import fill_bundle

__all__ = ["IndexLastCommitter", "pick_num_shards"]

_log = logging.getLogger("shardckpt")
Entries = Dict[bytes, pb.BundleEntryProto]


def pick_num_shards(count: int, avoid: List[int]) -> int:
    """``count`` (at least 1), raised past every shard count in ``avoid`` (empty padding data files)."""
    n = max(1, count)
    while n in avoid:
        n += 1
    return n


def _encode_entries(entries: Entries) -> List[List[str]]:
    return [[base64.b64encode(k).decode(), base64.b64encode(e.SerializeToString()).decode()]
            for k, e in sorted(entries.items())]


def _decode_entries(items: List[List[str]]) -> Entries:
    return {base64.b64decode(k): pb.BundleEntryProto.FromString(base64.b64decode(e)) for k, e in items}


class IndexLastCommitter(Committer):
    """Data objects under their final names, the index written last."""

    def __init__(self, location: Location, *, fsync: bool = True) -> None:
        super().__init__(location, fsync=fsync)
        self._present: Dict[str, int] = {}
        self._scratch: Optional[str] = None
        self._extra: List[Tuple[str, Entries, Dict[str, int]]] = []  # (bundle, entries, data file -> new id)
        self._committed = False

    def prepare(self, extra_bundles: Optional[BundleMaker] = None) -> Setup:
        avoid, self._present = scan_in_place(self.location)
        first = 0
        if extra_bundles is not None:
            self._scratch = tempfile.mkdtemp(prefix="shardckpt-registered-")
            ids: Dict[str, int] = {}
            for bundle in extra_bundles(self._scratch):
                header, items = read_index(bundle, local_fs)
                entries: Entries = {}
                for key, value in items:
                    entry = pb.BundleEntryProto.FromString(value)
                    source = data_filename(bundle, entry.shard_id, header.num_shards)
                    entry.shard_id = ids.setdefault(source, len(ids))
                    entries[key] = entry
                self._extra.append((bundle, entries, ids))
            first = len(ids)
        self.setup = {"avoid": sorted(avoid), "first_shard_id": first}
        return self.setup

    def plan(self, total: int) -> int:
        self.num_shards = pick_num_shards(total, self.setup["avoid"])
        return self.num_shards

    def write_shard(self, shard: ShardPlan, shard_id: int) -> Written:
        writer = BundleWriter(self.location.prefix, fs=self.location.fs, checksum_executor=shared_executor(),
                              data_path=data_filename(self.location.prefix, shard_id, self.num_shards))
        try:
            fill_bundle(writer, shard)
        except BaseException:
            writer.abort()
            raise
        written = writer.bytes_written
        entries = writer.finish_entries()
        for entry in entries.values():
            entry.shard_id = shard_id
        return {"entries": _encode_entries(entries), "bytes": written}

    def _upload_extra(self) -> None:
        fs = self.location.fs
        uploaded = set()
        for _, _, ids in self._extra:
            for source, new_id in ids.items():
                if source in uploaded:
                    continue
                uploaded.add(source)
                handle = fs.open_write(data_filename(self.location.prefix, new_id, self.num_shards))
                try:
                    with open(source, "rb") as f:
                        while True:
                            chunk = f.read(16 << 20)
                            if not chunk:
                                break
                            fs.write_all(handle, memoryview(chunk))
                except BaseException:
                    fs.discard(handle)
                    raise
                fs.close(handle)

    def commit(self, written: List[Written]) -> None:
        fs = self.location.fs
        self._upload_extra()
        parts = [(bundle, sorted(entries.items())) for bundle, entries, _ in self._extra]
        parts += [(data_filename(self.location.prefix, self.first_shard_id + i, self.num_shards),
                   sorted(_decode_entries(w["entries"]).items())) for i, w in enumerate(written)]
        merged = merge_entries(parts)
        for pad in range(self.first_shard_id + len(written), self.num_shards):
            fs.close(fs.open_write(data_filename(self.location.prefix, pad, self.num_shards)))
        fs.write_atomic(index_filename(self.location.prefix), index_bytes(merged, self.num_shards))
        self._committed = True

    def finish(self) -> None:
        for path, count in self._present.items():
            if count != self.num_shards:
                self.location.fs.remove(path)
        self._drop_scratch()

    def abort(self) -> None:
        try:
            if self.num_shards > 0 and committed_num_shards(self.location) != self.num_shards:
                remove_data_files(self.location, self.num_shards)
        except Exception as exc:  # the next save cleans up; keep the original error
            _log.warning("could not remove the data objects of the failed save of %s: %s", self.location.prefix,
                         exc)
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
