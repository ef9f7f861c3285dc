"""Read a tensor bundle: look entries up in ``<prefix>.index``, read values from the data files.

:class:`BundleReader` reads whole tensors (assembling sliced ones) and arbitrary
regions of them. A region read issues positional reads of just the byte ranges
that hold the region, straight into the destination array; reads smaller than a
page are served from one covering read per row block. Whole-entry reads verify
the entry's CRC32C on a helper thread while the next bytes arrive.

Every problem with the files is a :mod:`shardckpt.errors` exception naming the
file and the key; sizes are checked against the files before anything is
allocated, so a hostile index cannot make the reader allocate unbounded memory.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from ..errors import CorruptIndexError, DataLossError, InvalidArgumentError, NotFoundError, UnsupportedError
from ..storage.base import FileSystem, normalize
from ..storage.registry import get_fs
from . import crc
from .bundle_writer import byte_view
from .dtypes import DType, from_enum
from .naming import data_filename, index_filename
from .ordered_code import encode_tensor_name_slice, is_slice_key
from .protos import tensor_bundle_pb2 as pb
from .sstable import read_table
from .strings import decode_strings, decode_variants
from .tensor_slice import Box, TensorSlice, box_shape, box_volume, boxes_tile, full_box, intersect

__all__ = ["BundleReader", "StoredPiece", "MAX_SUPPORTED_VERSION"]

MAX_SUPPORTED_VERSION = 1  # the bundle format's producer/consumer version
_CHUNK = 16 << 20  # covering reads of small runs
_VERIFY_CHUNK = 2 << 20  # read step when checksumming on a helper thread meanwhile
_SMALL_RUN = 4096  # runs below a page are read as whole row blocks
_MAX_SHARDS = 1 << 24

KeyLike = Union[str, bytes]


def _key_bytes(key: KeyLike) -> bytes:
    return key if isinstance(key, bytes) else key.encode("utf-8")


def _key_str(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


class StoredPiece:
    """One stored block of a tensor: the whole tensor, or one slice of it.

    ``key`` is the index key holding the bytes (the encoded slice key for a
    slice), ``tensor_key`` the tensor's own key, ``slice`` the slice (``None`` for
    a whole entry) and ``box`` where the piece lies in the tensor.
    """

    __slots__ = ("box", "key", "entry", "tensor_key", "slice")

    def __init__(self, box: Box, key: bytes, entry: pb.BundleEntryProto, tensor_key: bytes,
                 tensor_slice: Optional[TensorSlice] = None) -> None:
        self.box = box
        self.key = key
        self.entry = entry
        self.tensor_key = tensor_key
        self.slice = tensor_slice

    @property
    def slice_spec(self) -> Optional[str]:
        """The slice in TF's text form (``"0,4:-"``), or ``None`` for a whole entry."""
        return None if self.slice is None else str(self.slice)

    def where(self) -> dict:
        """Keyword arguments naming this piece in an error: ``key`` and ``slice_spec``."""
        return {"key": self.tensor_key, "slice_spec": self.slice_spec}


class BundleReader:
    """Random access to the tensors of the bundle at ``prefix``."""

    def __init__(self, prefix: str, *, fs: Optional[FileSystem] = None) -> None:
        prefix = normalize(prefix)
        self.prefix = prefix
        self.index_path = index_filename(prefix)
        fs = fs if fs is not None else get_fs(prefix)
        self._fs = fs
        self._remote = fs.read_step is not None
        data = fs.read_bytes(self.index_path)
        raw = dict(read_table(data, self.index_path))
        header_bytes = raw.pop(b"", None)
        if header_bytes is None:
            raise CorruptIndexError("index has no header entry (empty key)", path=self.index_path)
        self.header = self._parse_header(header_bytes)
        self.num_shards = int(self.header.num_shards)
        self.big_endian = self.header.endianness == pb.BundleHeaderProto.BIG
        self._raw = raw
        self._entries: Dict[bytes, pb.BundleEntryProto] = {}
        self._fds: Dict[int, int] = {}
        self._file_sizes: Dict[int, int] = {}
        self._lock = threading.Lock()
        # (running crc, expected crc, file, piece) of whole-entry reads whose check is deferred
        self._deferred: Optional[List[Tuple[crc.RunningCrc, int, str, StoredPiece]]] = None

    # -- index -------------------------------------------------------------
    def _parse_header(self, value: bytes) -> pb.BundleHeaderProto:
        header = pb.BundleHeaderProto()
        try:
            header.ParseFromString(value)
        except Exception:
            raise CorruptIndexError("unparsable bundle header", path=self.index_path) from None
        if not 1 <= header.num_shards <= _MAX_SHARDS:
            raise CorruptIndexError(f"bad num_shards {header.num_shards} in header", path=self.index_path)
        if header.endianness not in (pb.BundleHeaderProto.LITTLE, pb.BundleHeaderProto.BIG):
            raise UnsupportedError(f"unknown endianness {header.endianness}", path=self.index_path)
        version = header.version
        if version.producer < 0 or version.min_consumer > MAX_SUPPORTED_VERSION or \
                MAX_SUPPORTED_VERSION in version.bad_consumers:
            raise UnsupportedError(
                f"bundle version producer={version.producer} min_consumer={version.min_consumer} "
                f"bad_consumers={list(version.bad_consumers)} is not readable by format version "
                f"{MAX_SUPPORTED_VERSION}", path=self.index_path)
        return header

    def keys(self, include_slices: bool = False) -> List[bytes]:
        """All keys in index order; slice entries only with ``include_slices``."""
        return [k for k in self._raw if include_slices or not is_slice_key(k)]

    def __contains__(self, key: KeyLike) -> bool:
        return _key_bytes(key) in self._raw

    def entry(self, key: KeyLike) -> pb.BundleEntryProto:
        """The parsed and checked ``BundleEntryProto`` of ``key``."""
        kb = _key_bytes(key)
        cached = self._entries.get(kb)
        if cached is not None:
            return cached
        value = self._raw.get(kb)
        if value is None:
            raise NotFoundError("key not found in checkpoint", path=self.prefix, key=kb)
        entry = pb.BundleEntryProto()
        try:
            entry.ParseFromString(value)
        except Exception:
            raise CorruptIndexError("unparsable entry", path=self.index_path, key=kb) from None
        from_enum(entry.dtype, self.index_path, _key_str(kb))
        if entry.shape.unknown_rank or any(d.size < 0 for d in entry.shape.dim):
            raise CorruptIndexError(f"invalid tensor shape {[d.size for d in entry.shape.dim]}",
                                    path=self.index_path, key=kb)
        if not entry.slices:
            if entry.offset < 0 or entry.size < 0 or not 0 <= entry.shard_id < self.num_shards:
                raise CorruptIndexError(
                    f"bad location shard_id={entry.shard_id} offset={entry.offset} size={entry.size} "
                    f"(bundle has {self.num_shards} shards)", path=self.index_path, key=kb)
        self._entries[kb] = entry
        return entry

    def dtype(self, key: KeyLike) -> DType:
        return from_enum(self.entry(key).dtype)

    def shape(self, key: KeyLike) -> Tuple[int, ...]:
        return tuple(int(d.size) for d in self.entry(key).shape.dim)

    def pieces(self, key: KeyLike) -> List[StoredPiece]:
        """Where the tensor's values are stored: one piece, or one per slice."""
        kb = _key_bytes(key)
        entry = self.entry(kb)
        shape = self.shape(kb)
        if not entry.slices:
            return [StoredPiece(full_box(shape), kb, entry, kb)]
        out = []
        for proto in entry.slices:
            tslice = TensorSlice.from_proto(proto)
            try:
                box = tslice.box(shape)
            except InvalidArgumentError as exc:
                raise CorruptIndexError(f"bad slice: {exc}", path=self.index_path, key=kb) from None
            slice_key = encode_tensor_name_slice(kb, tslice.extents)
            if slice_key not in self._raw:
                raise CorruptIndexError(f"slice {tslice} listed but its entry is missing",
                                        path=self.index_path, key=kb)
            slice_entry = self.entry(slice_key)
            if slice_entry.dtype != entry.dtype or self.shape(slice_key) != box_shape(box) or slice_entry.slices:
                raise CorruptIndexError(f"slice {tslice} entry disagrees with the tensor's dtype or shape",
                                        path=self.index_path, key=kb)
            out.append(StoredPiece(box, slice_key, slice_entry, kb, tslice))
        return out

    # -- data files ----------------------------------------------------------
    def data_path(self, shard_id: int) -> str:
        return data_filename(self.prefix, shard_id, self.num_shards)

    def _fd(self, shard_id: int) -> Tuple[int, int]:
        with self._lock:
            fd = self._fds.get(shard_id)
            if fd is None:
                path = self.data_path(shard_id)
                if self._remote:  # one request: the size lookup also says whether it exists
                    try:
                        size = self._fs.size(path)
                    except NotFoundError:
                        raise NotFoundError("data file of the checkpoint is missing", path=path) from None
                    fd = self._fs.open_read(path)
                else:
                    if not self._fs.exists(path):
                        raise NotFoundError("data file of the checkpoint is missing", path=path)
                    fd = self._fs.open_read(path)
                    size = self._fs.size(path)
                self._fds[shard_id] = fd
                self._file_sizes[shard_id] = size
            return fd, self._file_sizes[shard_id]

    def _locate(self, piece: StoredPiece, dt: DType) -> Tuple[int, str]:
        """Open the piece's data file and check the entry fits in it and its size is right."""
        entry = piece.entry
        path = self.data_path(entry.shard_id)
        fd, file_size = self._fd(entry.shard_id)
        if entry.offset + entry.size > file_size:
            raise DataLossError(f"entry points past the end of the data file (offset {entry.offset} + "
                                f"size {entry.size} > file size {file_size})", path=path, **piece.where())
        if dt.itemsize is not None:
            expected = box_volume(piece.box) * dt.itemsize
            if entry.size != expected:
                raise DataLossError(f"entry holds {entry.size} bytes, shape {list(box_shape(piece.box))} of "
                                    f"{dt.name} needs {expected}", path=path, **piece.where())
        elif entry.size < box_volume(piece.box):
            raise DataLossError(f"entry holds {entry.size} bytes, too few for "
                                f"{box_volume(piece.box)} elements", path=path, **piece.where())
        return fd, path

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                self._fs.close(fd)
            self._fds.clear()

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
    def read(self, key: KeyLike, *, verify: bool = True) -> np.ndarray:
        """The whole tensor ``key`` (sliced tensors are assembled)."""
        return self.read_region(key, None, verify=verify)

    def read_region(self, key: KeyLike, region: Optional[Union[Box, TensorSlice, str]] = None,
                    out: Optional[np.ndarray] = None, *, verify: bool = True) -> np.ndarray:
        """Read ``region`` of tensor ``key`` (the whole tensor when ``None``) into ``out``.

        ``region`` is a box of ``(start, stop)`` pairs, a :class:`TensorSlice` or
        its text form (``"0,5:-"``). ``out`` (allocated when omitted) must have the
        region's shape and the stored dtype. Only stored pieces that overlap the
        region are read; pieces read whole have their checksum verified.
        """
        kb = _key_bytes(key)
        dt = self.dtype(kb)
        shape = self.shape(kb)
        if region is None:
            box = full_box(shape)
        elif isinstance(region, (TensorSlice, str)):
            tslice = TensorSlice.parse(region, rank=len(shape)) if isinstance(region, str) else region
            box = tslice.box(shape)
        else:
            box = tuple((int(a), int(b)) for a, b in region)
            if len(box) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(box, shape)):
                raise InvalidArgumentError(f"region {list(box)} does not fit shape {list(shape)}",
                                           path=self.prefix, key=kb)
        pieces = self.pieces(kb)
        overlaps: List[Tuple[StoredPiece, Box]] = []
        for p in pieces:
            common = intersect(p.box, box)
            if common is not None:
                overlaps.append((p, common))
        whole = len(overlaps) == 1 and overlaps[0][1] == box  # the common case: one piece holds it all
        if box_volume(box) > 0 and not whole:
            problem = boxes_tile([common for _, common in overlaps], box)
            if problem is not None:
                raise NotFoundError(f"does not have sufficient slices for region {list(box)}: {problem}",
                                    path=self.prefix, key=kb)
        region_shape = box_shape(box)
        for piece, _ in overlaps:  # sizes checked against the files before anything is allocated
            self._locate(piece, dt)
        if out is None:
            out = np.empty(region_shape, dtype=dt.numpy)
        elif tuple(out.shape) != region_shape or out.dtype != dt.numpy:
            raise InvalidArgumentError(f"destination has shape {list(out.shape)} and dtype {out.dtype}; "
                                       f"expected {list(region_shape)} and {dt.numpy}",
                                       path=self.prefix, key=kb)
        for piece, common in overlaps:
            local = tuple((a - p0, b - p0) for (a, b), (p0, _) in zip(common, piece.box))
            index = tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(common, box))
            dest = out[index] if index else out
            self._read_piece(piece, dt, local, dest, verify)
        return out

    def verify(self, key: KeyLike) -> None:
        """Check the checksum of every stored piece of ``key`` (raises :class:`DataLossError`)."""
        for piece in self.pieces(key):
            self.verify_piece(piece)

    def verify_piece(self, piece: StoredPiece) -> None:
        """Read one stored piece whole and check its size and checksum."""
        dt = from_enum(piece.entry.dtype)
        self._locate(piece, dt)
        dest = np.empty(box_shape(piece.box), dtype=dt.numpy)
        self._read_piece(piece, dt, full_box(box_shape(piece.box)), dest, True)

    def raw_bytes(self, piece: StoredPiece) -> bytes:
        """The stored bytes of one piece (no checks beyond bounds)."""
        dt = from_enum(piece.entry.dtype)
        fd, path = self._locate(piece, dt)
        buf = bytearray(piece.entry.size)
        self._fs.pread_into(fd, memoryview(buf), piece.entry.offset, path)
        return bytes(buf)

    def _read_piece(self, piece: StoredPiece, dt: DType, local: Box, dest: np.ndarray, verify: bool) -> None:
        fd, path = self._locate(piece, dt)
        stored_shape = box_shape(piece.box)
        if not dt.is_numeric:
            values = self._decode_objects(piece, dt, fd, path, verify)
            dest[...] = values.reshape(stored_shape)[tuple(slice(a, b) for a, b in local)]
            return
        whole = local == full_box(stored_shape)
        if whole and dest.flags.c_contiguous:
            self._read_whole(piece, dt, fd, path, dest, verify)
        elif whole:
            tmp = np.empty(stored_shape, dtype=dt.numpy)
            self._read_whole(piece, dt, fd, path, tmp, verify)
            dest[...] = tmp
        else:
            self._read_box(piece.entry.offset, stored_shape, local, dt, fd, path, dest)
        if self.big_endian and dt.swap_unit:
            view = dest.reshape(-1).view(np.dtype(f"u{dt.swap_unit}")) if dest.flags.c_contiguous else None
            if view is not None:
                view.byteswap(inplace=True)
            else:
                swapped = np.ascontiguousarray(dest)
                swapped.view(np.dtype(f"u{dt.swap_unit}")).byteswap(inplace=True)
                dest[...] = swapped

    def _read_whole(self, piece: StoredPiece, dt: DType, fd: int, path: str, dest: np.ndarray,
                    verify: bool) -> None:
        entry = piece.entry
        flat = byte_view(dest)
        running = crc.RunningCrc(crc.shared_executor()) if verify else None
        step = self._fs.read_step or (_VERIFY_CHUNK if verify else _CHUNK)
        for start in range(0, entry.size, step):
            chunk = flat[start:start + step]
            self._fs.pread_into(fd, chunk, entry.offset + start, path)
            if running is not None:
                running.update(chunk)
        if running is None:
            return
        if self._deferred is not None and not (self.big_endian and dt.swap_unit):  # swapped in place next
            self._deferred.append((running, crc.unmask(entry.crc32c), path, piece))
        else:
            _check_crc(running, crc.unmask(entry.crc32c), path, piece)

    @contextlib.contextmanager
    def deferred_verification(self) -> Iterator[None]:
        """Check whole-entry checksums when the block ends instead of after each read.

        Reading the next tensor then overlaps with the checksum of the last one; every
        check still happens (and raises :class:`DataLossError`) before the block exits.
        Values read inside the block must not be trusted until it has exited.
        """
        if self._deferred is not None:  # already deferring: the outer block checks
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            pending, self._deferred = self._deferred, None
        for running, expected, path, piece in pending:
            _check_crc(running, expected, path, piece)

    def _read_box(self, offset: int, shape: Tuple[int, ...], local: Box, dt: DType, fd: int,
                  path: str, dest: np.ndarray) -> None:
        """Read the sub-box ``local`` of a row-major block stored at ``offset``."""
        itemsize = dt.itemsize
        assert itemsize is not None
        rank = len(shape)
        strides = [1] * rank
        for d in range(rank - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        j = rank  # dims j.. are taken whole, so each run spans them
        while j > 0 and local[j - 1] == (0, shape[j - 1]):
            j -= 1
        if j == 0:  # contiguous after all (e.g. the whole block)
            runs_dim = -1
            run_elems = strides[0] * shape[0] if rank else 1
        else:
            runs_dim = j - 1
            run_elems = (local[runs_dim][1] - local[runs_dim][0]) * strides[runs_dim]
        run_bytes = run_elems * itemsize
        if self._remote and runs_dim > 0:
            self._read_runs_remote(offset, strides, local, runs_dim, itemsize, fd, path, dest)
            return
        if runs_dim <= 0:
            start = offset + (local[0][0] * strides[0] * itemsize if rank else 0)
            self._pread_to(fd, path, start, dest)
            return
        if run_bytes < _SMALL_RUN:
            # Tiny runs: read whole row blocks of the leading dim, then copy the box out.
            row_bytes = strides[0] * itemsize
            rows_per = max(1, _CHUNK // max(1, row_bytes))
            inner = tuple(slice(a, b) for a, b in local[1:])
            for r0 in range(local[0][0], local[0][1], rows_per):
                r1 = min(local[0][1], r0 + rows_per)
                block = np.empty((r1 - r0,) + tuple(shape[1:]), dtype=dt.numpy)
                self._pread_to(fd, path, offset + r0 * row_bytes, block)
                dest[r0 - local[0][0]:r1 - local[0][0]] = block[(slice(None),) + inner]
            return
        outer = [range(a, b) for a, b in local[:runs_dim]]
        base = local[runs_dim][0] * strides[runs_dim]
        for index in itertools.product(*outer):
            elem = base + sum(i * s for i, s in zip(index, strides))
            target = dest[tuple(i - a for i, (a, _) in zip(index, local))]
            self._pread_to(fd, path, offset + elem * itemsize, target)

    def _read_runs_remote(self, offset: int, strides: List[int], local: Box, runs_dim: int, itemsize: int,
                          fd: Any, path: str, dest: np.ndarray) -> None:
        """Object stores: every run at once, nearby runs coalesced, GETs in parallel (no covering reads)."""
        outer = [range(a, b) for a, b in local[:runs_dim]]
        base = local[runs_dim][0] * strides[runs_dim]
        requests = []
        copies = []
        for index in itertools.product(*outer):
            elem = base + sum(i * s for i, s in zip(index, strides))
            target = dest[tuple(i - a for i, (a, _) in zip(index, local))]
            if target.flags.c_contiguous:
                requests.append((offset + elem * itemsize, byte_view(target)))
            else:
                tmp = np.empty(target.shape, dtype=target.dtype)
                requests.append((offset + elem * itemsize, byte_view(tmp)))
                copies.append((target, tmp))
        self._fs.pread_batch(fd, requests, path)  # type: ignore[attr-defined]
        for target, tmp in copies:
            target[...] = tmp

    def _pread_to(self, fd: int, path: str, start: int, target: np.ndarray) -> None:
        if target.flags.c_contiguous:
            self._fs.pread_into(fd, byte_view(target), start, path)
        else:
            tmp = np.empty(target.shape, dtype=target.dtype)
            self._fs.pread_into(fd, byte_view(tmp), start, path)
            target[...] = tmp

    def _decode_objects(self, piece: StoredPiece, dt: DType, fd: int, path: str, verify: bool) -> np.ndarray:
        entry = piece.entry
        buf = bytearray(entry.size)
        self._fs.pread_into(fd, memoryview(buf), entry.offset, path)
        count = box_volume(piece.box)
        data = bytes(buf)
        try:
            if dt.is_string:
                items = decode_strings(data, count, entry.crc32c, big_endian=self.big_endian)
            else:
                items = decode_variants(data, count, entry.crc32c)
        except DataLossError as exc:
            raise DataLossError(exc.message, path=path, **piece.where()) from None
        values = np.empty(count, dtype=object)
        values[:] = items
        return values


def _check_crc(running: crc.RunningCrc, expected: int, path: str, piece: StoredPiece) -> None:
    actual = running.value()
    if actual != expected:
        raise DataLossError(f"checksum does not match: stored 0x{expected:08x}, computed 0x{actual:08x}",
                            path=path, **piece.where())


def iter_tensors(reader: BundleReader) -> Iterator[Tuple[bytes, np.ndarray]]:
    """Every tensor of a bundle, in key order (slices assembled)."""
    for key in reader.keys():
        yield key, reader.read(key)
