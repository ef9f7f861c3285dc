"""What dead saves leave at a prefix, and how to tell it from what a committed index uses.

A save that died may leave, beside ``<prefix>``:

* ``<prefix>_temp_<32 hex>/`` — the temporary folder of a rename-commit save;
* ``<prefix>.index.tempstate<digits>`` / ``<prefix>.data-*.tempstate<digits>`` /
  ``<prefix>.hashes.json.tempstate<digits>`` (an incremental save's sidecar) — files of an
  atomic write that never reached its rename;
* ``<prefix>.data-I-of-N`` with an ``N`` no index uses (the data files of a save that
  never committed; on object stores, data objects uploaded in place).

The committed index says which shard count is in use (:func:`committed_num_shards`,
which reads only the index's header). Data files of an index that cannot be read are
never removed: nothing is deleted that cannot be judged.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional, Set

from ...errors import UnsupportedError
from ...format.merge import read_index_header
from ...format.naming import DATA_SUFFIX_PATTERN, data_filename, index_filename, parse_data_filename
from ...storage.location import Location
from ...storage.object_store import ObjectInfo, ObjectStore

__all__ = ["TEMP_SUFFIX", "new_temp_dir", "clean_leftovers", "data_files", "existing_shard_counts",
           "committed_num_shards", "remove_data_files", "remove_stale_data_files", "NO_INDEX", "UNREADABLE_INDEX",
           "scan_in_place", "InPlaceScan", "abort_stale_uploads", "sibling_names",
           "object_store", "pick_num_shards"]

TEMP_SUFFIX = "_temp_"
NO_INDEX = -1
UNREADABLE_INDEX = -2


def new_temp_dir(location: Location) -> str:
    """A fresh temporary folder name beside the prefix: ``<prefix>_temp_<uuid4 hex>``."""
    return f"{location.prefix}{TEMP_SUFFIX}{uuid.uuid4().hex}"


def sibling_names(location: Location) -> List[str]:
    """Names in the prefix's folder (none when the folder does not exist)."""
    directory = location.directory
    if not location.fs.isdir(directory):
        return []
    return location.fs.listdir(directory)


_TEMPSTATE_SUFFIX = re.compile(r"(\.index|\.hashes\.json|" + DATA_SUFFIX_PATTERN + r")\.tempstate\d+")
_TEMP_DIR_SUFFIX = re.compile(re.escape(TEMP_SUFFIX) + r"[0-9a-f]{32}")


def _suffix_matches(pattern: "re.Pattern[str]", name: str, basename: str) -> bool:
    """Whether ``name`` is ``basename`` followed by a suffix matching ``pattern`` (no per-prefix regex)."""
    return name.startswith(basename) and pattern.fullmatch(name, len(basename)) is not None


def object_store(location: Location) -> ObjectStore:
    """The store of ``location`` as an :class:`~shardckpt.storage.object_store.ObjectStore` (what the
    in-place scans need); anything else is a :class:`~shardckpt.errors.UnsupportedError`."""
    if not isinstance(location.fs, ObjectStore):
        raise UnsupportedError(f"{type(location.fs).__name__} is not an object store: no in-place commit",
                               path=location.prefix)
    return location.fs


def committed_num_shards(location: Location) -> int:
    """``num_shards`` of the index at the prefix: :data:`NO_INDEX` (-1) without one,
    :data:`UNREADABLE_INDEX` (-2) when it cannot be read. Reads only the index's header."""
    fs = location.fs
    if not fs.exists(index_filename(location.prefix)):
        return NO_INDEX
    try:
        return int(read_index_header(location.prefix, fs).num_shards)
    except Exception:  # an unreadable index keeps its data files: never delete what we cannot judge
        return UNREADABLE_INDEX


def data_files(location: Location, names: List[str]) -> Dict[str, int]:
    """The data files of the prefix among ``names`` (a listing of its folder): path -> shard count."""
    found = {}
    base, directory, join = location.basename, location.directory, location.fs.join
    for name in names:
        parsed = parse_data_filename(name, base)
        if parsed is not None:
            found[join(directory, name)] = parsed[1]
    return found


def existing_shard_counts(location: Location) -> Set[int]:
    """Shard counts (``-of-N``) of the data files present at the prefix."""
    return set(data_files(location, sibling_names(location)).values())


def pick_num_shards(count: int, avoid: Collection[int]) -> int:
    """``count`` (at least 1), raised past every shard count in ``avoid`` (the counts of data files already at
    the prefix, which a new checkpoint must not overwrite; it adds empty padding data files instead)."""
    n = max(1, count)
    while n in avoid:
        n += 1
    return n


def remove_data_files(location: Location, num_shards: int) -> None:
    """Delete ``<prefix>.data-*-of-<num_shards>`` (missing ones are fine)."""
    for i in range(num_shards):
        location.fs.remove(data_filename(location.prefix, i, num_shards))


def remove_stale_data_files(location: Location, committed: Optional[int] = None) -> List[str]:
    """Delete data files at the prefix that the committed index does not use.

    ``committed``: the index's shard count when the caller knows it (it just wrote the
    index); otherwise the index's header is read.
    """
    current = committed_num_shards(location) if committed is None else committed
    if current == UNREADABLE_INDEX:
        return []
    removed = []
    for path, count in data_files(location, sibling_names(location)).items():
        if count != current:
            location.fs.remove(path)
            removed.append(path)
    return removed


def clean_leftovers(location: Location) -> List[str]:
    """Remove what a dead save to the prefix left (see the module docstring); return the removed paths."""
    fs = location.fs
    base = location.basename
    removed = []
    for name in sibling_names(location):
        path = location.sibling(name)
        if _suffix_matches(_TEMP_DIR_SUFFIX, name, base) and fs.isdir(path):
            if fs.claimed(path):  # a live save's folder (another process): not a leftover
                continue
            fs.remove_tree(path)
            removed.append(path)
        elif _suffix_matches(_TEMPSTATE_SUFFIX, name, base):
            fs.remove(path)
            removed.append(path)
    removed += remove_stale_data_files(location)
    return removed


@dataclass
class InPlaceScan:
    """What :func:`scan_in_place` found at a prefix on an object store."""

    #: shard counts of the data objects that remain (the committed checkpoint's and live writers'): to avoid
    avoid: Set[int] = field(default_factory=set)
    #: the committed checkpoint's data objects (path -> count): removed once a new index is committed
    previous: Dict[str, int] = field(default_factory=dict)
    #: whether an index object exists, and its ETag (``None`` where the store has none)
    has_index: bool = False
    index_etag: Optional[str] = None
    #: what was removed (a dead save's data objects and temp files)
    removed: List[str] = field(default_factory=list)


def _stale(info: ObjectInfo, grace: float, now: float) -> bool:
    mtime = info.get("mtime")
    return not isinstance(mtime, (int, float)) or now - float(mtime) >= grace


def scan_in_place(location: Location, now: Optional[float] = None) -> InPlaceScan:
    """Object stores, before a save: one listing; remove what dead saves left, never a live writer's objects.

    Data objects of a count that no index uses are a dead save's only once they are
    older than the store's ``stale_after`` seconds (a concurrent save may be uploading
    them now); younger ones are kept and their counts avoided. The index is read only
    when the listing shows something to judge (data objects without an index, or of
    more than one count); the data objects of an index that cannot be read are never
    removed here.
    """
    fs = object_store(location)
    now = time.time() if now is None else now
    grace = fs.stale_after
    details = fs.list_details(location.directory)
    scan = InPlaceScan()
    names = sorted(details)
    for name in names:
        if _suffix_matches(_TEMPSTATE_SUFFIX, name, location.basename) and _stale(details[name], grace, now):
            fs.remove(location.sibling(name))
            scan.removed.append(location.sibling(name))
    present = data_files(location, names)
    index_name = location.basename + ".index"
    scan.has_index = index_name in details
    if scan.has_index:
        etag = details[index_name].get("etag")
        scan.index_etag = str(etag) if etag is not None else None
    counts = set(present.values())
    committed = NO_INDEX
    if scan.has_index and len(counts) == 1:
        committed = next(iter(counts))
    elif counts and (not scan.has_index or len(counts) > 1):
        committed = committed_num_shards(location)
    for path, count in present.items():
        if count == committed:
            scan.previous[path] = count
        elif committed != UNREADABLE_INDEX and _stale(details[fs.basename(path)], grace, now):
            fs.remove(path)
            scan.removed.append(path)
            continue
        scan.avoid.add(count)
    return scan


_OWN_OBJECT = re.compile(r".+(\.index|" + DATA_SUFFIX_PATTERN + r")|checkpoint")


def abort_stale_uploads(location: Location, now: Optional[float] = None,
                        listed: Optional[Callable[[], None]] = None) -> List[str]:
    """Abort incomplete multipart uploads of checkpoint objects in the prefix's folder idle for ``stale_after``.

    Idle: started, and last given a part, more than ``stale_after`` seconds ago (the
    start time alone is not enough: a long upload that is still sending parts is live).

    Only names shardckpt writes there (``*.index``, ``*.data-I-of-N``, ``checkpoint``)
    are touched. Stores without multipart uploads: nothing to do. ``listed`` is called once
    the uploads are listed (also when listing fails): a save that runs this beside its own
    uploads starts them only after it, so that none of its own can be among those listed
    (a store may report a wrong start time, as moto does, and an upload with no part yet
    has no activity to tell it is live).
    """
    fs = object_store(location)
    try:
        found = fs.list_uploads(location.directory)
    finally:
        if listed is not None:
            listed()
    now = time.time() if now is None else now
    grace = fs.stale_after
    aborted = []
    for path, upload_id, started in found:
        if not _OWN_OBJECT.fullmatch(fs.basename(path)) or now - started < grace:
            continue
        if now - fs.upload_activity(path, upload_id) < grace:
            continue  # started long ago but a part landed recently: a live writer
        fs.abort_upload(path, upload_id)
        aborted.append(f"{path} (upload {upload_id})")
    return aborted
