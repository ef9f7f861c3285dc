"""Write one tensor bundle: ``<prefix>.data-00000-of-00001`` and ``<prefix>.index``.

:class:`BundleWriter` behaves like TensorFlow's ``BundleWriter`` (and so ``SaveV2``):
tensor bytes go to the data file in the order they are added, with no padding;
the index lists the entries in bytewise key order after a header entry. For the
same inputs the files are byte-identical to TensorFlow's.

With ``page_phase`` (what shardckpt's own saves to local files use) a numeric entry of
at least ``PHASE_MIN_BYTES`` starts that many bytes past a 4 KiB boundary of the data
file; zero bytes, named by no entry, fill the gap before it (at most 4095 per entry).
Every reader, TensorFlow's included, finds an entry by its offset, so gaps change
nothing for them. Why: a load copies file pages from the page cache into the caller's
arrays (``pread``), and the kernel's copy (``rep movsb``) is about 20 % faster when the
destination sits about half a page from the source modulo 4096 than when it sits
64-1536 bytes past it (and 4x slower at 1-63 bytes: see ``whole_reads``). Large torch
tensors start 64 bytes into a page, large NumPy arrays 16 bytes, page-aligned buffers
at 0; ``PAGE_PHASE`` (2112) puts all three 1984-2048 bytes from their source.

Both files are first written under ``.tempstate<random>`` names and renamed when
:meth:`BundleWriter.finish` succeeds; with ``fsync=True`` they are made durable
first (the data file's write-back is started every 16 MiB while it is written,
``FileSystem.start_writeback``, so that the fsync waits only for the tail). On a
store without rename (object stores) the data object is written in place (it
appears only when its upload completes) and the index is written last.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, Optional, Sequence, Union

import numpy as np

from ..errors import AlreadyExistsError, InvalidArgumentError
from ..storage.base import FileSystem
from ..storage.location import Location
from ..storage.object_store import ObjectStore
from . import crc
from .dtypes import DType, as_dtype
from .naming import data_filename, index_filename
from .ordered_code import encode_tensor_name_slice
from .protos import tensor_bundle_pb2 as pb
from .sstable import TableWriter
from .strings import as_bytes_elements, encode_strings
from .tensor_slice import TensorSlice

__all__ = ["BundleWriter", "encode_key", "make_header", "shape_proto", "to_disk_array",
           "byte_chunks", "byte_view", "PAGE_PHASE", "PHASE_MIN_BYTES"]

_CHUNK = 16 << 20  # bytes per write/checksum step for large tensors
_WRITEBACK_STEP = 16 << 20  # with fsync: start the device write of every this many bytes written
_PAGE = 4096
PAGE_PHASE = 2048 + 64  # where large entries start within a page of the data file (see the module docstring)
PHASE_MIN_BYTES = 1 << 20  # entries this large or larger are placed at the phase (padding costs <= 0.4 %)
_ZEROS = bytes(_PAGE)


def encode_key(key: Union[str, bytes]) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        try:
            return key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(f"checkpoint key {key!r} is not valid Unicode text ({exc.reason} at "
                                       f"position {exc.start}); keys are stored as UTF-8") from None
    raise InvalidArgumentError(f"checkpoint key must be str or bytes, got {type(key).__name__}")


def make_header(num_shards: int, big_endian: bool = False) -> bytes:
    header = pb.BundleHeaderProto(num_shards=num_shards)
    if big_endian:
        header.endianness = pb.BundleHeaderProto.BIG
    header.version.producer = 1
    return header.SerializeToString()


def shape_proto(shape: Sequence[int]) -> pb.TensorShapeProto:
    proto = pb.TensorShapeProto()
    for d in shape:
        proto.dim.add().size = int(d)
    return proto


def to_disk_array(value: Any, dtype: Optional[DType] = None) -> "tuple[np.ndarray, DType]":
    """``value`` as a NumPy array in the form stored on disk, and its :class:`DType`.

    Numeric arrays keep their memory when they already are native little-endian
    (no copy); string arrays become object arrays of ``bytes``.
    """
    array = np.asarray(value)
    dt = as_dtype(dtype if dtype is not None else array.dtype)
    if dt.is_variant:
        raise InvalidArgumentError("writing DT_VARIANT tensors is not supported")
    if not dt.is_string and array.dtype != dt.numpy:
        array = array.astype(dt.numpy)  # also turns big-endian input little-endian
    return array, dt


def byte_view(array: np.ndarray) -> memoryview:
    """A flat, writable byte view of a C-contiguous array (no copy)."""
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def byte_chunks(array: np.ndarray, chunk: int = _CHUNK) -> Iterator[memoryview]:
    """The C-order bytes of ``array`` as memoryviews of at most about ``chunk`` bytes.

    A contiguous array is viewed, not copied; a non-contiguous one is copied one
    chunk of rows at a time, so at most one chunk is ever duplicated.
    """
    if array.size == 0:
        return
    if array.flags.c_contiguous:
        flat = byte_view(array)
        for start in range(0, len(flat), chunk):
            yield flat[start:start + chunk]
        return
    rows_per = max(1, chunk // max(1, array[0].nbytes)) if array.ndim else 1
    for start in range(0, array.shape[0], rows_per):
        part = np.ascontiguousarray(array[start:start + rows_per])
        yield byte_view(part)


class BundleWriter:
    """Write tensors into one bundle at ``location``: a :class:`~shardckpt.storage.location.Location`
    (resolved by the caller), or the prefix with its store as ``fs`` (nothing in
    :mod:`shardckpt.format` looks a store up).

    >>> w = BundleWriter(Location.of("/tmp/ck")); w.add("v", np.arange(3.0)); w.finish()
    """

    def __init__(self, location: Union[Location, str], *, fsync: bool = False, durable_index: bool = True,
                 big_endian: bool = False, fs: Optional[FileSystem] = None,
                 checksum_executor: Optional[ThreadPoolExecutor] = None, data_path: Optional[str] = None,
                 page_phase: Optional[int] = None) -> None:
        """``fsync`` makes the data file durable; with ``durable_index`` also the index and the
        directory entries (a temporary bundle that will be merged only needs its data).

        ``page_phase`` (0-4095): numeric entries of at least ``PHASE_MIN_BYTES`` start this
        many bytes past a 4 KiB boundary of the data file (see the module docstring);
        ``None`` (default): no padding, TensorFlow's exact layout.

        ``data_path`` writes the data in place under that name (no temporary name, no
        rename): what object stores do, where the object appears only once complete;
        :meth:`finish_entries` then returns the entries instead of writing an index.
        """
        if isinstance(location, Location):
            prefix = location.prefix
            fs = fs if fs is not None else location.fs
        else:
            prefix = location
            if fs is None:
                raise InvalidArgumentError("a BundleWriter writes to the store its caller gives: pass a "
                                           "storage.location.Location (Location.of(path)) or fs= with the prefix",
                                           path=prefix)
        self.prefix = prefix
        self._durable_index = durable_index
        self._fs = fs
        self._fsync = fsync
        self._big_endian = big_endian
        self._executor = checksum_executor
        self._entries: Dict[bytes, pb.BundleEntryProto] = {}
        self._in_place = data_path is not None or isinstance(fs, ObjectStore)
        self._data_path = data_path if data_path is not None else data_filename(prefix, 0, 1)
        fs.makedirs(fs.dirname(prefix))
        self._data_tmp = self._data_path if self._in_place else fs.temp_name(self._data_path)
        self._fd: Any = fs.open_write(self._data_tmp)
        if page_phase is not None and not 0 <= page_phase < _PAGE:
            raise InvalidArgumentError(f"page_phase must be in [0, {_PAGE}), got {page_phase}")
        self._phase = page_phase
        self._offset = 0
        self._hinted = 0  # bytes whose write-back was started (``fsync``: see storage/writeback.py)
        self._finished = False

    @property
    def data_path(self) -> str:
        return self._data_path

    @property
    def bytes_written(self) -> int:
        return self._offset

    def _write(self, buf: memoryview) -> None:
        assert self._fd is not None
        self._fs.write_all(self._fd, buf, self._data_tmp)
        self._offset += len(buf)
        if self._fsync and self._offset - self._hinted >= _WRITEBACK_STEP:
            # the fsync at the end will wait only for the tail: earlier bytes go to the device now
            self._fs.start_writeback(self._fd, self._hinted, self._offset - self._hinted, self._data_tmp)
            self._hinted = self._offset

    def _write_numeric(self, array: np.ndarray, dt: DType, digest: Any = None) -> "tuple[int, int]":
        if self._big_endian and dt.swap_unit:
            unit = np.dtype(f"<u{dt.swap_unit}")
            array = np.ascontiguousarray(array).view(unit).byteswap().view(dt.numpy)
        running = crc.RunningCrc(self._executor)
        start = self._offset
        for buf in byte_chunks(array):
            running.update(buf, digest)  # the digest too, beside the checksum, while we write
            self._write(buf)
        return self._offset - start, running.value()

    def add(self, key: Union[str, bytes], value: Any, dtype: Any = None, *, digest: Any = None) -> None:
        """Append a whole tensor under ``key`` (``dtype`` converts the value first).

        ``digest``: an object with ``update(bytes)`` (a hash) fed the value's bytes as they stream out
        (numeric values only)."""
        self._add(encode_key(key), value, dtype, digest)

    def _add(self, key: bytes, value: Any, dtype: Any, digest: Any = None) -> pb.BundleEntryProto:
        if self._finished:
            raise InvalidArgumentError("bundle already finished", path=self.prefix)
        if key == b"":
            raise InvalidArgumentError("the empty key is reserved for the bundle header", path=self.prefix)
        if key in self._entries:
            raise AlreadyExistsError("adding duplicate key", path=self.prefix, key=key)
        try:
            array, dt = to_disk_array(value, dtype)
            elements = as_bytes_elements(array) if dt.is_string else None
        except (InvalidArgumentError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot store this value: {getattr(exc, 'message', exc)}",
                                       path=self.prefix, key=key) from None
        if self._phase is not None and elements is None and array.nbytes >= PHASE_MIN_BYTES:
            gap = (self._phase - self._offset) % _PAGE
            if gap:
                self._write(memoryview(_ZEROS)[:gap])
        entry = pb.BundleEntryProto(dtype=dt.enum, shape=shape_proto(array.shape),  # type: ignore[arg-type]
                                    offset=self._offset)
        if elements is not None:
            data, masked = encode_strings(elements, big_endian=self._big_endian)
            self._write(memoryview(data))
            entry.size = len(data)
            entry.crc32c = masked
        else:
            entry.size, value_crc = self._write_numeric(array, dt, digest)
            entry.crc32c = crc.mask(value_crc)
        self._entries[key] = entry
        return entry

    def add_slice(self, full_key: Union[str, bytes], full_shape: Sequence[int],
                  tensor_slice: Union[TensorSlice, str], value: Any, dtype: Any = None, *,
                  digest: Any = None) -> None:
        """Append one slice of a partitioned tensor, as TF's ``BundleWriter::AddSlice``.

        A slice that covers the whole tensor is stored as an ordinary entry.
        """
        key = encode_key(full_key)
        full_shape = tuple(int(d) for d in full_shape)
        if isinstance(tensor_slice, str):
            tensor_slice = TensorSlice.parse(tensor_slice, rank=len(full_shape))
        box = tensor_slice.box(full_shape)
        array, dt = to_disk_array(value, dtype)
        slice_shape = tuple(stop - start for start, stop in box)
        if tuple(array.shape) != slice_shape:
            raise InvalidArgumentError(
                f"slice {tensor_slice} of shape {list(full_shape)} has shape {list(slice_shape)}, "
                f"value has shape {list(array.shape)}", path=self.prefix, key=key)
        if tensor_slice.is_full() or slice_shape == full_shape:
            self._add(key, array, None, digest)
            return
        full = self._entries.get(key)
        if full is None:
            full = pb.BundleEntryProto(dtype=dt.enum, shape=shape_proto(full_shape))  # type: ignore[arg-type]
        elif not full.slices:
            raise AlreadyExistsError("adding a slice of a tensor already saved whole",
                                     path=self.prefix, key=key)
        elif full.dtype != dt.enum or tuple(d.size for d in full.shape.dim) != full_shape:
            raise InvalidArgumentError("slices of one tensor disagree on dtype or full shape",
                                       path=self.prefix, key=key)
        self._add(encode_tensor_name_slice(key, tensor_slice.extents), array, None, digest)
        full.slices.append(tensor_slice.to_proto())
        self._entries[key] = full

    def abort(self) -> None:
        """Close and delete what was written; the bundle never appears."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._fs.discard(fd)
        self._fs.remove(self._data_tmp)
        self._finished = True

    def _close_data(self) -> None:
        fd = self._fd
        assert fd is not None
        if self._fsync:
            self._fs.fsync(fd, self._data_tmp)
        self._fs.close(fd)  # an object store completes the upload here
        self._fd = None

    def finish_entries(self) -> Dict[bytes, pb.BundleEntryProto]:
        """Complete the data file and return the entries (by key) without writing an index."""
        if self._finished:
            raise InvalidArgumentError("bundle already finished", path=self.prefix)
        try:
            self._close_data()
            if not self._in_place:
                self._fs.rename(self._data_tmp, self._data_path)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        return dict(self._entries)

    def finish(self) -> None:
        """Write the index and make both files appear under their final names."""
        if self._finished:
            raise InvalidArgumentError("bundle already finished", path=self.prefix)
        try:
            self._close_data()
            table = TableWriter()
            table.add(b"", make_header(1, self._big_endian))
            for key in sorted(self._entries):
                table.add(key, self._entries[key].SerializeToString())
            if not self._in_place:
                self._fs.rename(self._data_tmp, self._data_path)
            durable = self._fsync and self._durable_index
            self._fs.write_atomic(index_filename(self.prefix), table.finish(), fsync=durable)
            if durable:
                self._fs.fsync_dir(self._fs.dirname(self.prefix))
        except BaseException:
            self.abort()
            raise
        self._finished = True

    def __enter__(self) -> "BundleWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._finished:
            self.finish()
