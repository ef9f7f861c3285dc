"""Read a tensor bundle: look entries up in ``<prefix>.index``, read values from the data files.

:class:`BundleReader` reads whole tensors (assembling sliced ones) and arbitrary regions
of them, from the store its caller hands it (a :class:`~shardckpt.storage.location.Location`,
or a prefix with its ``fs``: nothing in :mod:`shardckpt.format` looks a store up). It is
the face of rooms with one job each:

* :mod:`.bundle_index` — the index: its header (the one header parser), entries looked
  up and checked by key; a small index is read and checked whole when the reader opens,
  a large one is not read (its footer and index block are, and each lookup reads and
  checks the one data block that may hold its key);
* :mod:`.bundle_pieces` — where a tensor's values are stored (its pieces: the whole
  entry, or its slices) and which pieces overlap a region;
* :mod:`.bundle_files` — the data files, opened on first use and held to the
  checkpoint that was opened;
* :mod:`.region_reads` — a region read issues positional reads of just the byte ranges
  that hold the region, straight into the destination array, as one batch of runs for
  the filesystem's ``pread_batch``; a strided destination (columns of a tensor) gets the
  runs cut where either the file or the destination has a gap, each read straight into
  its place (no temporary);
* :mod:`.whole_reads` and :mod:`.read_session` — whole-entry reads
  (:class:`~shardckpt.format.read_session.WholeEntries`) go through a
  :class:`~shardckpt.format.whole_reads.ReadPump`: large entries are split into units,
  small neighbours gathered into one request, and the spans read and checksummed on
  several threads at once (the calling thread and the helpers of a
  :class:`~shardckpt.format.crc.ChecksumContext`), each piece checksummed while it is
  still in the CPU cache; the pieces' CRC32Cs are combined and compared with the stored
  one. (Stores with a preferred request size, ``read_step``, read entries in units of
  that size instead.) A :class:`ReadSession` groups reads whose completion and checks
  are deferred to the end of the session; each session owns its own pending checks;
* :mod:`.announce` — the byte ranges of a batch of reads announced to the store
  ahead of them (:meth:`BundleReader.prefetch`);
* :mod:`.buffers` — destinations the reader allocates (``out=None``) are C-contiguous
  and, from a page up, 64-byte aligned (JAX on CPU shares such buffers instead of
  copying them).

The reader sees the checkpoint it opened, or raises
:class:`~shardckpt.errors.CheckpointReplacedError`: the identity of the index and
of every data file (inode/size/mtime locally, size and ETag on object stores) is
recorded when the index is opened (an open that finds the index replaced meanwhile
starts again, data file names included: they follow the shard count of the index
that is kept); a data file opened later must still have it (one deleted since then
is a replaced checkpoint too, not a missing file), and reads whose bytes no checksum
covers (region reads, ``verify=False``) check the file's identity again after reading.
A checksum that does not match on a file whose identity is unchanged is damage
(:class:`~shardckpt.errors.DataLossError`).

Every problem with the files is a :mod:`shardckpt.errors` exception naming the
file and the key; sizes are checked against the files before anything is
allocated, so a hostile index cannot make the reader allocate unbounded memory.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import InvalidArgumentError, NotFoundError
from ..storage.base import FileSystem, normalize
from ..storage.location import Location
from ..storage.object_store import ObjectStore
from . import crc
from .announce import announce_pieces, announces, plan_regions
from .buffers import aligned_empty
from .bundle_files import DataFiles
from .bundle_index import MAX_SUPPORTED_VERSION, BundleIndex, KeyLike, check_shape, key_bytes, key_str
from .bundle_pieces import PieceLookup, StoredPiece, region_box, relative
from .dtypes import DType, from_enum
from .protos import tensor_bundle_pb2 as pb
from .read_session import _MIN_UNIT, _SUB, _UNIT, ReadSession, WholeEntries  # noqa: F401 (the unit sizes: re-exported)
from .region_reads import decode_objects, read_box, scatter_runs
from .tensor_slice import Box, TensorSlice, box_shape, box_volume, boxes_tile, full_box

__all__ = ["BundleReader", "ReadSession", "StoredPiece", "MAX_SUPPORTED_VERSION", "region_box", "iter_tensors"]

_scatter_runs = scatter_runs  # the name tests knew it by
_check_shape = check_shape


class BundleReader:
    """Random access to the tensors of the bundle at ``location``.

    ``location`` is a :class:`~shardckpt.storage.location.Location` (the store and the
    prefix, resolved by the caller: :meth:`Location.of(path) <shardckpt.storage.location.Location.of>`),
    or the prefix itself with the store as ``fs``. ``context`` owns the helper threads
    that read and checksum units of large entries (default:
    :func:`~shardckpt.format.crc.default_context`). ``load_index``: ``True`` reads the
    whole index and checks all of it when opening; ``False`` reads only its footer and
    index block, then the data blocks that lookups need (a 10^6-entry index opens in a few
    milliseconds; :meth:`keys` still reads it whole, once); ``None`` (default) reads it
    whole when the file is at most 1 MiB. Safe to share between threads; each thread's
    :class:`ReadSession` keeps its own pending checks.
    """

    def __init__(self, location: Union[Location, str], *, fs: Optional[FileSystem] = None,
                 context: Optional[crc.ChecksumContext] = None, load_index: Optional[bool] = None) -> None:
        if isinstance(location, Location):
            prefix = location.prefix
            fs = fs if fs is not None else location.fs
        else:
            prefix = normalize(location)
            if fs is None:
                raise InvalidArgumentError("a BundleReader reads from the store its caller gives: pass a "
                                           "storage.location.Location (Location.of(path)) or fs= with the prefix",
                                           path=prefix)
        self.prefix = prefix
        self._fs = fs
        self._context = context if context is not None else crc.default_context()
        identity_of = fs.identity
        #: object stores: reads held to the version an identity names (``If-Match``), see BundleIndex
        pin = fs.pin if isinstance(fs, ObjectStore) else None
        self._index = index = BundleIndex(prefix, fs, identity_of=identity_of, pin=pin, load_index=load_index)
        self.index_path = index.index_path
        self.header: pb.BundleHeaderProto = index.header
        self.num_shards = index.num_shards
        self.big_endian = index.big_endian
        self._lookup = PieceLookup(index)
        self._prefetches: Optional[bool] = None  # prefetches: asked once, on first use
        self._files = files = DataFiles(index, fs, identity_of)
        self._locate = files.locate
        self._check_unchanged = files.check_unchanged
        self._wholes = wholes = WholeEntries(fs, self._context, index, files)
        # what ReadSession asks of its reader (bound methods: no hop on the restore's per-tensor path)
        self._whole_read = wholes.plan
        self._read_whole = wholes.read
        self._pump = wholes.pump
        self._check_entry = wholes.check_entry

    # -- the index and the pieces (see .bundle_index, .bundle_pieces) -------------
    def keys(self, include_slices: bool = False) -> List[bytes]:
        """All keys in index order; slice entries only with ``include_slices``."""
        return self._index.keys(include_slices)

    def __contains__(self, key: KeyLike) -> bool:
        return key in self._index

    def entry(self, key: KeyLike) -> pb.BundleEntryProto:
        """The parsed and checked ``BundleEntryProto`` of ``key``."""
        return self._index.entry(key)

    def dtype(self, key: KeyLike) -> DType:
        return self._index.dtype(key)

    def shape(self, key: KeyLike) -> Tuple[int, ...]:
        return self._index.shape(key)

    def pieces(self, key: KeyLike) -> List[StoredPiece]:
        """Where the tensor's values are stored: one piece, or one per slice."""
        return self._lookup.pieces(key)

    def piece_at(self, key: KeyLike, start: Sequence[int]) -> Optional[StoredPiece]:
        """The stored piece of ``key`` whose box starts at ``start`` (``None``: no such piece).

        Only that piece's slice entry is looked up and checked (a rank that reads one
        chunk of a tensor sliced many ways looks up one entry, not all of them).
        """
        return self._lookup.piece_at(key, start)

    def piece_boxes(self, key: KeyLike) -> List[Box]:
        """Where the tensor's stored pieces lie (as :meth:`pieces` gives them), from its own entry
        only: the slice entries are looked up (and checked) when :meth:`pieces` is called."""
        return self._lookup.piece_boxes(key)

    # -- data files (see .bundle_files) ----------------------------------------------
    def data_path(self, shard_id: int) -> str:
        return self._files.path(shard_id)

    def check_piece(self, piece: StoredPiece, dt: DType) -> None:
        """Check, reading no tensor bytes, that ``piece`` lies inside its data file and holds exactly its
        box of ``dt``; raises :class:`~shardckpt.errors.DataLossError` naming file and key otherwise."""
        self._locate(piece, dt)

    def close(self) -> None:
        self._index.close()
        self._files.close()

    def __enter__(self) -> "BundleReader":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- values ----------------------------------------------------------------
    def session(self, *, defer: bool = True) -> "ReadSession":
        """A :class:`ReadSession` over this reader (use it as a context manager)."""
        return ReadSession(self, defer=defer)

    @contextlib.contextmanager
    def deferred_verification(self) -> Iterator["ReadSession"]:
        """Kept for callers written against deferred checks: a non-deferring :class:`ReadSession`.

        Checksums are no longer deferred across reads: each whole-entry read is
        checksummed on several threads as its bytes arrive, and every read returns
        with its values complete and checked. Use :meth:`session` to defer reads.
        """
        with ReadSession(self, defer=False) as session:
            yield session

    def read(self, key: KeyLike, *, verify: bool = True, session: Optional["ReadSession"] = None) -> np.ndarray:
        """The whole tensor ``key`` (sliced tensors are assembled)."""
        return self.read_region(key, None, verify=verify, session=session)

    def read_region(self, key: KeyLike, region: Optional[Union[Box, TensorSlice, str]] = None,
                    out: Optional[np.ndarray] = None, *, verify: bool = True,
                    session: Optional["ReadSession"] = None) -> np.ndarray:
        """Read ``region`` of tensor ``key`` (the whole tensor when ``None``) into ``out``.

        ``region`` is a box of ``(start, stop)`` pairs, a :class:`TensorSlice` or
        its text form (``"0,5:-"``). ``out`` (allocated when omitted, 64-byte aligned) must
        have the region's shape and the stored dtype. Only stored pieces that overlap the
        region are read; pieces read whole have their checksum verified, the others
        have their file's identity checked after the read. Within a deferring
        ``session`` the read may complete when the session does.
        """
        kb = key_bytes(key)
        if region is None:
            if session is not None and session.defer and verify:  # the common case of a restore
                queued = self._whole_read(kb, out)
                if queued is not None:
                    session._queue(queued[1])
                    return queued[0]
            entry = self._index.entry(kb)
            if not entry.slices:  # one stored entry read whole
                return self._read_entry(kb, entry, out, verify, session)
        dt = self._index.dtype(kb)
        shape = self._index.shape(kb)
        box = region_box(region, shape, self.prefix, kb)
        overlaps = self._lookup.overlapping(kb, box)
        whole = len(overlaps) == 1 and overlaps[0][1] == box  # the common case: one piece holds it all
        if box_volume(box) > 0 and not whole:
            problem = boxes_tile([common for _, common in overlaps], box)
            if problem is not None:
                raise NotFoundError(f"does not have sufficient slices for region {list(box)}: {problem}",
                                    path=self.prefix, key=kb)
        region_shape = box_shape(box)
        located = [self._locate(piece, dt) for piece, _ in overlaps]  # sizes checked before allocating
        check_shape(self._index.entry(kb), self.index_path, kb, dt.itemsize or 8)
        out = self._destination(out, region_shape, dt, kb)
        for (piece, common), where in zip(overlaps, located):
            index = tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(common, box))
            dest = out[index] if index else out
            self._read_piece(piece, dt, relative(common, piece), dest, verify, session, where)
        return out

    def _destination(self, out: Optional[np.ndarray], shape: Tuple[int, ...], dt: DType, key: bytes,
                     piece: Optional[StoredPiece] = None) -> np.ndarray:
        """``out`` checked to have ``shape`` and the stored dtype, or a new (64-byte aligned) array."""
        if out is None:
            return aligned_empty(shape, dt.numpy)
        if tuple(out.shape) != shape or out.dtype != dt.numpy:
            where = piece.where() if piece is not None else {"key": key}
            raise InvalidArgumentError(f"destination has shape {list(out.shape)} and dtype {out.dtype}; "
                                       f"expected {list(shape)} and {dt.numpy}", path=self.prefix, **where)
        return out

    def _read_entry(self, kb: bytes, entry: pb.BundleEntryProto, out: Optional[np.ndarray], verify: bool,
                    session: Optional["ReadSession"]) -> np.ndarray:
        """:meth:`read_region` of a whole tensor stored as one entry (same checks, fewer steps)."""
        dt = from_enum(entry.dtype)
        shape = tuple(int(d.size) for d in entry.shape.dim)
        box = full_box(shape)
        piece = StoredPiece(box, kb, entry, kb)
        located = self._locate(piece, dt)  # sizes (and the shape) checked before allocating
        out = self._destination(out, shape, dt, kb)
        self._read_piece(piece, dt, box, out, verify, session, located)
        return out

    def read_piece_region(self, piece: StoredPiece, local: Box, out: Optional[np.ndarray] = None, *,
                          verify: bool = True, session: Optional["ReadSession"] = None) -> np.ndarray:
        """Read the box ``local`` (relative to the piece) of one stored piece into ``out``.

        For callers that already hold the piece (a DCP read item names the stored
        chunk it reads from): no search over the tensor's other slices. ``out``
        (allocated when omitted; may be a strided view) must have the box's shape
        and the stored dtype. Only the byte runs of the box are read; a piece read
        whole has its checksum verified (within a deferring ``session``, when the
        session ends), a part has its file's identity checked after the read.
        """
        dt = from_enum(piece.entry.dtype, self.index_path, key_str(piece.tensor_key))
        stored = box_shape(piece.box)
        local = tuple((int(a), int(b)) for a, b in local)
        if len(local) != len(stored) or any(not 0 <= a <= b <= d for (a, b), d in zip(local, stored)):
            raise InvalidArgumentError(f"region {list(local)} does not fit the stored piece's shape {list(stored)}",
                                       path=self.prefix, **piece.where())
        located = self._locate(piece, dt)
        out = self._destination(out, box_shape(local), dt, piece.tensor_key, piece)
        if box_volume(local) > 0:
            self._read_piece(piece, dt, local, out, verify, session, located)
        return out

    # -- announcements (see .announce) -------------------------------------------------
    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` does anything on this reader's store, for its files (callers may skip
        building the list): not for files on a RAM disk (:mod:`~shardckpt.storage.mounts`)."""
        if self._prefetches is None:
            self._prefetches = announces(self._fs) and self._fs.prefetches_in(os.path.dirname(self.index_path))
        return self._prefetches

    def prefetch(self, regions: Sequence[Tuple[KeyLike, Optional[Union[Box, TensorSlice, str]]]]) -> int:
        """Announce the reads of ``regions`` (``(key, region)``; ``None``: the whole tensor) to the store.

        Object stores then fetch the byte ranges those reads need (whole entries, or the
        runs of a region) in few large requests, in parallel, ahead of the reads
        (:meth:`~shardckpt.storage.fsspec_fs.FsspecFileSystem.prefetch`); the reads are
        unchanged and checked as always. Local files whose announced bytes leave gaps are
        read through a guide (:meth:`~shardckpt.storage.local.LocalFileSystem.prefetch`):
        the kernel reads the announced bytes, not the gaps. Nothing happens on stores that
        take no announcements. Only entries that fit their files (and, for regions, pass the
        reader's other checks) are announced; any problem is left for the read to report.
        Returns the number of requests planned.
        """
        if not self.prefetches:
            return 0
        return self.prefetch_pieces(plan_regions(self._index, self._lookup, regions))

    def prefetch_pieces(self, reads: Sequence[Tuple[StoredPiece, Optional[Box]]]) -> int:
        """:meth:`prefetch` for callers that already hold the stored pieces (a DCP read item names
        its chunk): ``(piece, box relative to the piece)``, ``None`` for the whole piece. No key
        or slice is looked up again. Returns the number of requests planned."""
        return announce_pieces(self._fs, self._files, reads)

    # -- checks ------------------------------------------------------------------------
    def verify(self, key: KeyLike) -> None:
        """Check the checksum of every stored piece of ``key`` (raises :class:`DataLossError`)."""
        for piece in self.pieces(key):
            self.verify_piece(piece)

    def verify_piece(self, piece: StoredPiece) -> None:
        """Read one stored piece whole and check its size and checksum."""
        dt = from_enum(piece.entry.dtype)
        self._locate(piece, dt)
        dest = np.empty(box_shape(piece.box), dtype=dt.numpy)
        self._read_piece(piece, dt, full_box(box_shape(piece.box)), dest, True, None)

    def raw_bytes(self, piece: StoredPiece) -> bytes:
        """The stored bytes of one piece (no checks beyond bounds and the file's identity)."""
        dt = from_enum(piece.entry.dtype)
        fd, path = self._locate(piece, dt)
        buf = bytearray(piece.entry.size)
        self._fs.pread_into(fd, memoryview(buf), piece.entry.offset, path)
        self._check_unchanged(piece.entry.shard_id)
        return bytes(buf)

    # -- reading one piece -------------------------------------------------------------
    def _read_piece(self, piece: StoredPiece, dt: DType, local: Box, dest: np.ndarray, verify: bool,
                    session: Optional["ReadSession"], located: Optional[Tuple[Any, str]] = None) -> None:
        fd, path = located if located is not None else self._locate(piece, dt)
        stored_shape = box_shape(piece.box)
        if not dt.is_numeric:
            values = decode_objects(self._fs, piece, dt, fd, path, self.big_endian)
            dest[...] = values.reshape(stored_shape)[tuple(slice(a, b) for a, b in local)]
            return
        whole = local == full_box(stored_shape)
        swap = bool(self.big_endian and dt.swap_unit)
        if whole and dest.flags.c_contiguous:
            defer = session if session is not None and session.defer and verify and not swap else None
            self._read_whole(piece, fd, path, dest, verify, defer)
        elif whole:
            tmp = np.empty(stored_shape, dtype=dt.numpy)
            self._read_whole(piece, fd, path, tmp, verify, None)
            dest[...] = tmp
        else:
            read_box(self._fs, piece.entry.offset, stored_shape, local, dt, fd, path, dest)
            self._check_unchanged(piece.entry.shard_id)
        if swap:
            view = dest.reshape(-1).view(np.dtype(f"u{dt.swap_unit}")) if dest.flags.c_contiguous else None
            if view is not None:
                view.byteswap(inplace=True)
            else:
                swapped = np.ascontiguousarray(dest)
                swapped.view(np.dtype(f"u{dt.swap_unit}")).byteswap(inplace=True)
                dest[...] = swapped


def iter_tensors(reader: BundleReader) -> Iterator[Tuple[bytes, np.ndarray]]:
    """Every tensor of a bundle, in key order (slices assembled)."""
    for key in reader.keys():
        yield key, reader.read(key)
