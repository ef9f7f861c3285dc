"""Rename-commit: the commit protocol on a filesystem with atomic renames (local POSIX).

What is on disk at each moment of a save to ``<prefix>``:

1. ``prepare`` [io client]: under an exclusive lock on the folder, leftovers of dead
   saves are removed and a fresh folder ``<prefix>_temp_<uuid>/`` is made and *claimed*
   (a shared ``flock`` the process holds until the save ends, or dies: other processes'
   cleaning never takes a live save's folder for leftovers); registered savers write
   their bundles there. Readers still see the previous checkpoint (or none).
2. ``write_shard`` [every client]: shard ``i`` of ``N`` is written as the bundle
   ``<temp>/part-0000i-of-0000N`` (data file fsynced; its index is temporary, never fsynced).
   Entries of 1 MiB or more start ``PAGE_PHASE`` bytes past a 4 KiB boundary of the data
   file, zero bytes before them (see :mod:`shardckpt.format.bundle_writer`; not in
   incremental saves, whose files stay packed).
3. ``commit`` [io client], under the folder's exclusive lock (:func:`merge_bundles`): the
   parts' data files are renamed to ``<prefix>.data-I-of-M``. If data files with that
   count ``M`` exist at that moment (an older checkpoint at the same prefix, or another
   writer's), empty data files are added until ``M`` differs, so no file of another
   checkpoint is touched before the commit (TensorFlow reads such checkpoints). Data
   files and the directory are fsynced; the merged index is written to
   ``<prefix>.index.tempstate<random>``, fsynced and renamed over ``<prefix>.index``:
   **that rename is the commit**; then the directory is fsynced, and data files of other
   counts (the previous checkpoint's) are removed, still under the lock.
4. ``finish`` [io client]: the temporary folder is removed, the claim released.

Two processes saving to one prefix: each save is whole; commits are serialised by the
folder's lock, and **the last commit wins** (its index names only its own data files;
the earlier checkpoint's files are removed by it). Locks are ``flock`` locks: the kernel
drops them when a process dies, so a dead save never blocks the next one.

``abort`` after a failure before the commit: this save's data files (a count that
neither the previous checkpoint nor the committed index uses) and the temporary
folder are removed. A save that died leaves temp folders, ``.tempstate`` files or
unreferenced data files; the next save to the prefix removes them
(:mod:`shardckpt.saving.commit.leftovers`).
"""

from __future__ import annotations

import logging
from typing import Callable, Collection, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ...errors import InvalidArgumentError, NotFoundError
from ...format.bundle_writer import PAGE_PHASE, BundleWriter, make_header
from ...format.crc import shared_executor
from ...format.merge import MergeInput, plan_merge, read_index
from ...format.naming import data_filename, index_filename, sharded_filename
from ...format.protos import tensor_bundle_pb2 as pb
from ...storage.base import FileSystem
from ...storage.location import Location
from ..incremental import piece_records
from ..plan import ShardPlan
from .base import BundleMaker, Committer, Setup, Written
from .leftovers import (
    clean_leftovers,
    committed_num_shards,
    existing_shard_counts,
    new_temp_dir,
    pick_num_shards,
    remove_stale_data_files,
)
from .writing import fill_bundle

__all__ = ["RenameCommitter", "merge_bundles"]

_log = logging.getLogger("shardckpt")


class RenameCommitter(Committer):
    """Shards as bundles in a temporary folder, merged by renames; the index rename commits."""

    #: where entries of 1 MiB or more start within a 4 KiB page of their data file (``None``: packed)
    page_phase: Optional[int] = PAGE_PHASE

    def __init__(self, location: Location, *, fsync: bool = True) -> None:
        super().__init__(location, fsync=fsync)
        self._extra: List[str] = []
        self._committed = False
        self._claim: object = None
        self._avoid: Optional[set] = None

    @property
    def temp_dir(self) -> str:
        """The save's temporary folder (known on every client after ``adopt``)."""
        assert self.setup.temp is not None, "prepare() or adopt() first"
        return self.setup.temp

    def prepare(self, extra_bundles: Optional[BundleMaker] = None) -> Setup:
        fs = self.location.fs
        fs.makedirs(self.location.directory)
        with fs.exclusive(self.location.directory):  # no other save is cleaning or committing here
            clean_leftovers(self.location)
            temp_dir = new_temp_dir(self.location)
            fs.makedirs(temp_dir)
            self._claim = fs.claim(temp_dir)  # live: other processes' cleaning leaves it alone
        self.setup = Setup(temp=temp_dir)
        if extra_bundles is not None:
            self._extra = list(extra_bundles(temp_dir))
        # first_shard_id stays 0: parts are merged after the extras, which keep their own names
        return self.setup

    def plan(self, total: int) -> int:
        self.num_shards = total
        return total

    def _part(self, shard_id: int) -> str:
        return sharded_filename(self.location.fs.join(self.temp_dir, "part"), shard_id, self.num_shards)

    def write_shard(self, shard: ShardPlan, shard_id: int) -> Written:
        part = self._part(shard_id)
        # Only the data must be durable: the part's index is merged into the checkpoint's.
        with BundleWriter(part, fsync=self.fsync, durable_index=False, fs=self.location.fs,
                          checksum_executor=shared_executor(), page_phase=self.page_phase) as writer:
            digests = fill_bundle(writer, shard)
            size = writer.bytes_written
        return Written(size, part=part, pieces=piece_records(shard, *digests) if digests is not None else None)

    def _before_index(self, written: List[Written], index: bytes) -> None:
        """[io client] Called with the merged index's bytes just before they are written (the commit)."""

    def _in_memory(self, written: List[Written]) -> Dict[str, List[Tuple[bytes, bytes]]]:
        """Parts whose index entries came with ``written`` rather than as a part index (none here)."""
        return {}

    def commit(self, written: List[Written]) -> None:
        parts = [str(w.part) for w in written]
        fs = self.location.fs
        with fs.exclusive(self.location.directory):  # one commit at a time in this folder
            self._avoid = existing_shard_counts(self.location)  # counts in use now: never overwritten
            self.num_shards = merge_bundles(self._extra + parts, self.location.prefix, delete_old_dirs=False,
                                            fsync=self.fsync, synced=parts, avoid_num_shards=self._avoid, fs=fs,
                                            before_index=lambda index: self._before_index(written, index),
                                            in_memory=self._in_memory(written))
            self._committed = True
            try:  # the previous checkpoint's files: the count just committed is known, no index read
                remove_stale_data_files(self.location, self.num_shards)
            except Exception as exc:  # committed all the same; the next save cleans up
                _log.warning("after committing %s, could not remove older data files: %s", self.location.prefix,
                             exc)

    def finish(self) -> None:
        self.location.fs.remove_tree(self.temp_dir)
        self._release()

    def abort(self) -> None:
        fs = self.location.fs
        if not self._committed and self._avoid is not None:  # the merge began: remove its data files
            with fs.exclusive(self.location.directory):
                committed = committed_num_shards(self.location)
                for count in existing_shard_counts(self.location) - self._avoid - {committed}:
                    for i in range(count):
                        fs.remove(data_filename(self.location.prefix, i, count))
        if self.setup.temp is not None:
            fs.remove_tree(self.temp_dir)
        self._release()

    def _release(self) -> None:
        if self._claim is not None:
            self.location.fs.release(self._claim)
            self._claim = None


def merge_bundles(prefixes: Sequence[str], destination: str, *, delete_old_dirs: bool = True,
                  allow_missing_files: bool = False, fsync: bool = False, synced: Collection[str] = (),
                  avoid_num_shards: Collection[int] = (), fs: Optional[FileSystem] = None,
                  before_index: Optional[Callable[[bytes], None]] = None,
                  in_memory: Optional[Mapping[str, Sequence[Tuple[bytes, bytes]]]] = None) -> int:
    """Merge the bundles at ``prefixes`` (in order) into ``destination`` by renaming; return its ``num_shards``.

    TensorFlow's ``MergeV2Checkpoints``: each input's data files get new shard ids in
    order of first use and are renamed to ``<destination>.data-I-of-N``; the merged
    index is written last, atomically (the commit). Everything is checked (a key stored
    whole in two inputs, missing data files) before the first rename. Departures from
    TensorFlow, all to keep data safe: merging into a prefix that is also an input keeps
    the new index; renames that would overwrite a data file not yet moved go through
    temporary names; when ``N`` is in ``avoid_num_shards`` (counts of data files already
    at ``destination``) empty data files are added until it is not.

    With ``fsync`` the data files (except the bundles in ``synced``, whose writer made
    them durable), the directory and the index are made durable, in the order that keeps
    the commit last. ``before_index`` is called with the index's bytes right before they are
    written (a committer's sidecar goes there). ``in_memory`` maps inputs that have no
    ``.index`` file to their ``(key, serialized entry)`` pairs: bundles of one data file
    (``<prefix>.data-00000-of-00001``, little-endian) whose entries the caller already holds
    (an incremental save's linked data files), so no index is written or read for them.
    """
    if not prefixes:
        raise InvalidArgumentError("merge needs at least one input prefix")
    if fs is None:
        fs = Location.of(destination).fs
    fs.makedirs(fs.dirname(destination))
    given = in_memory or {}
    one_file = pb.BundleHeaderProto.FromString(make_header(1)) if given else None
    present: List[str] = []
    for prefix in prefixes:
        if prefix not in given and not fs.exists(index_filename(prefix)):
            if allow_missing_files:
                continue
            raise NotFoundError("merge input has no index", path=index_filename(prefix))
        present.append(prefix)
    if not present:
        raise NotFoundError("none of the merge inputs exist: " + ", ".join(prefixes))

    def inputs() -> Iterator[MergeInput]:  # one part index in memory at a time
        for prefix in present:
            if prefix in given:
                assert one_file is not None
                yield prefix, one_file, given[prefix]
            else:
                header, items = read_index(prefix, fs)
                yield prefix, header, items

    merged = plan_merge(inputs())
    num_shards = pick_num_shards(merged.count, avoid_num_shards)
    renames = {source: data_filename(destination, i, num_shards) for i, source in enumerate(merged.sources)}
    index = merged.index(num_shards)
    for source in renames:  # everything is checked before the first rename
        if not fs.exists(source):
            raise NotFoundError("data file of a merge input is missing", path=source)
    _rename_all(renames, fs)
    written = list(renames.values())
    for pad in range(merged.count, num_shards):  # empty data files no entry points to
        path = data_filename(destination, pad, num_shards)
        fs.close(fs.open_write(path))
        written.append(path)
    if fsync:
        durable = set(synced)  # bundles whose data files their writer made durable
        for source, target in list(renames.items()) + [(p, p) for p in written[len(renames):]]:
            if source[:source.rfind(".data-")] not in durable:
                _fsync_file(fs, target)
        fs.fsync_dir(fs.dirname(destination))
    if before_index is not None:
        before_index(index)
    fs.write_atomic(index_filename(destination), index, fsync=fsync)
    if fsync:
        fs.fsync_dir(fs.dirname(destination))
    dest_dir = fs.normpath(fs.dirname(destination) or ".")
    for prefix in present:
        if prefix not in given and fs.normpath(prefix) != fs.normpath(destination):
            fs.remove(index_filename(prefix))
    if delete_old_dirs:
        for prefix in present:
            directory = fs.normpath(fs.dirname(prefix) or ".")
            if directory != dest_dir:
                fs.rmdir_if_empty(directory)
    return num_shards


def _fsync_file(fs: FileSystem, path: str) -> None:
    handle = fs.open_read(path)
    try:
        fs.fsync(handle, path)
    finally:
        fs.close(handle)


def _rename_all(renames: Dict[str, str], fs: FileSystem) -> None:
    """Rename sources to targets, never overwriting a source that has not moved yet."""
    sources = set(renames)
    clashing = any(dst in sources and dst != src for src, dst in renames.items())
    if not clashing:
        for src, dst in renames.items():
            if src != dst:
                fs.rename(src, dst)
        return
    staged = {}
    for src, dst in renames.items():
        tmp = fs.temp_name(dst)
        fs.rename(src, tmp)
        staged[tmp] = dst
    for tmp, dst in staged.items():
        fs.rename(tmp, dst)
