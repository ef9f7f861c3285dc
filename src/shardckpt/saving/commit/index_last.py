"""Index-last commit: the commit protocol on a store without rename (object stores).

TensorFlow's ``s3://`` flow writes ``<prefix>.part-*`` bundles and merges them by
renaming, which on an object store copies every byte. Here nothing is renamed.
What is in the store at each moment of a save to ``<prefix>``:

1. ``prepare`` [io client]: one listing of the prefix's folder (sizes, ETags, times).
   Data objects of a count no index uses and older than the store's ``stale_after``
   (a dead save's) and ``.tempstate`` objects are removed, and so are stale multipart
   uploads of checkpoint names in the folder (listed and aborted beside the save's own
   uploads, done before the commit); younger ones may be a live writer's and are kept.
   The index is read only when the listing shows something to judge. The counts left
   (the committed checkpoint's, live writers') are to be avoided. The ETag of the index
   seen now (or its absence) is remembered for the commit.
   Registered savers write their bundles into a local temporary folder; their data
   files take shard ids ``0..k-1``.
2. ``plan`` [every client]: the shard count ``N`` is fixed before any byte is written:
   all clients' shards plus ``k``, raised past the counts to avoid (empty padding).
3. ``write_shard`` [every client]: each shard is uploaded straight to its final name
   ``<prefix>.data-<id>-of-N`` (a multipart upload streamed from the values). An
   object appears only when its upload completes; a failed writer aborts its upload.
   Where the store has conditional writes (S3), the object is *created exclusively*
   (``If-None-Match: *``): it never replaces another writer's object. The shard's
   index entries (a compressed table, :func:`encode_pairs`) and the object's ETag
   travel to the io client as JSON; it merges them one client's shard at a time.
4. ``commit`` [io client]: the registered savers' data files are uploaded, empty
   padding objects are added for ids past the shards (all created exclusively), every
   data object the new index names is checked to carry the ETag this save wrote (one
   listing of them; a HEAD for any the listing lacks), and
   the merged ``.index`` object is written with one conditional PUT: **the commit** —
   ``If-None-Match: *`` when prepare saw no index, ``If-Match: <the ETag seen>`` when
   it replaces one. Before it a reader sees the previous checkpoint (whose data
   objects have another count, never touched) or none.
5. ``finish`` [io client]: the previous checkpoint's data objects are removed (one
   request per 1,000 where the store deletes in bulk).

Concurrent writers to one prefix (the winner rule, object stores with conditional
writes): **at most one save commits, and it commits whole**; every other save fails
with :class:`~shardckpt.errors.AbortedError` and commits nothing.

* Two saves that picked the same ``N`` race for the same object names; each name is
  created by one of them only, so at least one of them fails before its commit (both
  may: then neither commits and the previous checkpoint stays latest).
* Two saves with different ``N`` both reach the commit; the index PUT is conditional
  on the index each saw at prepare, so only the first one lands. The other fails, and
  removes only objects that carry its own ETags (conditional deletes).
* A save never deletes what a live writer uses: leftovers count as a dead save's only
  when older than ``stale_after`` (default one hour; a save that runs longer must
  raise it), and the check before the commit refuses to publish an index over a data
  object that is missing or not ours.

A lost reply of the commit request is resolved by reading the index back (see
:meth:`shardckpt.storage.object_store.ObjectStore.put`): the save reports
committed exactly when the store holds our index.

``abort`` (failure before the commit): the objects this save created are removed
(only if they still carry our ETags); on stores without conditional writes, this
save's count-``N`` objects are removed unless the index turns out to name them.
"""

from __future__ import annotations

import base64
import logging
import shutil
import tempfile
import threading
import zlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from ...errors import AbortedError, CorruptIndexError, NotFoundError
from ...format.bundle_writer import BundleWriter
from ...format.crc import shared_executor
from ...format.merge import index_bytes, merge_entries, read_index
from ...format.naming import data_filename, index_filename
from ...format.protos import tensor_bundle_pb2 as pb
from ...format.sstable import TableWriter, read_table
from ...runtime import ThreadPool
from ...storage.base import FileSystem, WriteHandle
from ...storage.local import local_fs
from ...storage.location import Location
from ...storage.object_store import ObjectStore
from ...storage.wrappers import ObjectStoreWrapper
from ..incremental import piece_records
from ..plan import ShardPlan
from .base import BundleMaker, Committer, Setup, Written
from .leftovers import (
    InPlaceScan,
    abort_stale_uploads,
    committed_num_shards,
    object_store,
    pick_num_shards,
    remove_data_files,
    scan_in_place,
)
from .writing import fill_bundle

__all__ = ["IndexLastCommitter", "pick_num_shards"]

_log = logging.getLogger("shardckpt")
Entries = Dict[bytes, pb.BundleEntryProto]
Serialized = Dict[bytes, bytes]


def _encode_entries(entries: Mapping[bytes, pb.BundleEntryProto]) -> str:
    """A shard's index entries as they travel to the io client (see :func:`encode_pairs`)."""
    return encode_pairs((key, entry.SerializeToString()) for key, entry in entries.items())


def encode_pairs(pairs: Iterable[Tuple[bytes, bytes]]) -> str:
    """``(key, serialized entry)`` pairs as they travel to the io client: a table, zlib-compressed, in base64.

    The table's keys are prefix-compressed and a shard's entries repeat their dtype,
    shape and shard id: a few bytes an entry (4 in ``benchmarks/bench_scale.py``; one JSON
    pair of base64 strings took ~106). The io client reads it with the same checked reader as an index
    file (:func:`_decode_entries`).
    """
    table = TableWriter()
    for key, value in sorted(pairs):
        table.add(key, value)
    return base64.b64encode(zlib.compress(table.finish(), 1)).decode("ascii")


def _decode_entries(text: str, source: str = "<gathered entries>") -> List[Tuple[bytes, bytes]]:
    """The ``(key, serialized entry)`` pairs of :func:`encode_pairs`'s text, in key order."""
    try:
        table = zlib.decompress(base64.b64decode(text))
    except (ValueError, zlib.error) as exc:
        raise CorruptIndexError(f"gathered index entries do not decode ({exc})", path=source) from None
    return list(read_table(table, source))


class _ExclusiveCreates(ObjectStoreWrapper):
    """Writes go through ``create_exclusive`` (never replace an object); remembers each object's ETag.

    ``remove`` deletes only objects created here, and only while they carry our ETag
    (a writer that lost a name must not delete the winner's object).
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.etags: Dict[str, str] = {}
        self._paths: Dict[int, str] = {}

    def open_write(self, path: str) -> WriteHandle:
        handle = self.inner.create_exclusive(path)
        self._paths[id(handle)] = path
        return handle

    def close(self, handle: Any) -> None:
        self.inner.close(handle)
        path = self._paths.pop(id(handle), None)
        etag = self.inner.written_etag(handle)
        if path is not None and etag:
            self.etags[path] = etag

    def discard(self, handle: Any) -> None:
        self._paths.pop(id(handle), None)
        self.inner.discard(handle)

    def remove(self, path: str) -> None:
        etag = self.etags.pop(path, None)
        if etag is not None:
            self.inner.remove_if(path, etag)


class IndexLastCommitter(Committer):
    """Data objects under their final names, the index written last (on an
    :class:`~shardckpt.storage.object_store.ObjectStore`: ``location.fs`` must be one)."""

    def __init__(self, location: Location, *, fsync: bool = True) -> None:
        super().__init__(location, fsync=fsync)
        self._previous: Dict[str, int] = {}
        self._scan = InPlaceScan()
        #: the store, typed: every object-store request of the protocol goes through it
        self.store: ObjectStore = object_store(location)
        self._conditional = self.store.conditional_writes
        self._exclusive = _ExclusiveCreates(self.store) if self._conditional else None
        self._writer_fs: FileSystem = self._exclusive if self._exclusive is not None else self.store
        self._mine: Dict[str, str] = {}  # objects this save created (io client: all it knows of) -> ETag
        self._scratch: Optional[str] = None
        self._extra: List[Tuple[str, Serialized, Dict[str, int]]] = []  # (bundle, entries, data file -> new id)
        self._committed = False
        self._cleanup: Optional[threading.Thread] = None

    def _join_cleanup(self) -> None:
        if self._cleanup is not None:
            self._cleanup.join()
            self._cleanup = None

    def prepare(self, extra_bundles: Optional[BundleMaker] = None) -> Setup:
        # stale uploads (a dead save's, idle for stale_after) are listed beside the scan and aborted beside
        # the save's uploads (joined before the commit); the save's own uploads start only once the listing
        # is back, so none of them can be taken for a dead save's
        listed = threading.Event()
        if self._conditional:
            self._cleanup = threading.Thread(target=self._abort_stale_uploads, args=(listed.set,),
                                             name="shardckpt-stale-uploads", daemon=True)
            self._cleanup.start()
        else:
            listed.set()
        self._scan = scan_in_place(self.location)
        listed.wait()
        if self._scan.removed:
            _log.info("removed what dead saves left at %s: %s", self.location.prefix, self._scan.removed)
        self._previous = dict(self._scan.previous)
        avoid = self._scan.avoid
        first = 0
        if extra_bundles is not None:
            self._scratch = tempfile.mkdtemp(prefix="shardckpt-registered-")
            ids: Dict[str, int] = {}
            for bundle in extra_bundles(self._scratch):
                header, items = read_index(bundle, local_fs)
                entries: Serialized = {}
                for key, value in items:
                    entry = pb.BundleEntryProto.FromString(value)
                    source = data_filename(bundle, entry.shard_id, header.num_shards)
                    entry.shard_id = ids.setdefault(source, len(ids))
                    entries[key] = entry.SerializeToString()
                self._extra.append((bundle, entries, ids))
            first = len(ids)
        self.setup = Setup(first, avoid=tuple(sorted(avoid)), has_index=self._scan.has_index,
                           index_etag=self._scan.index_etag)
        return self.setup

    def plan(self, total: int) -> int:
        self.num_shards = pick_num_shards(total, list(self.setup.avoid))
        return self.num_shards

    def write_shard(self, shard: ShardPlan, shard_id: int) -> Written:
        path = data_filename(self.location.prefix, shard_id, self.num_shards)
        writer = BundleWriter(self.location.prefix, fs=self._writer_fs, checksum_executor=shared_executor(),
                              data_path=path)
        try:
            digests = fill_bundle(writer, shard)
        except BaseException:
            writer.abort()
            raise
        written = writer.bytes_written
        entries = writer.finish_entries()
        for entry in entries.values():
            entry.shard_id = shard_id
        etag = self._created(path)
        return Written(written, entries=_encode_entries(entries), etag=etag,
                       pieces=piece_records(shard, *digests) if digests is not None else None)

    def _before_index(self, written: List[Written], index: bytes) -> None:
        """[io client] Called with the index's bytes just before the index PUT (the commit)."""

    def _created(self, path: str) -> Optional[str]:
        etag = self._exclusive.etags.get(path) if self._exclusive is not None else None
        if etag is not None:
            self._mine[path] = etag
        return etag

    def _create(self, path: str, source: Optional[str] = None) -> None:
        """Upload ``source`` (a local file; ``None``: an empty object) to ``path``."""
        fs = self._writer_fs
        handle = fs.open_write(path)
        try:
            if source is not None:
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
        self._created(path)

    def _abort_stale_uploads(self, listed: Callable[[], None]) -> None:
        try:
            aborted = abort_stale_uploads(self.location, listed=listed)
            if aborted:
                _log.info("aborted stale uploads at %s: %s", self.location.prefix, aborted)
        except Exception as exc:  # best effort: the next save tries again
            _log.warning("could not abort stale uploads at %s: %s", self.location.prefix, exc)

    def _upload_extra(self) -> None:
        uploaded = set()
        for _, _, ids in self._extra:
            for source, new_id in ids.items():
                if source in uploaded:
                    continue
                uploaded.add(source)
                self._create(data_filename(self.location.prefix, new_id, self.num_shards), source)

    def _check_ours(self, named: List[str]) -> None:
        """Every data object the index will name is there and carries the ETag this save wrote.

        One listing of the prefix's data objects (one request per 1,000; S3 listings are
        strongly consistent) gives their ETags; an object the listing lacks is asked for
        itself (HEAD) before it is called gone.
        """
        fs = self.store
        listed = fs.list_identities(f"{self.location.prefix}.data-")

        def check(path: str) -> Optional[str]:
            expected = self._mine.get(path)
            if expected is None:
                return f"{path}: no ETag recorded for it"
            seen = listed.get(path) if listed is not None else None
            etag = str(seen[1]) if seen is not None and seen[1] is not None else fs.head_etag(path)
            if etag is None:
                return f"{path} is gone"
            if etag.strip('"') != expected.strip('"'):
                return f"{path} was replaced (ETag {etag}, this save wrote {expected})"
            return None

        if listed is not None and all(p in listed for p in named):
            problems = [p for p in map(check, named) if p is not None]
        else:
            with ThreadPool(max_workers=min(16, max(1, len(named))),
                                    thread_name_prefix="shardckpt-check") as pool:
                problems = [p for p in pool.map(check, named) if p is not None]
        if problems:
            raise AbortedError("not committed: another writer changed this save's data objects: "
                               + "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""),
                               path=self.location.prefix)

    def commit(self, written: List[Written]) -> None:
        self._join_cleanup()
        fs = self.store
        prefix = self.location.prefix
        for i, w in enumerate(written):
            if w.etag:
                self._mine[data_filename(prefix, self.first_shard_id + i, self.num_shards)] = w.etag
        self._upload_extra()
        merged = merge_entries(self._parts(written))
        for pad in range(self.first_shard_id + len(written), self.num_shards):
            self._create(data_filename(prefix, pad, self.num_shards))
        data = index_bytes(merged, self.num_shards)
        index = index_filename(prefix)
        self._before_index(written, data)
        if not self._conditional:
            fs.write_atomic(index, data)
            self._committed = True
            return
        self._check_ours([data_filename(prefix, i, self.num_shards) for i in range(self.num_shards)])
        seen = self.setup.index_etag
        try:
            if self.setup.has_index and seen:
                fs.put(index, data, if_match=seen)
            else:
                fs.put(index, data, if_none_match=True)
        except (AbortedError, NotFoundError) as exc:
            raise AbortedError("not committed: another save committed this prefix while this one ran "
                               f"(the index changed since it was listed; {exc.message})", path=index) from exc
        self._committed = True

    def _parts(self, written: List[Written]) -> Iterator[Tuple[str, List[Tuple[bytes, bytes]]]]:
        """[io client] Every bundle's ``(key, serialized entry)`` pairs, decoded one client's shard at a time."""
        prefix = self.location.prefix
        for bundle, entries, _ in self._extra:
            yield bundle, sorted(entries.items())
        for i, w in enumerate(written):
            name = data_filename(prefix, self.first_shard_id + i, self.num_shards)
            yield name, _decode_entries(w.entries or "", name)

    def finish(self) -> None:
        old = [path for path, count in self._previous.items() if count != self.num_shards]
        self.store.remove_many(old)  # S3: one request per 1,000 objects
        self._drop_scratch()

    def abort(self) -> None:
        self._join_cleanup()
        if self._committed:
            self._drop_scratch()
            return
        try:
            if self._conditional:
                for path, etag in self._mine.items():
                    self.store.remove_if(path, etag)
            elif self.num_shards > 0 and committed_num_shards(self.location) != self.num_shards:
                remove_data_files(self.location, self.num_shards)
        except Exception as exc:  # the next save cleans up; keep the original error
            _log.warning("could not remove the data objects of the failed save of %s: %s", self.location.prefix,
                         exc)
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
