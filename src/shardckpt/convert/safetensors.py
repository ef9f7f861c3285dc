"""The safetensors format, read and written without the ``safetensors`` library.

On disk (https://github.com/huggingface/safetensors, "Format")::

    8 bytes        N, the header's length, unsigned little-endian
    N bytes        a JSON object: {"__metadata__": {str: str}?,
                                   NAME: {"dtype": "F32", "shape": [..], "data_offsets": [BEGIN, END]}, ...}
                   (padded with spaces to a multiple of 8 bytes)
    the rest       the byte buffer; each tensor's little-endian, C-order bytes lie at
                   [BEGIN, END) relative to the buffer's start

The reader is hardened against hostile files: the header is capped at
:data:`MAX_HEADER_BYTES` (100 MiB) before it is read, and parsed as a stream
(:class:`~shardckpt.convert.jsonscan.JsonScanner`), one record at a time, never as
one ``json.loads``: a record must be an object of exactly ``dtype`` (a string),
``shape`` and ``data_offsets`` (lists of at most 1,024 integers), ``__metadata__``
an object of strings, anything else (nesting, other values) is refused where it
starts, so refusing a hostile header costs the header's bytes and no more. At most
:data:`MAX_ENTRIES` (2**20) tensors and metadata entries are accepted, a limit
no real file reaches: the most a header can make the reader keep is then what the
listing of a million tensors takes (about 500 MB; ``json.loads`` of such a header
took twice that). Duplicate names are
refused; each tensor's byte range must lie inside the file, match its dtype and
shape exactly, and not overlap another's. Every problem is a
:class:`~shardckpt.errors.DataLossError` naming the file (and the tensor).

The writer streams: the header is computed from the tensor list, then each value
is written as it is fetched.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataLossError, NotFoundError, UnsupportedError
from ..format.dtypes import DType, as_dtype
from ..storage import FileSystem, get_fs
from .atomic import OutputFile, StagedFiles
from .jsonscan import WS, JsonScanner
from .model import NO_PROGRESS, Fetch, Progress, Sink, Source, TensorInfo

__all__ = ["SafetensorsSource", "SafetensorsSink", "read_header", "MAX_HEADER_BYTES", "MAX_ENTRIES", "ST_DTYPES",
           "safetensors_dtype", "write_safetensors", "check_array_shape", "MAX_RANK"]

#: The largest header accepted (the reference implementation's limit too).
MAX_HEADER_BYTES = 100 << 20
#: The most tensors plus ``__metadata__`` entries one header may hold. No real file comes near
#: (the largest published models hold about 10**5 tensors in all their shards together); it
#: bounds what a header of many tiny records makes the reader keep.
MAX_ENTRIES = 1 << 20
_FIELDS = {"dtype", "shape", "data_offsets"}
_INT = rb"(?:0|[1-9][0-9]*)"
_CANONICAL_RECORD = re.compile(  # {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, in this order
    rb'\{' + WS + rb'"dtype"' + WS + rb":" + WS + rb'"([A-Z0-9_]{1,16})"' + WS + rb"," + WS + rb'"shape"' + WS
    + rb":" + WS + rb"\[(" + WS + _INT + WS + rb"(?:," + WS + _INT + WS + rb"){0,63})?\]" + WS + rb"," + WS
    + rb'"data_offsets"' + WS + rb":" + WS + rb"\[" + WS + rb"(" + _INT + rb")" + WS + rb"," + WS + rb"(" + _INT
    + rb")" + WS + rb"\]" + WS + rb"\}")

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_metadata(scanner: JsonScanner, path: str, room: int) -> Dict[str, str]:
    """``__metadata__``: an object of strings, at most ``room`` of them."""
    metadata: Dict[str, str] = {}
    for key in scanner.members("__metadata__"):
        value = scanner.scalar(key)
        if not isinstance(value, str) or key in metadata:
            raise DataLossError("__metadata__ must map strings to strings, each key once", path=path, key=key)
        if len(metadata) >= room:
            raise DataLossError(f"header holds more than {MAX_ENTRIES} tensors and metadata entries", path=path)
        metadata[key] = value
    return metadata


def _record(rec: Dict[str, Any], name: str, path: str, data_len: int) -> Tuple[TensorInfo, Tuple[int, int]]:
    """One tensor record, checked: its dtype, shape and byte range (inside a ``data_len``-byte buffer)."""
    st = rec["dtype"]
    if not isinstance(st, str) or st not in ST_DTYPES:
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
    return TensorInfo(name, dtype, tuple(shape)), (begin, end)


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
    data_start = 8 + n
    data_len = file_size - data_start
    metadata: Dict[str, str] = {}
    infos: Dict[str, TensorInfo] = {}
    ranges: Dict[str, Tuple[int, int]] = {}
    scanner = JsonScanner(raw, path, "header")
    seen_metadata = False
    for name in scanner.members():
        if name in infos or (name == "__metadata__" and seen_metadata):
            raise DataLossError(f"duplicate name {name!r} in the header", path=path, key=name)
        if len(infos) + len(metadata) >= MAX_ENTRIES:
            raise DataLossError(f"header holds more than {MAX_ENTRIES} tensors and metadata entries", path=path)
        if name == "__metadata__":
            metadata = _read_metadata(scanner, path, MAX_ENTRIES - len(infos))
            seen_metadata = True
            continue
        fast = scanner.match(_CANONICAL_RECORD)
        if fast is not None:  # the form every writer uses, in one match
            shape = [int(d) for d in fast.group(2).split(b",")] if fast.group(2) else []
            rec: Dict[str, Any] = {"dtype": fast.group(1).decode("ascii"), "shape": shape,
                                   "data_offsets": [int(fast.group(3)), int(fast.group(4))]}
            infos[name], ranges[name] = _record(rec, name, path, data_len)
            continue
        rec = {}
        for field in scanner.members(name):
            if field in rec or field not in _FIELDS:
                raise DataLossError("record must have exactly dtype, shape and data_offsets", path=path, key=name)
            rec[field] = scanner.scalar(name)
        if set(rec) != _FIELDS:
            raise DataLossError("record must have exactly dtype, shape and data_offsets", path=path, key=name)
        infos[name], ranges[name] = _record(rec, name, path, data_len)
    scanner.end()
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
        staged = StagedFiles(fs.dirname(self.path) or ".", fs.basename(self.path))
        try:
            out = staged.open(fs.basename(self.path))
            write_safetensors(out, infos, fetch, range(len(infos)), metadata, progress)
            return staged.commit()
        except BaseException:
            staged.abort()
            raise
