"""Announcing reads to the store ahead of them: the byte ranges a batch of reads will touch.

Object stores then fetch the byte ranges those reads need (whole entries, or the runs of
a region) in few large requests, in parallel, ahead of the reads
(:meth:`~shardckpt.storage.fsspec_fs.FsspecFileSystem.prefetch`); local files whose
announced bytes leave gaps are read through a guide
(:meth:`~shardckpt.storage.local.LocalFileSystem.prefetch`). The reads themselves are
unchanged and checked as always. Only entries that fit their files (and, for regions,
pass the reader's other checks) are announced; any problem is left for the read to
report. Nothing is read here but the index, and nothing happens on stores that take no
announcements.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import ShardckptError
from ..storage.base import FileSystem
from .bundle_files import DataFiles
from .bundle_index import BundleIndex, KeyLike, key_bytes
from .bundle_pieces import PieceLookup, StoredPiece, region_box, relative
from .dtypes import from_enum
from .region_reads import box_runs
from .tensor_slice import Box, TensorSlice, box_shape, box_volume, full_box

__all__ = ["announces", "plan_regions", "announce_pieces"]

Region = Optional[Union[Box, TensorSlice, str]]


def announces(fs: FileSystem) -> bool:
    """Whether ``fs`` takes announcements (callers may skip building the list)."""
    return fs.prefetches


def plan_regions(index: BundleIndex, lookup: PieceLookup,
                 regions: Sequence[Tuple[KeyLike, Region]]) -> List[Tuple[StoredPiece, Optional[Box]]]:
    """The stored pieces that reads of ``regions`` (``(key, region)``; ``None``: the whole tensor) touch,
    each with the box read relative to the piece (``None``: whole). Keys or regions that fail a check
    are left out (the read reports them)."""
    reads: List[Tuple[StoredPiece, Optional[Box]]] = []
    for key, region in regions:
        try:
            kb = key_bytes(key)
            entry = index.entry(kb)
            if region is None and not entry.slices:  # the common case, one entry read whole: no planning
                reads.append((StoredPiece(full_box(index.shape(kb)), kb, entry, kb), None))
                continue
            box = region_box(region, index.shape(kb), index.prefix, kb)
            for piece, common in lookup.overlapping(kb, box):
                reads.append((piece, relative(common, piece)))
        except ShardckptError:
            continue
    return reads


def announce_pieces(fs: FileSystem, files: DataFiles, reads: Sequence[Tuple[StoredPiece, Optional[Box]]]) -> int:
    """Announce to ``fs`` the bytes of ``reads`` (``(piece, box relative to the piece)``, ``None`` for the
    whole piece), one call per data file. Returns the number of requests the store planned."""
    if not announces(fs):
        return 0
    hint = fs.prefetch  # type: ignore[attr-defined]
    opened: Dict[int, Tuple[Any, str, int]] = {}  # shard -> (descriptor, path, size)
    # shard -> announced [start, end) pairs: of whole pieces (ints), of regions (arrays of runs)
    whole: Dict[int, Tuple[List[int], List[int]]] = {}
    runs: Dict[int, Tuple[List[np.ndarray], List[np.ndarray]]] = {}
    for piece, local in reads:
        try:
            entry = piece.entry
            stored = box_shape(piece.box) if local is not None else ()
            if local is not None and box_volume(local) == 0:
                continue
            shard = int(entry.shard_id)
            if local is None or local == full_box(stored):  # read whole: its entry's bytes, if they fit
                if shard not in opened:
                    fd, size = files.open(shard)
                    opened[shard] = (fd, files.path(shard), size)
                if entry.offset + entry.size <= opened[shard][2]:
                    pairs = whole.setdefault(shard, ([], []))
                    pairs[0].append(int(entry.offset))
                    pairs[1].append(int(entry.offset + entry.size))
                continue
            dt = from_enum(entry.dtype)
            fd, path = files.locate(piece, dt)  # opened, and the entry checked against the file
            if dt.itemsize is None:
                starts = np.array([int(entry.offset)], dtype=np.int64)
                run = int(entry.size)
            else:
                starts, run, _ = box_runs(int(entry.offset), stored, tuple(local), dt.itemsize)
            opened.setdefault(shard, (fd, path, files.sizes[shard]))
            arrays = runs.setdefault(shard, ([], []))
            arrays[0].append(starts)
            arrays[1].append(starts + run)
        except ShardckptError:
            continue
    planned = 0
    for shard in whole.keys() | runs.keys():
        one_starts, one_ends = whole.get(shard, ([], []))
        many_starts, many_ends = runs.get(shard, ([], []))
        fd, path, _ = opened[shard]
        starts_all = np.concatenate([np.asarray(one_starts, dtype=np.int64)] + many_starts)
        ends_all = np.concatenate([np.asarray(one_ends, dtype=np.int64)] + many_ends)
        planned += int(hint(fd, starts_all, ends_all, path) or 0)
    return planned
