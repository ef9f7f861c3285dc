"""Incremental saves: which pieces did not change since the previous checkpoint, and the layout that lets
whole data files be reused.

``CheckpointOptions(incremental=True)``. Every checkpoint stays a complete, standalone
tensor bundle (TensorFlow reads it; deleting an older checkpoint never breaks it): a data
file of the previous checkpoint that still holds unchanged pieces is *hard-linked* (local
disks; reflinked or copied where links fail) or *copied server-side* (object stores)
under the new checkpoint's names by the
incremental committers (:mod:`shardckpt.saving.commit.link`). Nothing of the new
checkpoint points into an older one.

**What is on disk.** Beside ``<prefix>.index`` an incremental save writes the sidecar
``<prefix>.hashes.json`` (JSON, never pickle), *before* the index (so a committed index
has its sidecar; not fsynced on its own: one a crash lost or tore fails the checks below
and only makes the next save a full one). It records the xxh3-128 hash of the exact
index bytes it belongs to (a sidecar whose index was replaced, or never committed, is
ignored), and per piece (key, slice spec): the xxh3-128 hash of its bytes, its change
token (a :class:`~shardckpt.Variable`'s version, meaningful only in the process that
wrote it), which shard record it was written in, the xxh3-128 hash of its first
:data:`HEAD_BYTES` bytes (the *head*; absent in older sidecars) and the xxh3-128 hash of
its *sample* (:func:`sample_hash`: its last :data:`HEAD_BYTES` bytes and
:data:`SAMPLE_WINDOWS` windows of :data:`SAMPLE_BYTES` spread evenly between; absent in
older sidecars and where it was not computed); per shard record: bytes
written (a linked file: none, and the bytes of its pieces in use), and the data file it was
linked or copied from (``shardckpt inspect`` shows
them); per data file of the checkpoint (``files``, by shard id; absent in older sidecars,
whose files are then never linked): its *stamp* at the commit (``id``), the number of saves
since its bytes were last proven good (``age``; 0: written by this save) and whether that
proof was a scrub (``scrubbed``), see :mod:`shardckpt.saving.scrub`.

**Change detection** (:func:`arrange`, on every client, for its own pieces, before any
byte is staged or written), cheapest first:

1. a piece whose change token (a :class:`~shardckpt.Variable`'s version stamp, new at
   every write through the API) equals the one recorded is unchanged, without reading
   a byte, when the variable never handed out its live buffer (``.array``,
   ``np.asarray(var)``): every write then went through the API. A variable that did
   hand it out is hashed (a direct write through a kept reference is caught), unless
   ``trust_versions`` says that direct writes are followed by ``mark_changed()``;
2. a piece whose head hash (its first :data:`HEAD_BYTES` bytes: microseconds) differs
   from the recorded one changed; so did one whose head matches but whose sample hash
   (about 8 KiB more, read from its end and from evenly spread windows: a change confined
   to the tail, or to any region wider than the windows' spacing, is seen there) differs.
   Such a piece is written, and hashed while its bytes stream to storage (no extra pass;
   when every piece changed, detection costs next to nothing);
3. otherwise its bytes are hashed (xxh3-128, about 10 GB/s) and compared with the
   recorded hash. Pieces the previous checkpoint does not know are hashed while their
   bytes stream to storage (no extra pass). Strings are always written. CRC32C is never
   used as an identity. A matching head or sample never proves a piece unchanged; only
   the whole hash (or a version stamp, 1.) does.

The sample of a piece that is written is computed on the writer's pass, right after its
bytes went out (:func:`shardckpt.saving.commit.writing.fill_bundle`); an unchanged piece
keeps its recorded one.

**Layout** (:func:`arrange`). A committed data file is never written into, so a data file
of the previous checkpoint whose pieces all belong to this client is *linked* into the new
checkpoint whole (its bytes are never copied) when its bytes are still proven good
(:meth:`Previous.reusable`: its stamp is the one its commit recorded, the scrub found no
damage, its last proof is recent; a file that is not is written from memory, and a linked
file's scrub is queued when due), and the new index names only its pieces
that did not change (offsets, sizes, checksums as the previous index has them). The old
bytes of its pieces that changed stay in the file, named by no entry of the new index
(TensorFlow's reader, like this one, reads entries by offset; nothing else in the file is
looked at); they are freed with the last checkpoint that links the file. Two rules bound
what that costs:

* a file is linked only while the pieces still in use fill at least :data:`LIVE_FRACTION`
  (3/4) of it, so a checkpoint's data files hold at most 4/3 of the bytes it names (a
  restore reads only the used ones: a file whose announced reads leave gaps is read
  through a guide, :mod:`shardckpt.storage.guided`, since the kernel's readahead would run
  through them; where guides are off, a cold restore reads the unused bytes too);
* at most one file per shard of the sharding callback plus :data:`EXTRA_LINKED_FILES` is
  linked, those with the most bytes in use.

Of every callback shard, what is not linked is written in at most two new files, never
merged across shards (a size limit or a device grouping of the callback holds): the
unchanged pieces whose file was not linked (the bytes cost of the two rules: they are
written once more, into a file that later saves link), and the pieces that changed or are
new (written anyway; when they change again, that file is named by nothing and not
linked). The first incremental save (no previous checkpoint) writes the callback's shards
as they are. So a checkpoint has about as many data files as a full save's, which matters
for a cold restore: each new file starts the kernel's readahead anew, with no read in
flight at the switch (256 files of 4 MiB read ~2.4x slower than one file of 1 GiB here).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import xxhash

from ..format.bundle_index import header_from_entry
from ..format.bundle_writer import byte_chunks, byte_view, encode_key, shape_proto, to_disk_array
from ..format.crc import default_context
from ..format.naming import data_filename, index_filename
from ..format.ordered_code import encode_tensor_name_slice
from ..format.protos import tensor_bundle_pb2 as pb
from ..format.sstable import read_table
from ..format.tensor_slice import parse_shape_and_slice
from ..storage.base import FileSystem
from .plan import PlanItem, Reuse, SavePlan, ShardPlan
from .scrub import (
    LINK_LIMIT,
    SCRUB_EVERY,
    Identity,
    ScrubEntry,
    Stamp,
    default_scrubber,
    file_identity,
    file_stamp,
    identities_of,
    scrubbed_store,
)

if TYPE_CHECKING:  # the committers import this module
    from .commit.base import Written

__all__ = ["LIVE_FRACTION", "EXTRA_LINKED_FILES", "HEAD_BYTES", "head_hash", "SAMPLE_WINDOWS", "SAMPLE_BYTES",
           "sample_windows", "sample_hash", "SIDECAR_SUFFIX", "sidecar_filename",
           "content_hash", "new_digest", "Previous", "load_previous", "arrange", "sidecar_bytes", "read_sidecar",
           "entry_key", "piece_records", "data_file_origins", "checkpoint_damaged", "retained_for_damage"]

_log = logging.getLogger("shardckpt")

SIDECAR_SUFFIX = ".hashes.json"
_FORMAT = "shardckpt-piece-hashes"
_VERSION = 1

PieceId = Tuple[str, str]

#: a data file of the previous checkpoint is linked only while the pieces still in use fill at least
#: this fraction of it (the rest: bytes of pieces that changed since, which no index entry names)
LIVE_FRACTION = 0.75
#: at most this many data files are linked beyond one per shard of the sharding callback
EXTRA_LINKED_FILES = 3
#: a piece's first bytes hashed for the cheap pre-check of change detection
HEAD_BYTES = 4096
#: the sample of a piece (:func:`sample_hash`): this many windows of :data:`SAMPLE_BYTES` bytes each
SAMPLE_WINDOWS = 64
SAMPLE_BYTES = 64
#: below this many bytes in all, change detection runs on the calling thread
_PARALLEL_HASH_BYTES = 8 << 20


def sidecar_filename(prefix: str) -> str:
    """``<prefix>.hashes.json``."""
    return prefix + SIDECAR_SUFFIX


def new_digest() -> Any:
    """A fresh xxh3-128 hasher (``update(bytes)``, ``hexdigest()``)."""
    return xxhash.xxh3_128()


def content_hash(value: Any, dtype: Any) -> Optional[str]:
    """xxh3-128 of ``value``'s bytes as stored (``None`` for strings, which are never reused)."""
    array, dt = to_disk_array(value, dtype)
    if dt.is_string:
        return None
    digest = new_digest()
    for buf in byte_chunks(array):
        digest.update(buf)
    return str(digest.hexdigest())


def head_hash(value: Any, dtype: Any) -> Optional[str]:
    """xxh3-128 of the first :data:`HEAD_BYTES` bytes of ``value`` as stored (``None`` for strings)."""
    array, dt = to_disk_array(value, dtype)
    if dt.is_string:
        return None
    digest = new_digest()
    left = HEAD_BYTES
    for buf in byte_chunks(array, HEAD_BYTES):
        digest.update(buf[:left])
        left -= min(left, len(buf))
        if not left:
            break
    return str(digest.hexdigest())


def sample_windows(nbytes: int) -> List[Tuple[int, int]]:
    """The ``(start, stop)`` byte ranges of a piece of ``nbytes`` bytes that its sample reads besides its last
    :data:`HEAD_BYTES`: :data:`SAMPLE_WINDOWS` windows of :data:`SAMPLE_BYTES` at equal steps, the first
    right after the head, the last at most one step before the tail. None for a piece shorter than
    ``2 * HEAD_BYTES + SAMPLE_WINDOWS * SAMPLE_BYTES`` bytes (its sample is all its bytes after the head)."""
    step = _window_step(nbytes)
    starts = [HEAD_BYTES + i * step for i in range(SAMPLE_WINDOWS)] if step else []
    return [(a, a + SAMPLE_BYTES) for a in starts]


def _window_step(nbytes: int) -> int:
    """The step between sample windows (0: the piece is too short for windows)."""
    step = (nbytes - 2 * HEAD_BYTES - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1)
    return step if step >= SAMPLE_BYTES else 0


def sample_hash(value: Any, dtype: Any) -> Optional[str]:
    """xxh3-128 of the *sample* of ``value`` as stored: its :data:`SAMPLE_WINDOWS` windows
    (:func:`sample_windows`) in order, then its last :data:`HEAD_BYTES` bytes; a piece too short for
    windows: its bytes after the head. ``None`` for strings, for pieces of at most :data:`HEAD_BYTES`
    bytes (the head holds them) and for arrays not laid out contiguously (reading the windows would
    copy the whole piece); the pre-check then rests on the head alone. Reads about 8 KiB: microseconds."""
    array, dt = to_disk_array(value, dtype)
    if dt.is_string or array.nbytes <= HEAD_BYTES or not array.flags.c_contiguous:
        return None
    flat = byte_view(array)
    n = len(flat)
    digest = new_digest()
    step = _window_step(n)
    if not step:
        digest.update(flat[HEAD_BYTES:])
    else:  # the windows as one strided view of the bytes, copied into one buffer (4 KiB)
        windows = np.ndarray((SAMPLE_WINDOWS, SAMPLE_BYTES), np.uint8, flat, HEAD_BYTES, (step, 1))
        digest.update(windows.copy())
        digest.update(flat[n - HEAD_BYTES:])
    return str(digest.hexdigest())


def entry_key(key: str, slice_spec: str) -> bytes:
    """The index key a piece is stored under (a slice's encoded key; a slice covering its tensor: the key)."""
    if not slice_spec:
        return encode_key(key)
    full_shape, tslice = parse_shape_and_slice(slice_spec)
    if tslice is None or tslice.is_full() or tuple(b - a for a, b in tslice.box(full_shape)) == tuple(full_shape):
        return encode_key(key)
    return encode_tensor_name_slice(encode_key(key), tslice.extents)


@dataclass(frozen=True)
class _Record:
    hash: Optional[str]
    token: Optional[str]
    head: Optional[str] = None
    sample: Optional[str] = None


@dataclass(frozen=True)
class FileUse:
    """A data file of the previous checkpoint that may be linked: its size, the identity and stamp it
    was checked with now, and the age of its last proof counting the save that links it
    (:mod:`shardckpt.saving.scrub`)."""

    path: str
    size: int
    identity: Identity
    stamp: Stamp
    age: int
    scrubbed: bool

    def record(self) -> Tuple[Tuple[str, Any], ...]:
        """What the new checkpoint's sidecar records of it (:attr:`Reuse.record`)."""
        return (("id", self.stamp), ("age", self.age), ("scrubbed", self.scrubbed))


@dataclass
class Previous:
    """What the previous checkpoint says about its pieces (from its index and verified sidecar)."""

    prefix: str
    num_shards: int
    entries: Dict[bytes, pb.BundleEntryProto]
    pieces: Dict[PieceId, _Record]
    #: data file (shard id) -> index keys of the entries holding bytes in it
    files: Dict[int, Set[bytes]]
    #: data file (shard id) -> where its last entry ends
    ends: Dict[int, int]
    fs: Optional[FileSystem] = None
    #: data file (shard id) -> what the commit recorded of it (``{"id": stamp, "age": n, "scrubbed": b}``)
    records: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    _uses: Dict[int, Optional[FileUse]] = field(default_factory=dict)

    def reusable(self, shard_id: int) -> Optional[FileUse]:
        """Data file ``shard_id`` if a save may link it, asked of the store once (an object store: a
        request); ``None`` when it must not be (its tensors are then written from memory): its stamp
        differs from the one its commit recorded (changed, truncated, replaced, missing; or no stamp
        recorded), the scrub found it damaged, or its last proof is more than
        :data:`~shardckpt.saving.scrub.LINK_LIMIT` saves old (see :mod:`shardckpt.saving.scrub`)."""
        if shard_id not in self._uses:
            self._uses[shard_id] = self._check(shard_id)
        return self._uses[shard_id]

    def _check(self, shard_id: int) -> Optional[FileUse]:
        path = data_filename(self.prefix, shard_id, self.num_shards)
        record = self.records.get(shard_id)
        if record is None or not isinstance(record.get("id"), list):
            _log.info("incremental save: %s has no recorded stamp (an older sidecar); not linked", path)
            return None
        try:
            assert self.fs is not None
            identity = file_identity(self.fs, path)
        except Exception as exc:  # missing or unreadable: its pieces are compared and written again
            _log.warning("incremental save: %s not linked (%s); its tensors are written from memory", path, exc)
            return None
        stamp = file_stamp(identity)
        if identity is None or stamp is None or stamp != record["id"]:
            _log.warning("incremental save: %s changed since its checkpoint was committed (recorded %s, now %s: "
                         "rewritten, truncated or replaced); not linked, its tensors are written from memory",
                         path, record["id"], stamp)
            return None
        size = int(identity[0])
        if self.ends.get(shard_id, 0) > size:  # cannot be with a matching stamp; never link past the end
            return None
        age, scrubbed = int(record.get("age", LINK_LIMIT)), bool(record.get("scrubbed", False))
        if scrubbed_store(path):
            scrubber = default_scrubber()
            if scrubber.damaged(identity):
                _log.warning("incremental save: %s was found damaged by the scrub; not linked", path)
                return None
            if scrubber.take_pass(identity):
                age, scrubbed = 0, True
            if age + 1 > LINK_LIMIT:
                _log.info("incremental save: %s was last proven %d saves ago (more than %d): not linked, its "
                          "tensors are written from memory", path, age, LINK_LIMIT)
                return None
        return FileUse(path, size, identity, stamp, age + 1, scrubbed)


def _index_digest(data: bytes) -> str:
    return str(xxhash.xxh3_128(data).hexdigest())


def read_sidecar(prefix: str, fs: FileSystem) -> Optional[Dict[str, Any]]:
    """The sidecar of ``prefix`` if it exists, parses and belongs to the index there now; else ``None``."""
    path = sidecar_filename(prefix)
    try:
        if not fs.exists(path) or not fs.exists(index_filename(prefix)):
            return None
        sidecar = json.loads(fs.read_bytes(path))
        index = fs.read_bytes(index_filename(prefix))
    except Exception as exc:  # unreadable: a full save, never a wrong one
        _log.info("incremental save: ignoring the sidecar of %s (%s)", prefix, exc)
        return None
    if not isinstance(sidecar, dict) or sidecar.get("format") != _FORMAT or sidecar.get("version") != _VERSION:
        return None
    if sidecar.get("index_xxh3_128") != _index_digest(index):
        _log.info("incremental save: the sidecar of %s describes another index; not used", prefix)
        return None
    sidecar["_index"] = index
    return sidecar


def load_previous(prefix: str, fs: FileSystem) -> Optional[Previous]:
    """The previous checkpoint at ``prefix`` as an incremental save needs it, or ``None`` (no usable sidecar)."""
    sidecar = read_sidecar(prefix, fs)
    if sidecar is None:
        return None
    path = index_filename(prefix)
    try:
        items = list(read_table(sidecar["_index"], path))
        header = header_from_entry(items[0][0], items[0][1], path)
        entries = {k: pb.BundleEntryProto.FromString(v) for k, v in items[1:]}
        pieces = {(str(p[0]), str(p[1])): _Record(p[2], p[3], p[5] if len(p) > 5 else None,
                                                  p[6] if len(p) > 6 else None) for p in sidecar["pieces"]}
    except Exception as exc:
        _log.info("incremental save: cannot use %s as the previous checkpoint (%s)", prefix, exc)
        return None
    files: Dict[int, Set[bytes]] = {}
    ends: Dict[int, int] = {}
    for key, entry in entries.items():
        if not entry.slices and entry.size > 0:
            shard = int(entry.shard_id)
            files.setdefault(shard, set()).add(key)
            ends[shard] = max(ends.get(shard, 0), int(entry.offset) + int(entry.size))
    return Previous(prefix, int(header.num_shards), entries, pieces, files, ends, fs, _file_records(sidecar))


def _file_records(sidecar: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """The sidecar's ``files`` (data file -> stamp and proof); empty in sidecars written before them."""
    files = sidecar.get("files")
    if not isinstance(files, dict):
        return {}
    out = {}
    for number, record in files.items():
        if isinstance(record, dict) and str(number).isdigit():
            out[int(number)] = record
    return out


def _same_form(item: PlanItem, entry: pb.BundleEntryProto) -> bool:
    return int(entry.dtype) == item.dtype.enum and tuple(d.size for d in entry.shape.dim) == item.shape \
        and not entry.slices


#: ``("unchanged" | "changed" | "new", hash, head hash, sample hash)``; a hash or sample of ``None`` (not
#: a string) is computed on the writer's pass
_Verdict = Tuple[str, Optional[str], Optional[str], Optional[str]]


def _detect(item: PlanItem, previous: Previous, trust_versions: bool) -> "_Verdict | _Record":
    """The verdict on one piece when it is known without reading the piece's bytes (beyond its head,
    for a new one); else the record its bytes must be compared with (:func:`_by_bytes`)."""
    if item.dtype.is_string:
        return "new", None, None, None
    record = previous.pieces.get((item.key, item.slice_spec))
    entry = previous.entries.get(entry_key(item.key, item.slice_spec))
    if record is None or record.hash is None or entry is None or not _same_form(item, entry):
        return "new", None, head_hash(item.source.get(), item.dtype.enum), None
    if item.version is not None and item.version == record.token and (trust_versions or item.version_proves):
        return "unchanged", record.hash, record.head, record.sample
    return record


def _by_bytes(item: PlanItem, record: _Record) -> _Verdict:
    """The verdict on a piece from its bytes: its head first, then (same head) its sample, then (same
    sample) its whole xxh3-128 hash. A piece found changed by its head or sample is not hashed here:
    its hash and sample are computed on the writer's pass."""
    value = item.source.get()
    head = head_hash(value, item.dtype.enum)
    if record.head is not None and head != record.head:  # changed for sure: no hashing pass
        return "changed", None, head, None
    sample = sample_hash(value, item.dtype.enum)
    if record.sample is not None and sample is not None and sample != record.sample:
        return "changed", None, head, None
    digest = content_hash(value, item.dtype.enum)
    return ("unchanged" if digest == record.hash else "changed"), digest, head, sample


def _detect_all(items: Sequence[PlanItem], previous: Previous, trust_versions: bool) -> List[_Verdict]:
    """The verdict on every item: versions and the previous checkpoint first (no byte read), then the
    pieces left are compared by their bytes, on the checksum helpers in batches of about equal bytes
    when there is much to hash (xxh3 releases the GIL: it runs on every core)."""
    found = [_detect(item, previous, trust_versions) for item in items]
    left = [n for n, f in enumerate(found) if isinstance(f, _Record)]
    out: List[Any] = list(found)
    helpers = default_context()
    workers = min(len(left), helpers.workers)
    if workers < 2 or sum(items[n].nbytes for n in left) < _PARALLEL_HASH_BYTES:
        for n in left:
            out[n] = _by_bytes(items[n], found[n])  # type: ignore[arg-type]
        return out
    batches: List[List[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for n in sorted(left, key=lambda n: -items[n].nbytes):  # largest first, onto the lightest batch
        lightest = loads.index(min(loads))
        batches[lightest].append(n)
        loads[lightest] += items[n].nbytes

    def run(batch: List[int]) -> List[_Verdict]:
        return [_by_bytes(items[n], found[n]) for n in batch]  # type: ignore[arg-type]

    pool = helpers.executor
    for batch, future in [(b, pool.submit(run, b)) for b in batches if b]:
        for n, verdict in zip(batch, future.result()):
            out[n] = verdict
    return out


def _reuse(previous: Previous, shard_id: int, members: List[PlanItem], use: FileUse) -> Reuse:
    """The reuse of data file ``shard_id`` of the previous checkpoint holding exactly ``members``."""
    entries: Dict[bytes, pb.BundleEntryProto] = {}
    size = 0
    for item in members:
        key = entry_key(item.key, item.slice_spec)
        entry = pb.BundleEntryProto()
        entry.CopyFrom(previous.entries[key])
        entry.shard_id = 0
        size += int(entry.size)
        entries[key] = entry
        if key != encode_key(item.key):  # a slice: the full entry lists this file's slices
            full_shape, tslice = parse_shape_and_slice(item.slice_spec)
            assert tslice is not None
            full = entries.setdefault(encode_key(item.key), pb.BundleEntryProto(
                dtype=item.dtype.enum, shape=shape_proto(full_shape)))  # type: ignore[arg-type]
            full.slices.append(tslice.to_proto())
    return Reuse(use.path, tuple(sorted((k, e.SerializeToString()) for k, e in entries.items())), size,
                 use.record())


def _linked_files(candidates: Dict[int, List[PlanItem]], previous: Previous, limit: int) -> Dict[int, List[PlanItem]]:
    """The previous data files to link, from ``candidates`` (file -> its unchanged pieces, every piece
    it holds being this client's): those that may be reused (:meth:`Previous.reusable`) and whose pieces
    still in use fill at least :data:`LIVE_FRACTION` of the file, at most ``limit`` of them (the ones
    with the most bytes in use)."""
    live = {shard_id: sum(int(previous.entries[entry_key(m.key, m.slice_spec)].size) for m in members)
            for shard_id, members in candidates.items()}
    kept: List[int] = []
    for shard_id in sorted(live, key=lambda n: (-live[n], n)):  # most bytes in use first; sizes asked lazily
        if len(kept) >= limit:
            break
        use = previous.reusable(shard_id)
        if use is not None and live[shard_id] > 0 and live[shard_id] >= LIVE_FRACTION * use.size:
            kept.append(shard_id)
    return {shard_id: candidates[shard_id] for shard_id in sorted(kept)}


def arrange(plan: SavePlan, previous: Optional[Previous], *, trust_versions: bool = False) -> SavePlan:
    """This client's plan for an incremental save (see the module docstring): linked data files as shards
    of their own, the rest of each callback shard in at most two files (unchanged, changed), hashes attached."""
    if previous is None:  # a full save, shards as the callback made them; hashes computed while the bytes stream
        shards = tuple(replace(s, hashes=(None,) * len(s.items), heads=tuple(
            None if i.dtype.is_string else head_hash(i.source.get(), i.dtype.enum) for i in s.items))
            for s in plan.shards)
        return replace(plan, shards=shards)
    items = plan.items
    verdicts = dict(zip(map(id, items), _detect_all(items, previous, trust_versions)))
    by_entry = {entry_key(item.key, item.slice_spec): item for item in items}
    candidates: Dict[int, List[PlanItem]] = {}
    for shard_id, keys in sorted(previous.files.items()):
        found = [by_entry[k] for k in keys if k in by_entry]
        if len(found) < len(keys):  # a piece of another client (or one no longer saved) lives there
            continue
        unchanged = [m for m in found if verdicts[id(m)][0] == "unchanged"]
        if unchanged:
            candidates[shard_id] = sorted(unchanged, key=lambda m: (m.key, m.slice_spec))
    linked = _linked_files(candidates, previous, len(plan.shards) + EXTRA_LINKED_FILES)
    taken = {id(m) for members in linked.values() for m in members}
    out: List[ShardPlan] = []
    for shard_id, members in linked.items():
        task = members[0].tensor.task
        use = previous.reusable(shard_id)
        assert use is not None
        reuse = _reuse(previous, shard_id, members, use)
        _scrub_if_due(use, reuse)
        out.append(ShardPlan(len(out), task, tuple(members), tuple(verdicts[id(m)][1] for m in members),
                             reuse, tuple(verdicts[id(m)][2] for m in members),
                             tuple(verdicts[id(m)][3] for m in members)))
    for shard in plan.shards:
        rest = [i for i in shard.items if id(i) not in taken]
        stable = tuple(i for i in rest if verdicts[id(i)][0] == "unchanged")
        moving = tuple(i for i in rest if verdicts[id(i)][0] != "unchanged")
        # unchanged pieces whose file is not linked (too little of it in use, or too many files) are
        # rewritten apart from the changed ones, so that later saves can link their file
        for group in [g for g in (stable, moving) if g]:
            out.append(ShardPlan(len(out), shard.task, group, tuple(verdicts[id(i)][1] for i in group),
                                 heads=tuple(verdicts[id(i)][2] for i in group),
                                 samples=tuple(verdicts[id(i)][3] for i in group)))
    reused_bytes = sum(s.reuse.size for s in out if s.reuse is not None)
    _log.info("incremental save: %d of %d data files of %s linked (%d bytes in use), %d pieces written",
              len(linked), len(previous.files), previous.prefix, reused_bytes,
              sum(len(s.items) for s in out if s.reuse is None))
    return replace(plan, shards=tuple(out))


def _scrub_if_due(use: FileUse, reuse: Reuse) -> None:
    """Queue the scrub of a file this save links when it is due: never read back since it was written,
    or linked in :data:`~shardckpt.saving.scrub.SCRUB_EVERY` saves since its last proof."""
    if not scrubbed_store(use.path) or (use.scrubbed and use.age < SCRUB_EVERY):
        return
    checks = []
    for key, value in reuse.entries:
        entry = pb.BundleEntryProto.FromString(value)
        if not entry.slices and entry.size > 0:
            checks.append(ScrubEntry(key, int(entry.offset), int(entry.size), int(entry.crc32c)))
    default_scrubber().submit(use.path, use.identity, checks)


def piece_records(shard: ShardPlan, hashes: Sequence[Optional[str]],
                  samples: Optional[Sequence[Optional[str]]] = None) -> List[List[Any]]:
    """What a written shard tells the sidecar about its pieces: ``[key, slice spec, hash, token, head,
    sample]`` each (``samples`` default: the shard's)."""
    heads = shard.heads or (None,) * len(shard.items)
    samples = samples if samples is not None else shard.samples or (None,) * len(shard.items)
    return [[item.key, item.slice_spec, h, item.version, head, sample]
            for item, h, head, sample in zip(shard.items, hashes, heads, samples)]


def sidecar_bytes(written: Sequence[Written], index: bytes, fs: FileSystem, prefix: str) -> bytes:
    """The sidecar of the checkpoint at ``prefix`` whose shards reported ``written`` and whose index is
    ``index``; called at the commit, once every data file has its final name (their stamps are taken now;
    a linked file's is the one the save checked before linking it)."""
    pieces: List[List[Any]] = []
    shards: List[Dict[str, Any]] = []
    for number, w in enumerate(written):
        for record in w.pieces or ():  # stored as [key, slice spec, hash, token, shard record, head, sample]
            pieces.append(list(record[:4]) + [number] + list(record[4:6]))
        shards.append({"bytes_written": w.bytes, "bytes_reused": w.reused, "how": w.how,
                       "reused_from": fs.basename(w.source) if w.source else None})
    doc = {"format": _FORMAT, "version": _VERSION, "index_xxh3_128": _index_digest(index),
           "pieces": sorted(pieces, key=lambda p: (p[0], p[1])), "shards": shards,
           "files": _files_section(written, pieces, index, fs, prefix)}
    return json.dumps(doc, separators=(",", ":")).encode()


def _files_section(written: Sequence[Written], pieces: List[List[Any]], index: bytes, fs: FileSystem,
                   prefix: str) -> Dict[str, Dict[str, Any]]:
    """The sidecar's ``files``: per data file (shard id) its stamp, the age of its last proof (0: written
    by this save) and whether that proof was a scrub (:mod:`shardckpt.saving.scrub`)."""
    items = list(read_table(index, index_filename(prefix)))
    num_shards = int(header_from_entry(items[0][0], items[0][1], index_filename(prefix)).num_shards)
    reused: Dict[int, Written] = {}
    for number, shard_id in _files_of_records(pieces, items[1:]).items():
        if written[number].file:
            reused[shard_id] = written[number]
    paths = [data_filename(prefix, i, num_shards) for i in range(num_shards)]
    try:
        now = identities_of(fs, [p for i, p in enumerate(paths) if i not in reused or reused[i].how != "link"])
    except Exception as exc:  # no stamps: the next save links none of these files
        _log.warning("incremental save: cannot stamp the data files of %s (%s)", prefix, exc)
        now = {}
    files: Dict[str, Dict[str, Any]] = {}
    for i, path in enumerate(paths):
        report = reused.get(i)
        record: Dict[str, Any] = dict(report.file or {}) if report else {"age": 0, "scrubbed": False}
        if not report or report.how != "link":  # written now, or a copy: a file of its own
            record["id"] = file_stamp(now.get(path))
        files[str(i)] = record
    return files


def _files_of_records(pieces: Sequence[Sequence[Any]], items: Sequence[Tuple[bytes, bytes]]) -> Dict[int, int]:
    """Shard record (the sidecar's numbering of the written shards) -> the data file (shard id) its pieces
    lie in, from the index's ``(key, entry)`` items. Records without pieces are not listed."""
    record_of = {entry_key(str(p[0]), str(p[1])): int(p[4]) for p in pieces}
    out: Dict[int, int] = {}
    for key, value in items:
        number = record_of.get(key)
        if number is None or number in out:
            continue
        entry = pb.BundleEntryProto.FromString(value)
        if not entry.slices:
            out[number] = int(entry.shard_id)
    return out


def data_file_origins(prefix: str, fs: FileSystem) -> Optional[Dict[int, Dict[str, Any]]]:
    """For a checkpoint written by an incremental save: data file (shard id) -> ``{"how": "written" | "link" |
    "reflink" | "copy" | "server-copy", "reused_from": data file name or None}``; ``None`` without a valid
    sidecar. Data files no sidecar piece lives in (registered savers', padding) are not listed."""
    sidecar = read_sidecar(prefix, fs)
    if sidecar is None:
        return None
    try:
        shards = sidecar["shards"]
        out: Dict[int, Dict[str, Any]] = {}
        items = list(read_table(sidecar["_index"], index_filename(prefix)))[1:]
        for number, shard_id in sorted(_files_of_records(sidecar["pieces"], items).items()):
            if shard_id in out:
                continue
            record = shards[number]
            out[shard_id] = {"how": str(record.get("how", "written")), "reused_from": record.get("reused_from")}
        return out
    except Exception as exc:  # a sidecar that does not parse describes nothing
        _log.info("cannot describe the data files of %s from its sidecar: %s", prefix, exc)
        return None


def checkpoint_damaged(prefix: str, fs: FileSystem) -> bool:
    """Whether a data file of the incremental checkpoint at ``prefix`` is known damaged: its stamp differs
    from the one the commit recorded (changed, truncated, replaced or missing; a file the scrub found
    damaged has its mtime moved) or this process's scrub found it damaged. ``False`` for a checkpoint
    without a sidecar recording stamps (nothing is known of it). Costs a read of the index and sidecar and
    one stat per data file (an object store: a listing)."""
    sidecar = read_sidecar(prefix, fs)
    if sidecar is None:
        return False
    records = _file_records(sidecar)
    if not records:
        return False
    try:
        first = next(iter(read_table(sidecar["_index"], index_filename(prefix))))
        num_shards = int(header_from_entry(first[0], first[1], index_filename(prefix)).num_shards)
    except Exception:
        return True  # the index itself does not parse
    paths = {i: data_filename(prefix, i, num_shards) for i in records if i < num_shards}
    try:
        now = identities_of(fs, list(paths.values()))
    except Exception as exc:
        _log.info("cannot stamp the data files of %s (%s): taken as undamaged", prefix, exc)
        return False
    scrubber = default_scrubber()
    for i, path in paths.items():
        identity = now.get(path)
        if identity is None or file_stamp(identity) != records[i].get("id") or scrubber.damaged(identity):
            return True
    return False


def retained_for_damage(doomed: Sequence[str], kept: Sequence[str], fs: FileSystem) -> List[str]:
    """Which of ``doomed`` (checkpoints retention is about to delete, each older than every one of
    ``kept``, oldest first) must stay: the newest checkpoint not known damaged
    (:func:`checkpoint_damaged`), when it is among ``doomed``, i.e. when every newer checkpoint shares a
    data file found damaged. Usually the newest of ``kept`` is sound and this costs one check."""
    if not doomed:
        return []
    for prefix in reversed(list(doomed) + list(kept)):
        if not checkpoint_damaged(prefix, fs):
            if prefix in doomed:
                _log.warning("retention keeps %s: it is the newest checkpoint not known damaged (every newer "
                             "one shares a data file found changed or damaged)", prefix)
                return [prefix]
            return []
    return []
