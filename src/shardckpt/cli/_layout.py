"""Where a checkpoint's bytes live, as the CLI reports it.

:func:`open_bundle` turns a user-given path into an open :class:`BundleReader`;
:func:`tensor_layout` describes one tensor (dtype, shape and its stored pieces:
the whole entry, or one piece per slice with the slice's spec text);
:func:`data_files` lists the data files with their sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..checkpoint.reader import resolve_prefix
from ..errors import InvalidArgumentError
from ..format.bundle_reader import BundleReader
from ..format.dtypes import DType
from ..format.tensor_slice import Box, TensorSlice
from ..storage.location import Location
from ._text import key_text

__all__ = ["PieceLayout", "TensorLayout", "DataFile", "open_bundle", "tensor_layout", "data_files"]


@dataclass(frozen=True)
class PieceLayout:
    """One stored piece of a tensor: the whole entry (``spec is None``) or one slice."""

    key: bytes  #: the index key of the piece (the tensor's key, or its encoded slice key)
    spec: Optional[str]  #: TF slice text such as ``"0,4:-"``; ``None`` for a whole entry
    shard: int
    offset: int
    size: int
    file: str  #: path of the data file that holds the bytes
    box: Box  #: the ``(start, stop)`` region of the full tensor this piece holds


@dataclass(frozen=True)
class TensorLayout:
    """A tensor's dtype, full shape and stored pieces."""

    key: bytes
    dtype: DType
    shape: Tuple[int, ...]
    pieces: List[PieceLayout]
    sliced: bool

    @property
    def name(self) -> str:
        return key_text(self.key)

    @property
    def nbytes(self) -> int:
        """Bytes stored for this tensor, over all its pieces."""
        return sum(p.size for p in self.pieces)

    @property
    def shards(self) -> List[int]:
        return sorted({p.shard for p in self.pieces})

    def location(self) -> str:
        """``shard 0 @ 128`` for a whole entry, ``2 slices in shards {0,2}`` for a sliced one."""
        if not self.sliced:
            piece = self.pieces[0]
            return f"shard {piece.shard} @ {piece.offset}"
        count = len(self.pieces)
        shards = ",".join(str(s) for s in self.shards)
        return f"{count} slice{'s' if count != 1 else ''} in shards {{{shards}}}"

    def slice_spec(self, piece_key: bytes) -> Optional[str]:
        """The slice text of the piece stored under ``piece_key`` (``None`` if not a slice of this tensor)."""
        for piece in self.pieces:
            if piece.key == piece_key:
                return piece.spec
        return None


@dataclass(frozen=True)
class DataFile:
    """One ``<prefix>.data-NNNNN-of-NNNNN`` file; ``size`` is ``None`` when it is missing."""

    shard: int
    path: str
    size: Optional[int]


def open_bundle(path: str) -> BundleReader:
    """Open the checkpoint at ``path`` (a prefix, a checkpoint directory or a SavedModel directory).

    A path that holds another format (a ``.safetensors`` file, a Hugging Face folder, an
    ``.npz``, a DCP folder) raises :class:`~shardckpt.errors.InvalidArgumentError` saying
    what it is and which commands read it, instead of "the .index file is missing".
    """
    from ..convert.detect import source_format

    fmt = source_format(path)
    if fmt != "tf":
        raise InvalidArgumentError(
            f"this is a {_FORMAT_NAMES.get(fmt, fmt)}, not a TensorFlow checkpoint: `shardckpt inspect --tree` "
            f"lists its tensors, `shardckpt diff` compares it, `shardckpt convert PATH OUT --to tf` makes a "
            f"TensorFlow checkpoint of it", path=path)
    return BundleReader(Location.of(resolve_prefix(path)))


_FORMAT_NAMES = {"safetensors": "safetensors file", "hf": "Hugging Face folder", "npz": "NumPy .npz archive",
                 "dcp": "PyTorch DCP folder"}


def tensor_layout(reader: BundleReader, key: bytes) -> TensorLayout:
    """Describe tensor ``key``; raises a :class:`~shardckpt.errors.ShardckptError` for a bad entry."""
    entry = reader.entry(key)
    pieces = reader.pieces(key)
    sliced = bool(entry.slices)
    # pieces() lists the slices in the order of the entry's slice protos
    specs: List[Optional[str]] = [str(TensorSlice.from_proto(proto)) for proto in entry.slices] if sliced else [None]
    out = [PieceLayout(key=p.key, spec=spec, shard=int(p.entry.shard_id), offset=int(p.entry.offset),
                       size=int(p.entry.size), file=reader.data_path(int(p.entry.shard_id)), box=p.box)
           for p, spec in zip(pieces, specs, strict=True)]
    return TensorLayout(key=key, dtype=reader.dtype(key), shape=reader.shape(key), pieces=out, sliced=sliced)


def data_files(reader: BundleReader) -> List[DataFile]:
    """Every data file the header announces, with its size (``None`` if it does not exist)."""
    out = []
    for shard in range(reader.num_shards):
        path = reader.data_path(shard)
        try:
            size: Optional[int] = os.path.getsize(path)
        except OSError:
            size = None
        out.append(DataFile(shard=shard, path=path, size=size))
    return out
