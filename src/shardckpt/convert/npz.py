"""NumPy ``.npz`` archives (a zip of ``NAME.npy`` members), read and written without pickle.

Reading opens one member at a time (``allow_pickle=False``: an object array is an
error, never unpickled). Writing streams each array into its zip member (ZIP64,
stored, data descriptors, so the output need not be seekable). NumPy's ``.npy``
has no portable form for bfloat16, float8, int4 and strings, so those are refused
(naming the tensor) unless cast with ``--dtype``.
"""

from __future__ import annotations

import io
import zipfile
from typing import IO, Any, Dict, List, Sequence

import numpy as np

from ..errors import DataLossError, NotFoundError, UnsupportedError
from ..format.dtypes import as_dtype
from ..storage import FileSystem, get_fs
from .atomic import OutputFile, StagedFiles
from .model import NO_PROGRESS, Fetch, Progress, Sink, Source, TensorInfo
from .safetensors import check_value

__all__ = ["NpzSource", "NpzSink", "NPZ_DTYPES"]

#: TensorFlow dtype names a ``.npy`` member holds exactly.
NPZ_DTYPES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64", "complex64", "complex128"}


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
        self.pos = {0: 0, 1: self.pos, 2: self.length}[whence] + offset
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
        try:
            self.zip = zipfile.ZipFile(self.raw)
            self.members: Dict[str, str] = {}
            self.infos: Dict[str, TensorInfo] = {}
            for member in self.zip.namelist():
                if not member.endswith(".npy"):
                    continue
                name = member[:-4]
                with self.zip.open(member) as f:
                    dtype, shape = _npy_header(f, self.path, name)
                self.members[name] = member
                self.infos[name] = TensorInfo(name, dtype, shape)
        except (zipfile.BadZipFile, EOFError) as exc:
            self.raw.close()
            raise DataLossError(f"not a valid .npz (zip) archive: {exc}", path=path) from None
        except BaseException:
            self.raw.close()
            raise

    def tensors(self) -> List[TensorInfo]:
        return list(self.infos.values())

    def read(self, name: str) -> np.ndarray:
        if name not in self.members:
            raise NotFoundError("no such array", path=self.path, key=name)
        with self.zip.open(self.members[name]) as f:
            try:
                value = np.lib.format.read_array(f, allow_pickle=False)
            except (ValueError, EOFError, zipfile.BadZipFile) as exc:
                raise DataLossError(f"cannot read array: {exc}", path=self.path, key=name) from None
        return value.astype(value.dtype.newbyteorder("="), copy=False)

    def close(self) -> None:
        self.raw.close()


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
        staged = StagedFiles(fs.dirname(self.path) or ".")
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
