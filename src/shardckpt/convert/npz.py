"""NumPy ``.npz`` archives (a zip of ``NAME.npy`` members), read and written without pickle.

Reading opens one member at a time (``allow_pickle=False``: an object array is an
error, never unpickled). Writing streams each array into its zip member (ZIP64,
stored, data descriptors, so the output need not be seekable). NumPy's ``.npy``
has no portable form for bfloat16, float8, int4 and strings, so those are refused
(naming the tensor) unless cast with ``--dtype``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import struct
import zipfile
import zlib
from typing import IO, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataLossError, NotFoundError, ShardckptError, UnsupportedError
from ..format.dtypes import as_dtype
from ..storage import FileSystem, get_fs
from .atomic import OutputFile, StagedFiles
from .model import NO_PROGRESS, Fetch, Progress, Sink, Source, TensorInfo
from .safetensors import MAX_RANK, check_array_shape, check_value

__all__ = ["NpzSource", "NpzSink", "NPZ_DTYPES"]

#: TensorFlow dtype names a ``.npy`` member holds exactly.
NPZ_DTYPES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64", "complex64", "complex128"}


class _BadSeek(OSError):
    """A seek before the file's start: an archive whose offsets point outside it."""


class _FsReader(io.RawIOBase):
    """A read-only, seekable file over a :class:`FileSystem` handle (positional reads)."""

    def __init__(self, fs: FileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self.handle = fs.open_read(path)
        self.length = fs.size(path)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = {0: 0, 1: self.pos, 2: self.length}[whence] + offset
        if pos < 0:  # as a real file does; zipfile relies on it for files shorter than a zip trailer
            raise _BadSeek(errno.EINVAL, f"seek to {pos}, before the start of the file", self.path)
        self.pos = pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        if n:
            self.fs.pread_into(self.handle, memoryview(buf)[:n], self.pos, self.path)
        self.pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self.fs.close(self.handle)
        super().close()


class NpzSource(Source):
    format = "npz"

    def __init__(self, path: str) -> None:
        self.path = path
        fs = get_fs(path)
        if not fs.isfile(path):
            raise NotFoundError("no such .npz file", path=path)
        self.raw = io.BufferedReader(_FsReader(fs, path), 1 << 20)
        self.length = fs.size(path)
        try:
            with _zip_errors(path, None):
                self.zip = zipfile.ZipFile(self.raw)
                self.members: Dict[str, str] = {}
                self.infos: Dict[str, TensorInfo] = {}
                for member in self.zip.infolist():
                    if not member.filename.endswith(".npy"):
                        continue
                    name = member.filename[:-4]
                    _check_member(member, self.length, path, name)
                    with self.zip.open(member) as f:
                        dtype, shape = _npy_header(f, self.path, name)
                        _check_size(member, f.tell(), dtype, shape, path, name)
                    self.members[name] = member.filename
                    self.infos[name] = TensorInfo(name, dtype, shape)
        except BaseException:
            self.raw.close()
            raise

    def tensors(self) -> List[TensorInfo]:
        return list(self.infos.values())

    def read(self, name: str) -> np.ndarray:
        if name not in self.members:
            raise NotFoundError("no such array", path=self.path, key=name)
        with _zip_errors(self.path, name), self.zip.open(self.members[name]) as f:
            value = np.lib.format.read_array(f, allow_pickle=False)
        return value.astype(value.dtype.newbyteorder("="), copy=False)

    def close(self) -> None:
        self.raw.close()


#: Deflate's largest expansion (a run of one byte): a member claiming more is lying.
_DEFLATE_MAX_RATIO = 1032


@contextlib.contextmanager
def _zip_errors(path: str, name: Optional[str]) -> Iterator[None]:
    """Turn what :mod:`zipfile` and ``np.lib.format`` raise on a damaged archive into ``shardckpt.errors``."""
    try:
        yield
    except ShardckptError:
        raise
    except NotImplementedError as exc:  # a compression method zipfile lacks
        raise UnsupportedError(f"unsupported zip member: {exc}", path=path, key=name) from None
    except RuntimeError as exc:  # an encrypted member
        raise UnsupportedError(f"unreadable zip member: {exc}", path=path, key=name) from None
    except (zipfile.BadZipFile, EOFError, _BadSeek, ValueError, OverflowError, struct.error, zlib.error) as exc:
        what = "not a valid .npz (zip) archive" if name is None else "cannot read array"
        raise DataLossError(f"{what}: {exc}", path=path, key=name) from None


def _check_member(member: zipfile.ZipInfo, length: int, path: str, name: str) -> None:
    """A member's stored bytes lie inside the archive and its declared size is one they can inflate to.

    zipfile trusts the declared (uncompressed) size, and NumPy allocates an array of
    the size its ``.npy`` header declares before reading: both are bounded here by
    the bytes actually stored, so no archive makes the reader allocate more than
    about a thousand times its own size (deflate's limit), and a stored one no more
    than its own size.
    """
    if member.header_offset + member.compress_size > length:
        raise DataLossError(f"member claims {member.compress_size} stored bytes at offset {member.header_offset}, "
                            f"past the archive's end ({length} bytes)", path=path, key=name)
    if member.compress_type == zipfile.ZIP_STORED:
        limit = member.compress_size
    elif member.compress_type == zipfile.ZIP_DEFLATED:
        limit = member.compress_size * _DEFLATE_MAX_RATIO + 64
    else:
        raise UnsupportedError(f"zip compression method {member.compress_type} (only stored and deflated members "
                               "are read)", path=path, key=name)
    if member.file_size > limit:
        raise DataLossError(f"member claims {member.file_size} bytes from {member.compress_size} stored "
                            f"(method {member.compress_type}): more than they can hold", path=path, key=name)


def _check_size(member: zipfile.ZipInfo, header_end: int, dtype: Any, shape: Tuple[int, ...],
                path: str, name: str) -> None:
    """The ``.npy`` header's shape is an array's and its bytes are exactly the rest of the member."""
    if any(d < 0 for d in shape):
        raise DataLossError(f"invalid .npy shape {list(shape[:MAX_RANK + 1])}", path=path, key=name)
    check_array_shape(shape, dtype.itemsize or 0, path, name)
    want = math.prod(shape) * (dtype.itemsize or 0)
    if member.file_size - header_end != want:
        raise DataLossError(f".npy header declares {want} bytes of data (dtype {dtype.name}, shape {list(shape)}); "
                            f"the member holds {member.file_size - header_end}", path=path, key=name)


def _npy_header(f: IO[bytes], path: str, name: str) -> "tuple[Any, tuple[int, ...]]":
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except ValueError as exc:
        raise DataLossError(f"bad .npy header: {exc}", path=path, key=name) from None
    if dtype.hasobject:
        raise UnsupportedError("object arrays need pickle, which shardckpt never loads", path=path, key=name)
    try:
        return as_dtype(dtype.newbyteorder("=")), tuple(int(d) for d in shape)
    except Exception:
        raise UnsupportedError(f"unsupported .npy dtype {dtype}", path=path, key=name) from None


class _ZipTarget(io.RawIOBase):
    """A non-seekable writable stream into an :class:`OutputFile` (zipfile then uses data descriptors)."""

    def __init__(self, out: OutputFile) -> None:
        self.out = out

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.out.tell()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.out.write(view)
        return len(view)


class NpzSink(Sink):
    format = "npz"
    consumes_each_value = True

    def check(self, infos: Sequence[TensorInfo]) -> None:
        for info in infos:
            if info.dtype.name not in NPZ_DTYPES:
                raise UnsupportedError(f".npz cannot hold dtype {info.dtype.name} exactly (cast it with --dtype, "
                                       "or leave it out with --drop)", path=self.path, key=info.name)

    def write(self, infos: Sequence[TensorInfo], fetch: Fetch, metadata: Dict[str, str],
              progress: Progress = NO_PROGRESS) -> List[str]:
        fs = get_fs(self.path)
        staged = StagedFiles(fs.dirname(self.path) or ".", fs.basename(self.path))
        try:
            out = staged.open(fs.basename(self.path))
            with zipfile.ZipFile(_ZipTarget(out), "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for i, info in enumerate(infos):
                    value = fetch(i)
                    check_value(value, info, self.path)
                    with zf.open(info.name + ".npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.require(value, requirements="C"), allow_pickle=False)
                    progress(info.name, info.nbytes)
                    del value
            return staged.commit()
        except BaseException:
            staged.abort()
            raise
