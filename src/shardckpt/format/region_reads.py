"""Region reads: the byte runs that hold a box of a stored block, read straight into the destination.

A stored piece is a row-major block. A box of it that is not the whole block lies in
runs: one contiguous range when only leading rows are cut, else one run per row (or
per plane) of the box, their file offsets computed in bulk (:func:`box_runs`).
:func:`read_box` issues the runs as one batch for the filesystem's ``pread_batch``
(which coalesces ranges smaller than a page, and may hand many runs to the kernel at
once), straight into the destination array. A strided destination (columns of a
tensor) gets the runs cut where either the file or the destination has a gap, each read
straight into its place (:func:`scatter_runs`, no temporary), unless the pieces would be
tiny: then a temporary takes the runs and is copied in. Strings and variants are
decoded from their entry read whole (:func:`decode_objects`).

Nothing here checks identities or checksums: the caller does (a region read checks
the file's identity after the read).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..errors import DataLossError
from ..storage.base import FileSystem, RunBatch
from .bundle_pieces import StoredPiece
from .bundle_writer import byte_view
from .dtypes import DType
from .strings import decode_strings, decode_variants
from .tensor_slice import Box, box_shape, box_volume

__all__ = ["box_runs", "scatter_runs", "read_box", "pread_to", "decode_objects"]

_PAGE = 4096
_MIN_SCATTER = 512  # pieces of a file range scattered into a strided destination: at least this many bytes


def box_runs(offset: int, shape: Tuple[int, ...], local: Box, itemsize: int) -> Tuple[np.ndarray, int, bool]:
    """Where the sub-box ``local`` of a row-major block stored at ``offset`` lies: the file offset of
    each run (row-major order, computed in bulk), the bytes of one run, and whether it is one
    contiguous run (then the single offset starts all of the box's bytes)."""
    rank = len(shape)
    strides = [1] * rank
    for d in range(rank - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    j = rank  # dims j.. are taken whole, so each run spans them
    while j > 0 and local[j - 1] == (0, shape[j - 1]):
        j -= 1
    if j <= 1:
        start = offset + (local[0][0] * strides[0] * itemsize if rank else 0)
        total = box_volume(local) * itemsize
        return np.array([start], dtype=np.int64), total, True
    runs_dim = j - 1
    run_bytes = (local[runs_dim][1] - local[runs_dim][0]) * strides[runs_dim] * itemsize
    elem = np.full((), local[runs_dim][0] * strides[runs_dim], dtype=np.int64)
    for d in range(runs_dim):
        elem = np.add.outer(elem, np.arange(local[d][0], local[d][1], dtype=np.int64) * strides[d])
    return offset + elem.reshape(-1) * itemsize, run_bytes, False


def scatter_runs(offset: int, shape: Tuple[int, ...], local: Box, itemsize: int,
                  dest: np.ndarray) -> Optional[RunBatch]:
    """The reads that move the sub-box ``local`` of a row-major block stored at ``offset`` straight into
    the strided array ``dest``, or ``None`` where a temporary serves better.

    The box's bytes, in row-major order, are cut where the file is not contiguous
    (the runs of :func:`box_runs`) and where ``dest`` is not (its rows, say): every
    piece is then contiguous in both, and pieces next to each other in both were never
    cut (the cuts fall at the coarser of the two levels). Run ``i`` of the batch goes to
    byte ``dest_offsets[i]`` of a view spanning ``dest``'s memory. ``None``: negative
    strides, or pieces smaller than ``_MIN_SCATTER`` bytes (``_PAGE`` when the pieces are
    not next to each other in the file either).
    """
    rank = len(shape)
    box = box_shape(local)
    strides = dest.strides
    if rank == 0 or tuple(dest.shape) != box or any(st < 0 for st in strides) or box_volume(local) == 0:
        return None
    k, expect = rank, itemsize  # dims k.. of dest are laid out contiguously
    while k > 0 and (box[k - 1] == 1 or strides[k - 1] == expect):
        expect *= box[k - 1]
        k -= 1
    j = rank  # dims j.. are stored whole
    while j > 0 and local[j - 1] == (0, shape[j - 1]):
        j -= 1
    m = max(k, j - 1, 0)  # pieces span dims m..
    piece = itemsize * int(np.prod(box[m:], dtype=np.int64))
    file_contiguous = j <= 1  # the box is one range of the file
    if piece < (_MIN_SCATTER if file_contiguous else _PAGE):
        return None
    file_strides = [itemsize * int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(rank)]
    start = offset + sum(a * fs for (a, _), fs in zip(local, file_strides))
    at = np.zeros((), dtype=np.int64)
    where = np.zeros((), dtype=np.int64)
    for d in range(m):
        at = np.add.outer(at, np.arange(box[d], dtype=np.int64) * file_strides[d])
        where = np.add.outer(where, np.arange(box[d], dtype=np.int64) * strides[d])
    span = sum((n - 1) * st for n, st in zip(box, strides)) + itemsize
    try:
        raw = np.lib.stride_tricks.as_strided(dest.view(np.uint8), shape=(span,), strides=(1,))
    except ValueError:  # a last axis NumPy will not view as bytes
        return None
    return RunBatch(start + at.reshape(-1), piece, memoryview(raw), None,  # type: ignore[arg-type]
                    where.reshape(-1))


def read_box(fs: FileSystem, offset: int, shape: Tuple[int, ...], local: Box, dt: DType, fd: Any,
             path: str, dest: np.ndarray) -> None:
    """Read the sub-box ``local`` of a row-major block stored at ``offset`` of ``path`` into ``dest``."""
    itemsize = dt.itemsize
    assert itemsize is not None
    if not dest.flags.c_contiguous:  # e.g. columns of a tensor: scattered straight into its rows
        scattered = scatter_runs(offset, shape, local, itemsize, dest)
        if scattered is not None:
            fs.pread_batch(fd, scattered, path)
            return
    offsets, run_bytes, contiguous = box_runs(offset, shape, local, itemsize)
    if contiguous:  # one contiguous run (e.g. leading rows, or the whole block)
        pread_to(fs, fd, path, int(offsets[0]), dest)
        return
    target = dest if dest.flags.c_contiguous else np.empty(dest.shape, dtype=dest.dtype)
    cover = None
    if run_bytes < _PAGE:  # tiny runs: the rows that hold them, for stores where bytes are cheaper than calls
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
        cover = (offset + local[0][0] * row_bytes, (local[0][1] - local[0][0]) * row_bytes)
    fs.pread_batch(fd, RunBatch(offsets, run_bytes, byte_view(target), cover), path)
    if target is not dest:
        dest[...] = target


def pread_to(fs: FileSystem, fd: Any, path: str, start: int, target: np.ndarray) -> None:
    """Read ``target``'s bytes from ``start`` of ``path`` (through a temporary when it is strided)."""
    if target.flags.c_contiguous:
        fs.pread_into(fd, byte_view(target), start, path)
    else:
        tmp = np.empty(target.shape, dtype=target.dtype)
        fs.pread_into(fd, byte_view(tmp), start, path)
        target[...] = tmp


def decode_objects(fs: FileSystem, piece: StoredPiece, dt: DType, fd: Any, path: str,
                   big_endian: bool) -> np.ndarray:
    """The values of a string or variant piece, flat, decoded from its entry read whole (checksum checked)."""
    entry = piece.entry
    buf = bytearray(entry.size)
    fs.pread_into(fd, memoryview(buf), entry.offset, path)
    count = box_volume(piece.box)
    data = bytes(buf)
    try:
        if dt.is_string:
            items = decode_strings(data, count, entry.crc32c, big_endian=big_endian)
        else:
            items = decode_variants(data, count, entry.crc32c)
    except DataLossError as exc:
        raise DataLossError(exc.message, path=path, **piece.where()) from None
    values = np.empty(count, dtype=object)
    values[:] = items
    return values
