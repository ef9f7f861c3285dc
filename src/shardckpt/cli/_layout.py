"""Where a checkpoint's bytes live, as the CLI reports it.

Every command resolves the path it is given once (:meth:`Location.of
<shardckpt.storage.location.Location.of>`): the store that serves it (the local
filesystem, or an object store for ``s3://`` and other fsspec URLs) and every file
operation below go through that store's :class:`~shardckpt.storage.base.FileSystem`
methods, so a command works the same on an object store as on a local folder.

:func:`open_bundle` turns a user-given path into an open :class:`BundleReader`;
:func:`tensor_layout` describes one tensor (dtype, shape and its stored pieces:
the whole entry, or one piece per slice with the slice's spec text);
:func:`data_files` lists the data files with their sizes (one size request per
file, no tensor byte read) and, given the tensors' layouts, the size the index says
each must have at least; :meth:`DataFile.problem` tells a missing or cut-short file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ..checkpoint.reader import open_bundle as open_prefix
from ..errors import DataLossError, InvalidArgumentError, NotFoundError, ShardckptError
from ..format.bundle_reader import BundleReader
from ..format.dtypes import DType
from ..format.tensor_slice import Box, TensorSlice
from ..storage.base import FileSystem
from ..storage.location import Location
from ._text import key_text

__all__ = ["PieceLayout", "TensorLayout", "DataFile", "locate", "open_bundle", "tensor_layout", "data_files",
           "file_problems"]


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
    """One ``<prefix>.data-NNNNN-of-NNNNN`` file; ``size`` is ``None`` when it is missing.

    ``needed`` is where the last entry the index puts in this file ends (``None`` when
    not computed): a file shorter than that was cut short.
    """

    shard: int
    path: str
    size: Optional[int]
    needed: Optional[int] = None

    @property
    def name(self) -> str:
        """The file's name without its folder (``ckpt.data-00000-of-00001``)."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def problem(self) -> Optional[ShardckptError]:
        """What is wrong with the file, as the error a read of it would raise; ``None`` when nothing is."""
        if self.size is None:
            return NotFoundError("data file of the checkpoint is missing", path=self.path)
        if self.needed is not None and self.size < self.needed:
            return DataLossError(f"data file is {self.size} bytes, but the index has entries in it up to byte "
                                 f"{self.needed}: it was cut short", path=self.path)
        return None


def locate(path: Union[str, Location]) -> Location:
    """``path`` (a string, or a :class:`Location` already resolved) and the store that serves it."""
    return path if isinstance(path, Location) else Location.of(path)


def open_bundle(path: Union[str, Location]) -> BundleReader:
    """Open the checkpoint at ``path`` (a prefix, a checkpoint directory or a SavedModel directory,
    local or on an object store; a :class:`Location` is read through its store).

    A path that holds another format (a ``.safetensors`` file, a Hugging Face folder, an
    ``.npz``, a DCP folder) raises :class:`~shardckpt.errors.InvalidArgumentError` saying
    what it is and which commands read it, instead of "the .index file is missing".
    """
    from ..convert.detect import source_format

    location = locate(path)
    fmt = source_format(location.prefix)
    if fmt != "tf":
        raise InvalidArgumentError(
            f"this is a {_FORMAT_NAMES.get(fmt, fmt)}, not a TensorFlow checkpoint: `shardckpt inspect --tree` "
            f"lists its tensors, `shardckpt diff` compares it, `shardckpt convert PATH OUT --to tf` makes a "
            f"TensorFlow checkpoint of it", path=location.prefix)
    return open_prefix(location.prefix, location.fs)


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


def data_files(reader: BundleReader, fs: FileSystem, layouts: Optional[Sequence[object]] = None) -> List[DataFile]:
    """Every data file the header announces, with its size on ``fs`` (``None`` if it does not exist).

    With ``layouts`` (rows of which the :class:`TensorLayout` ones count) each file also gets
    ``needed``: the end of the last piece they put in it. Nothing but sizes is asked of the store.
    """
    needed: Dict[int, int] = {}
    for layout in layouts or ():
        if isinstance(layout, TensorLayout):
            for piece in layout.pieces:
                if piece.size:
                    needed[piece.shard] = max(needed.get(piece.shard, 0), piece.offset + piece.size)
    out = []
    for shard in range(reader.num_shards):
        path = reader.data_path(shard)
        try:
            size: Optional[int] = fs.size(path)
        except NotFoundError:
            size = None
        end = None if layouts is None else needed.get(shard, 0)
        out.append(DataFile(shard=shard, path=path, size=size, needed=end))
    return out


def file_problems(files: Iterable[DataFile]) -> List[ShardckptError]:
    """The problems of ``files`` (missing, cut short), in shard order."""
    return [problem for problem in (f.problem() for f in files) if problem is not None]
