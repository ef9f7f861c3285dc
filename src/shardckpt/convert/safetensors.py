"""The safetensors format, read and written without the ``safetensors`` library.

On disk (https://github.com/huggingface/safetensors, "Format")::

    8 bytes        N, the header's length, unsigned little-endian
    N bytes        a JSON object: {"__metadata__": {str: str}?,
                                   NAME: {"dtype": "F32", "shape": [..], "data_offsets": [BEGIN, END]}, ...}
                   (padded with spaces to a multiple of 8 bytes)
    the rest       the byte buffer; each tensor's little-endian, C-order bytes lie at
                   [BEGIN, END) relative to the buffer's start

The reader is hardened against hostile files: the header is capped at
:data:`MAX_HEADER_BYTES` before it is read, JSON nesting and duplicate names are
refused, each tensor's byte range must lie inside the file, match its dtype and
shape exactly, and not overlap another's. Every problem is a
:class:`~shardckpt.errors.DataLossError` naming the file (and the tensor).

The writer streams: the header is computed from the tensor list, then each value
is written as it is fetched.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataLossError, NotFoundError, UnsupportedError
from ..format.dtypes import DType, as_dtype
from ..storage import FileSystem, get_fs
from .atomic import OutputFile, StagedFiles
from .model import NO_PROGRESS, Fetch, Progress, Sink, Source, TensorInfo

__all__ = ["SafetensorsSource", "SafetensorsSink", "read_header", "MAX_HEADER_BYTES", "ST_DTYPES",
           "safetensors_dtype", "write_safetensors", "check_array_shape", "MAX_RANK"]

#: The largest header accepted (the reference implementation's limit too).
MAX_HEADER_BYTES = 100 << 20
_MAX_DEPTH = 4  # {"__metadata__": {k: v}} and {name: {"shape": [..]}} need no more

#: safetensors dtype names and the TensorFlow dtypes they hold.
ST_DTYPES: Dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64",
    "I64": "int64", "U64": "uint64", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
}
_TO_ST = {tf: st for st, tf in ST_DTYPES.items()}


def safetensors_dtype(dtype: DType, name: str, path: str) -> str:
    """The safetensors name of ``dtype``; an :class:`UnsupportedError` naming the tensor when it has none."""
    found = _TO_ST.get(dtype.name)
    if found is None:
        hint = ("string tensors go to __metadata__ only with --strings metadata" if dtype.is_string
                else "cast it explicitly with --dtype, or leave it out with --drop")
        raise UnsupportedError(f"safetensors cannot hold dtype {dtype.name} ({hint})", path=path, key=name)
    return found


def _depth(value: Any, limit: int) -> int:
    if limit < 0:
        return limit
    if isinstance(value, dict):
        return min([_depth(v, limit - 1) for v in value.values()] or [limit])
    if isinstance(value, list):
        return min([_depth(v, limit - 1) for v in value] or [limit])
    return limit


#: NumPy's largest rank.
MAX_RANK = 64


def check_array_shape(shape: Sequence[int], itemsize: int, path: str, key: str) -> None:
    """``shape`` is one an array can have: rank <= 64, and its dimensions (zeros counted as ones,
    as NumPy does even for an empty array) times ``itemsize`` within 2**63 bytes."""
    if len(shape) > MAX_RANK:
        raise DataLossError(f"shape of rank {len(shape)}: more than the {MAX_RANK} dimensions an array can have",
                            path=path, key=key)
    count = max(itemsize, 1)
    for d in shape:
        count *= max(d, 1)
        if count >= 1 << 63:
            raise DataLossError(f"shape {list(shape)} is too large for an array (its dimensions, zero ones "
                                "ignored, multiply to 2**63 bytes or more)", path=path, key=key)


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate name {k!r}")
        out[k] = v
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(fs: FileSystem, handle: Any, path: str, file_size: int
                ) -> Tuple[Dict[str, TensorInfo], Dict[str, Tuple[int, int]], Dict[str, str], int]:
    """Parse and check a safetensors header: ``(infos, byte ranges, metadata, data start)``."""
    if file_size < 8:
        raise DataLossError(f"file is {file_size} bytes, too short for a safetensors header length", path=path)
    head = bytearray(8)
    fs.pread_into(handle, memoryview(head), 0, path)
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES:
        raise DataLossError(f"header claims {n} bytes, more than the {MAX_HEADER_BYTES}-byte limit", path=path)
    if n + 8 > file_size:
        raise DataLossError(f"truncated: header claims {n} bytes but the file has {file_size - 8} after its length",
                            path=path)
    raw = bytearray(n)
    fs.pread_into(handle, memoryview(raw), 8, path)
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header is not a JSON object")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise DataLossError(f"header is not valid JSON: {exc}", path=path) from None
    if not isinstance(header, dict) or _depth(header, _MAX_DEPTH) < 0:
        raise DataLossError("header is not a flat JSON object of tensor records", path=path)
    metadata: Dict[str, str] = {}
    raw_meta = header.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
            raise DataLossError("__metadata__ must map strings to strings", path=path)
        metadata = raw_meta
    data_start = 8 + n
    data_len = file_size - data_start
    infos: Dict[str, TensorInfo] = {}
    ranges: Dict[str, Tuple[int, int]] = {}
    for name, rec in header.items():
        if not isinstance(rec, dict) or set(rec) != {"dtype", "shape", "data_offsets"}:
            raise DataLossError("record must have exactly dtype, shape and data_offsets", path=path, key=name)
        st = rec["dtype"]
        if st not in ST_DTYPES:
            raise UnsupportedError(f"unsupported safetensors dtype {st!r}", path=path, key=name)
        dtype = as_dtype(ST_DTYPES[st])
        shape, offsets = rec["shape"], rec["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
            raise DataLossError(f"shape {shape!r} is not a list of non-negative integers", path=path, key=name)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise DataLossError(f"data_offsets {offsets!r} is not [begin, end]", path=path, key=name)
        assert dtype.itemsize is not None
        check_array_shape(shape, dtype.itemsize, path, name)
        begin, end = offsets
        if begin > end or end > data_len:
            raise DataLossError(f"data_offsets [{begin}, {end}] lie outside the {data_len}-byte buffer",
                                path=path, key=name)
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise DataLossError(f"data_offsets [{begin}, {end}] hold {end - begin} bytes; dtype {st} and shape "
                                f"{shape} need {want}", path=path, key=name)
        infos[name] = TensorInfo(name, dtype, tuple(shape))
        ranges[name] = (begin, end)
    last_end, last_name = 0, ""
    for name, (begin, end) in sorted(ranges.items(), key=lambda kv: kv[1]):
        if begin == end:
            continue
        if begin < last_end:
            raise DataLossError(f"data_offsets [{begin}, {end}] overlap those of {last_name!r}", path=path, key=name)
        last_end, last_name = end, name
    return infos, ranges, metadata, data_start


class SafetensorsSource(Source):
    """One ``.safetensors`` file, local or on an object store."""

    format = "safetensors"

    def __init__(self, path: str) -> None:
        self.path = path
        self.fs = get_fs(path)
        if not self.fs.isfile(path):
            raise NotFoundError("no such safetensors file", path=path)
        self.size = self.fs.size(path)
        self.handle = self.fs.open_read(path)
        try:
            self.infos, self.ranges, self.meta, self.data_start = read_header(self.fs, self.handle, path, self.size)
        except BaseException:
            self.close()
            raise

    def tensors(self) -> List[TensorInfo]:
        return list(self.infos.values())

    def read(self, name: str) -> np.ndarray:
        info = self.infos.get(name)
        if info is None:
            raise NotFoundError("no such tensor", path=self.path, key=name)
        return self.read_rows(name, 0, info.shape[0] if info.shape else 1)

    def read_into(self, name: str, out: np.ndarray) -> Optional[np.ndarray]:
        begin, end = self.ranges[name]
        if end > begin:
            self.fs.pread_into(self.handle, memoryview(out.reshape(-1).view(np.uint8)),  # type: ignore[arg-type]
                               self.data_start + begin, self.path)
        return out

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` along axis 0 (a scalar: the whole value)."""
        info = self.infos[name]
        begin, end = self.ranges[name]
        if info.shape:
            row = (end - begin) // info.shape[0] if info.shape[0] else 0
            shape: Tuple[int, ...] = (stop - start,) + info.shape[1:]
            begin += start * row
        else:
            shape = ()
        out = np.empty(shape, dtype=info.dtype.numpy)
        if out.nbytes:
            self.fs.pread_into(self.handle, memoryview(out.reshape(-1).view(np.uint8)),  # type: ignore[arg-type]
                               self.data_start + begin, self.path)
        return out

    def metadata(self) -> Dict[str, str]:
        return dict(self.meta)

    def close(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None:
            self.fs.close(handle)


def header_bytes(infos: Sequence[TensorInfo], metadata: Dict[str, str], path: str) -> Tuple[bytes, List[int]]:
    """The length-prefixed, space-padded header for ``infos`` (in order) and each tensor's begin offset."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    begins = []
    for info in infos:
        st = safetensors_dtype(info.dtype, info.name, path)
        header[info.name] = {"dtype": st, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        begins.append(offset)
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)
    return len(text).to_bytes(8, "little") + text, begins


def write_safetensors(out: OutputFile, infos: Sequence[TensorInfo], fetch: Fetch, indices: Sequence[int],
                      metadata: Dict[str, str], progress: Progress) -> None:
    """Stream one safetensors file: the header, then each ``fetch(i)`` for ``i`` in ``indices``.

    Tensors are laid out by element size, largest first (stable otherwise): the buffer
    may have no holes, and this order keeps every tensor aligned to its element size
    (the header is padded to 8 bytes), as the reference implementation does.
    """
    indices = sorted(indices, key=lambda i: -(infos[i].dtype.itemsize or 0))
    chosen = [infos[i] for i in indices]
    head, _ = header_bytes(chosen, metadata, out.final)
    out.write(head)
    for i, info in zip(indices, chosen):
        value = fetch(i)
        check_value(value, info, out.final)
        out.write(value)
        progress(info.name, info.nbytes)
        del value


def check_value(value: np.ndarray, info: TensorInfo, path: str) -> None:
    """A fetched value must be what the header promised (a converter bug otherwise)."""
    if tuple(value.shape) != info.shape or value.dtype.newbyteorder("=") != info.dtype.numpy:
        raise DataLossError(f"value has dtype {value.dtype} and shape {list(value.shape)}; the output declared "
                            f"{info.dtype.name} {list(info.shape)}", path=path, key=info.name)


class SafetensorsSink(Sink):
    """One ``.safetensors`` file."""

    format = "safetensors"
    consumes_each_value = True

    def check(self, infos: Sequence[TensorInfo]) -> None:
        for info in infos:
            safetensors_dtype(info.dtype, info.name, self.path)

    def write(self, infos: Sequence[TensorInfo], fetch: Fetch, metadata: Dict[str, str],
              progress: Progress = NO_PROGRESS) -> List[str]:
        fs = get_fs(self.path)
        staged = StagedFiles(fs.dirname(self.path) or ".")
        try:
            out = staged.open(fs.basename(self.path))
            write_safetensors(out, infos, fetch, range(len(infos)), metadata, progress)
            return staged.commit()
        except BaseException:
            staged.abort()
            raise
