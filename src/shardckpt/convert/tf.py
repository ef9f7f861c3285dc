"""TensorFlow checkpoints (tensor bundle V2) as a conversion source and destination.

Reading goes through :class:`~shardckpt.format.bundle_reader.BundleReader`: the path
may be a prefix, a directory with a ``checkpoint`` state file, or a SavedModel
directory (its ``variables/variables``). Sliced and partitioned variables are listed
once under their full key and assembled into whole tensors (each stored slice read
once, straight into the result); the checksums are verified as the bytes arrive.
Every tensor a conversion writes is checked (:meth:`TFSource.check_stored`) before any
buffer is sized from its shape: each stored piece must hold exactly its shape times its
dtype's size (at least one byte per element for strings) and lie inside its data file,
and a sliced tensor's pieces must hold at least its elements, so a declared size is
never more than the bytes on disk (a hostile index costs no memory; a damaged tensor
can still be left out with ``--drop``).

Writing goes through :func:`shardckpt.save_tensors` (atomic commit, the bundle
format's own rules). Values are lazy: :class:`StreamingShardPolicy`, a
:class:`~shardckpt.MaxShardSizePolicy` that packs by declared sizes instead of
reading values, assigns tensors to shards, and a tensor larger than the limit is cut
along axis 0 into slabs read one at a time. Shards are written one after the other
so at most one value is in memory. ``save_tensors`` checks every value against the
plan before writing it, so each tensor is read twice (the price of going through the
one save path, with its validation and atomic commit). A destination that is a directory (an existing
one, or a path ending in ``/``) gets the prefix ``DIR/ckpt`` and a ``checkpoint``
state file naming it, so ``tf.train.latest_checkpoint(DIR)`` finds it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..checkpoint.reader import resolve_prefix
from ..checkpoint.state import update_checkpoint_state
from ..errors import DataLossError, NotFoundError
from ..format.bundle_reader import BundleReader
from ..format.tensor_slice import TensorSlice, box_volume, format_shape_and_slice
from ..restoring import BundleSource, Read, read_one
from ..saving import CheckpointOptions, save_tensors
from ..sharding import MaxShardSizePolicy, ShardableTensor
from ..sharding.callback import Shard
from ..storage import get_fs
from ..storage.location import Location
from .model import NO_PROGRESS, Fetch, Progress, Sink, Source, TensorInfo

__all__ = ["TFSource", "TFSink", "StreamingShardPolicy", "OBJECT_GRAPH_KEY"]

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


class TFSource(Source):
    """A TensorFlow checkpoint (prefix, checkpoint directory or SavedModel directory)."""

    format = "tf"

    def __init__(self, path: str) -> None:
        self.path = resolve_prefix(path)
        self.bundle = BundleReader(Location.of(self.path))
        self.source = BundleSource(self.bundle)  # reads: plans of the restore engine, one tensor at a time
        self.infos: Dict[str, TensorInfo] = {}
        self.keys: Dict[str, bytes] = {}
        for key in self.bundle.keys():
            name = key.decode("utf-8", "backslashreplace")
            self.keys[name] = key
            self.infos[name] = TensorInfo(name, self.bundle.dtype(key), tuple(self.bundle.shape(key)))

    def check_stored(self, name: str) -> None:
        """The bytes on disk justify the declared shape (see the module docstring): the reader's own
        check of each piece (size against shape x dtype, inside its data file), before any read."""
        key = self.keys[name]
        dtype = self.bundle.dtype(key)
        pieces = self.bundle.pieces(key)
        stored = 0
        for piece in pieces:
            self.bundle.check_piece(piece, dtype)
            stored += box_volume(piece.box)
        want = math.prod(self.bundle.shape(key))
        if stored < want:
            raise DataLossError(f"its {len(pieces)} stored slices hold {stored} of its {want} elements",
                                path=self.path, key=key)

    def tensors(self) -> List[TensorInfo]:
        return list(self.infos.values())

    def read(self, name: str) -> np.ndarray:
        if name not in self.keys:
            raise NotFoundError("no such tensor", path=self.path, key=name)
        return read_one(self.source, Read(self.keys[name]))

    def read_into(self, name: str, out: np.ndarray) -> Optional[np.ndarray]:
        return read_one(self.source, Read(self.keys[name], None, out))

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        info = self.infos[name]
        box = ((start, stop),) + tuple((0, d) for d in info.shape[1:])
        return read_one(self.source, Read(self.keys[name], box))

    def close(self) -> None:
        self.source.close()


class StreamingShardPolicy(MaxShardSizePolicy):
    """:class:`~shardckpt.MaxShardSizePolicy` over lazy values: sizes come from dtype and shape.

    ``slab(key, start, stop)`` returns rows ``[start, stop)`` of a tensor along axis 0;
    it is used for tensors larger than the limit, which are cut into slabs of whole
    rows (at least one row each). Strings count as 0 bytes (their size is unknown
    until read).
    """

    def __init__(self, max_shard_size: Optional[int],
                 slab: Callable[[str, int, int], np.ndarray]) -> None:
        super().__init__(max_shard_size or (1 << 62))
        self.slab = slab

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> List[Shard]:
        limit = self.max_shard_size
        shards: List[Shard] = [{}]
        used = 0
        for st in shardable_tensors:
            nbytes = math.prod(st.shape) * (st.dtype.itemsize or 0)
            if nbytes <= limit or not st.shape or st.shape[0] <= 1:
                if shards[-1] and used + nbytes > limit:
                    shards.append({})
                    used = 0
                shards[-1][st.checkpoint_key] = {"": st.tensor}
                used += nbytes
                continue
            row = nbytes // st.shape[0]
            rows = max(1, limit // row) if row else st.shape[0]
            for start in range(0, st.shape[0], rows):
                stop = min(st.shape[0], start + rows)
                box = ((start, stop),) + tuple((0, d) for d in st.shape[1:])
                spec = format_shape_and_slice(st.shape, TensorSlice.from_box(box))
                if shards[-1]:
                    shards.append({})
                shards[-1][st.checkpoint_key] = {spec: _lazy(self.slab, st.checkpoint_key, start, stop)}
                used = row * (stop - start)
        return [s for s in shards if s]


def _lazy(slab: Callable[[str, int, int], np.ndarray], key: str, start: int, stop: int) -> Callable[[], np.ndarray]:
    return lambda: slab(key, start, stop)


class TFSink(Sink):
    """A TensorFlow checkpoint written through :func:`shardckpt.save_tensors`."""

    format = "tf"

    def __init__(self, path: str, max_shard_size: Optional[int] = None,
                 read_rows: Optional[Callable[[int, int, int], np.ndarray]] = None) -> None:
        super().__init__(path)
        self.max_shard_size = max_shard_size
        self.read_rows = read_rows

    def prefix(self) -> "tuple[str, Optional[str]]":
        """``(prefix, directory for a state file or None)``."""
        fs = get_fs(self.path)
        if self.path.endswith("/") or fs.isdir(self.path):
            directory = self.path.rstrip("/")
            return fs.join(directory, "ckpt"), directory
        return self.path, None

    def write(self, infos: Sequence[TensorInfo], fetch: Fetch, metadata: Dict[str, str],
              progress: Progress = NO_PROGRESS) -> List[str]:
        prefix, directory = self.prefix()
        fs = get_fs(prefix)
        fs.makedirs(fs.dirname(prefix) or ".")
        position = {info.name: i for i, info in enumerate(infos)}
        # save_tensors calls each lazy value twice: once to validate the plan, once to write it.
        fetched: set = set()

        def report(what: Any, name: str, nbytes: int) -> None:
            if what in fetched:
                progress(name, nbytes)
            fetched.add(what)

        def value(i: int) -> Callable[[], Any]:
            def get() -> np.ndarray:
                out = fetch(i)
                report(i, infos[i].name, infos[i].nbytes)
                return out
            return get

        def slab(key: str, start: int, stop: int) -> np.ndarray:
            i = position[key]
            if self.read_rows is not None:
                part = self.read_rows(i, start, stop)
            else:
                part = fetch(i)[start:stop]
            report((key, start), key, part.nbytes)
            return part

        tensors = [ShardableTensor(checkpoint_key=info.name, tensor=value(i), dtype=info.dtype, shape=info.shape)
                   for i, info in enumerate(infos)]
        policy = StreamingShardPolicy(self.max_shard_size, slab)
        save_tensors(prefix, tensors, CheckpointOptions(sharding_callback=policy), max_workers=1)
        if directory is not None:
            update_checkpoint_state(directory, prefix)
        return [prefix]
