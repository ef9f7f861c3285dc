"""``TFBundleReader``: a ``torch.distributed.checkpoint`` StorageReader over any tensor bundle.

::

    dcp.load(state_dict, checkpoint_id="/ckpt/step-100", storage_reader=TFBundleReader())
    dcp.load(state_dict, storage_reader=TFBundleReader("/ckpt/model"))   # a prefix

A ``checkpoint_id`` or ``path`` is resolved as :func:`._layout.reader_prefix` does: a
prefix whose ``.index`` exists, or a directory (its ``checkpoint`` state file, its
``ckpt`` prefix, a SavedModel's ``variables/variables``).
It reads what :class:`~shardckpt.torch.TFBundleWriter` wrote, what TensorFlow wrote
(``tf.train.Checkpoint``, ``Saver``, sharded saves) and what shardckpt's own
``Checkpoint`` / ``DTensorCheckpoint`` wrote. Nothing is unpickled from disk.

DCP's call sequence, and what each step does here::

    read_metadata          DCP's Metadata, rebuilt from the index: every tensor key
                           (its name passed through ``key_map``) with its torch dtype,
                           global shape and stored chunks (one per stored slice, or
                           the whole tensor; the slice entries themselves are looked
                           up when a chunk is first read); string scalars holding an encoded
                           object (see _objects) and other string scalars (as bytes)
                           are BytesStorageMetadata. Keys whose dtype torch lacks,
                           and string tensors of rank > 0, are left out. planner_data:
                           each key's path in the nested state dict, from the
                           nesting entry (_objects.NESTING_KEY) where the save stored
                           one and the key keeps its name, else the key alone (so
                           loads without a target, dcp_to_torch_save and
                           _load_state_dict_from_keys rebuild the nesting).
    set_up_storage_reader  nothing (the index is already open)
    read_data              one plan of the restore engine (shardckpt.restoring): on
                           object stores the byte ranges of every read item are
                           announced first (BundleReader.prefetch: few large GETs,
                           fetched in parallel ahead of the reads); then
                           each read item names a stored chunk, the part of it to
                           read and where it goes: only that part's byte runs are read
                           (BundleReader.read_piece_region), straight into the
                           destination tensor's memory when it is a CPU tensor of the
                           stored dtype; a CUDA tensor of the stored dtype is read into a
                           page-locked buffer of torch's cache, then copied on the calling
                           thread's stream; else into a temporary of that one item, then
                           copy_, which casts as DCP's own reader does. Whole chunks
                           (a load onto the saved layout) go through the reader's read
                           pump: 2 MiB pieces, each checksummed right after it lands
                           (no second pass over the chunk). A part of a chunk cannot be
                           checksummed: its file's identity is checked after the read
                           instead; its rows go to the kernel in batches (see
                           storage/local.py: io_uring, or preadv with a buffer per
                           destination row for one range of the file). Items are read
                           on ``max_workers`` threads; with one (the default where the
                           host's ranks have a core each or fewer), reads and checksums
                           run on the calling thread. Non-tensors are handed to the planner the way
                           DCP's API requires (torch.save of the JSON-decoded plain
                           value into an in-memory buffer).

``key_map`` renames checkpoint keys to state-dict FQNs: a callable (key -> FQN, or
``None`` to leave the key out) or a dict (listed keys renamed, the rest kept).
Two keys mapped to one FQN are an error naming both.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import InvalidArgumentError, NotFoundError
from ..format import crc
from ..format.bundle_reader import BundleReader, StoredPiece
from ..format.dtypes import DType
from ..format.tensor_slice import box_shape
from ..restoring import BundleSource, Read, RestorePlan, run
from ..storage.base import normalize
from ..storage.local import LocalFileSystem, local_fs
from ..storage.object_store import ObjectStore
from ..storage.registry import get_fs
from ._dtypes import numpy_view, to_torch_dtype
from ._layout import reader_prefix
from ._objects import NESTING_KEY, decode_nesting, decode_object, is_object_entry
from ._staging import copy_on

__all__ = ["TFBundleReader", "KeyMap"]

KeyMap = Union[Callable[[str], Optional[str]], Mapping[str, str], None]


class _Stored:
    """One tensor of the checkpoint as DCP sees it: its key and dtype (pieces are looked up by chunk offset)."""

    __slots__ = ("key", "dtype")

    def __init__(self, key: bytes, dtype: DType) -> None:
        self.key = key
        self.dtype = dtype

    def piece(self, bundle: BundleReader, offset: Tuple[int, ...]) -> Optional[StoredPiece]:
        """The stored piece whose box starts at ``offset`` (only its slice entry is looked up, on first use)."""
        return bundle.piece_at(self.key, offset)


class TFBundleReader(StorageReader):
    """Read a tensor-bundle checkpoint at ``path`` (a prefix or a checkpoint directory; ``None``: given
    later as ``dcp.load(checkpoint_id=...)``) into DCP state dicts (see the module docstring).

    ``key_map``: checkpoint key -> FQN (callable or dict). ``verify``: check the
    CRC32C of every chunk read whole. ``max_workers``: threads reading at once; by
    default the cores this process may use divided among the ranks on this host
    (torchrun's ``LOCAL_WORLD_SIZE``), at most 4. With one, every read and checksum
    runs on the calling thread (no thread hand-offs where the ranks already keep
    every core busy). ``map_reads`` (local files): by default (``None``) parts of
    chunks made of many rows (a resharded load) are copied out of a memory map of the
    data file, populated first, instead of one read call per row (see
    :mod:`shardckpt.storage.mapped`: a disk error found while populating still raises;
    a page evicted and failing to re-read in the moment before its copy, or a data file
    truncated then, ends the process with ``SIGBUS``); ``False``: read calls only
    (batched through io_uring where allowed); ``True``: every batch of rows through maps.
    """

    def __init__(self, path: Any = None, *, key_map: KeyMap = None, verify: bool = True,
                 max_workers: Optional[int] = None, map_reads: Optional[bool] = None) -> None:
        super().__init__()
        self._path: Optional[str] = None if path is None else os.fspath(path)
        self._prefix: Optional[str] = None  # the bundle's prefix, resolved from _path by read_metadata
        if key_map is not None and not callable(key_map) and not isinstance(key_map, Mapping):
            raise InvalidArgumentError(f"key_map must be a callable or a dict, got {type(key_map).__name__}")
        self._key_map = key_map
        self._verify = verify
        self._workers = max(1, int(max_workers)) if max_workers is not None else min(4, threads_per_rank())
        self._map_reads = map_reads
        self._local_fs: Optional[LocalFileSystem] = None
        self._bundle: Optional[BundleReader] = None
        self._tensors: Dict[str, _Stored] = {}
        self._objects: Dict[str, Any] = {}
        self._metadata: Optional[Metadata] = None

    # -- StorageReader ------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """A new load begins; ``checkpoint_id`` (when given) is the prefix to read."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self._path:
            self._path = os.fspath(checkpoint_id)
            self.close()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata of the checkpoint, rebuilt from its index (no pickle)."""
        if self._metadata is None:
            self._metadata = self._build_metadata()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the index was opened by :meth:`read_metadata`."""
        self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The planner's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """The planners' plans, unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Serve every read item of ``plan`` (see the module docstring); done when the future is returned."""
        self.read_metadata()
        bundle = self._bundle
        assert bundle is not None
        tensor_items: List[ReadItem] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                fqn = item.storage_index.fqn
                if fqn not in self._objects:
                    raise NotFoundError("no such object in the checkpoint", path=self._prefix or self._path, key=fqn)
                buf = io.BytesIO()
                torch.save(self._objects[fqn], buf)  # DCP's load_bytes takes torch.save bytes; memory only
                buf.seek(0)
                planner.load_bytes(item, buf)
            else:
                tensor_items.append(item)
        streams = _caller_streams()
        planned = [self._plan_item(bundle, item, planner, streams) for item in tensor_items]
        run(RestorePlan.of(BundleSource(bundle, owned=False), [read for _, _, read in planned], verify=self._verify,
                           workers=self._workers))
        for item, target, _ in planned:  # every byte is in place and checked
            planner.commit_tensor(item, target)
        done: "Future[None]" = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Whether ``checkpoint_id`` names a tensor bundle: a prefix whose ``.index`` exists, or a
        checkpoint directory (see :mod:`._layout`)."""
        try:
            reader_prefix(checkpoint_id)
            return True
        except Exception:  # noqa: BLE001 - DCP asks every reader; a wrong guess is simply "no"
            return False

    def close(self) -> None:
        """Close the checkpoint's files (a later load opens them again)."""
        if self._bundle is not None:
            self._bundle.close()
        self._bundle = None
        self._metadata = None
        self._tensors = {}
        self._objects = {}

    @property
    def mapped_bytes(self) -> int:
        """Bytes this reader copied out of memory maps (rows of resharded reads, ``map_reads``); read calls
        not included."""
        return self._local_fs.mapped_bytes if self._local_fs is not None else 0

    @property
    def ring_bytes(self) -> int:
        """Bytes this reader read through io_uring (parts of chunks made of many rows), which
        ``/proc``'s ``rchar`` does not count; other read calls not included."""
        return self._local_fs.ring_bytes if self._local_fs is not None else 0

    # -- metadata -----------------------------------------------------------------------------------------
    def _name(self, key: str) -> Optional[str]:
        if self._key_map is None:
            return key
        if callable(self._key_map):
            return self._key_map(key)
        return self._key_map.get(key, key)

    def _build_metadata(self) -> Metadata:
        if self._path is None:
            raise InvalidArgumentError("TFBundleReader has no path: give one to the constructor or as "
                                       "dcp.load(checkpoint_id=...)")
        context = _SOLO if self._workers == 1 else None  # one thread: the caller reads and checksums each entry
        bundle = _open_as_prefix_on_object_store(self._path, context)
        if bundle is None:
            prefix = reader_prefix(self._path)
            fs = get_fs(prefix)
            if fs is local_fs:  # a store of its own: its counters are this reader's
                fs = self._local_fs = self._local_fs or LocalFileSystem(map_runs=self._map_reads)
            bundle = BundleReader(prefix, fs=fs, context=context)
        prefix = self._prefix = bundle.prefix
        self._bundle = bundle
        entries: Dict[str, Any] = {}
        owners: Dict[str, str] = {}
        nesting: Dict[str, Tuple[Any, ...]] = {}
        for raw in bundle.keys():
            key = raw.decode("utf-8", "backslashreplace")
            dtype = bundle.dtype(raw)
            shape = bundle.shape(raw)
            if key == NESTING_KEY and dtype.is_string and shape == ():
                nesting = decode_nesting(bytes(bundle.read(raw, verify=self._verify).reshape(()).item()), prefix)
                continue
            fqn = self._name(key)
            if fqn is None:
                continue
            if dtype.is_string:
                if shape != ():
                    continue
                data = bytes(bundle.read(raw, verify=self._verify).reshape(()).item())
                value: Any = decode_object(data, key, prefix) if is_object_entry(data) else data
                md: Any = BytesStorageMetadata()
            else:
                torch_dtype = to_torch_dtype(dtype)
                if torch_dtype is None:
                    continue
                chunks = [ChunkStorageMetadata(offsets=torch.Size([a for a, _ in box]),
                                               sizes=torch.Size(box_shape(box))) for box in bundle.piece_boxes(raw)]
                md = TensorStorageMetadata(properties=TensorProperties(dtype=torch_dtype), size=torch.Size(shape),
                                           chunks=chunks)
            if fqn in owners:
                raise InvalidArgumentError(f"key_map maps both {owners[fqn]!r} and {key!r} to {fqn!r}",
                                           path=prefix)
            owners[fqn] = key
            entries[fqn] = md
            if isinstance(md, BytesStorageMetadata):
                self._objects[fqn] = value
            else:
                self._tensors[fqn] = _Stored(raw, dtype)
        # a stored path only for a key loaded under its own name; any other key sits at the top
        planner_data = {fqn: nesting.get(key, (fqn,)) if key == fqn else (fqn,) for fqn, key in owners.items()}
        return Metadata(state_dict_metadata=entries, planner_data=planner_data, storage_data={})

    # -- reads --------------------------------------------------------------------------------------------
    def _plan_item(self, bundle: BundleReader, item: ReadItem, planner: LoadPlanner,
                   streams: Dict[int, Any]) -> Tuple[ReadItem, torch.Tensor, Read]:
        """The read of one DCP read item: its stored chunk, the part of it, and where the bytes go."""
        fqn = item.storage_index.fqn
        stored = self._tensors.get(fqn)
        if stored is None:
            raise NotFoundError("no such tensor in the checkpoint", path=self._prefix or self._path, key=fqn)
        offset = tuple(int(d) for d in (item.storage_index.offset or ()))
        piece = stored.piece(bundle, offset)
        if piece is None:
            raise NotFoundError(f"no stored chunk at offset {list(offset)}", path=self._prefix or self._path, key=fqn)
        local = tuple((int(o), int(o) + int(n)) for o, n in zip(item.storage_offsets, item.lengths))
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != box_shape(local):
            raise InvalidArgumentError(f"the planner's destination has shape {list(target.shape)}, the read item "
                                       f"{list(box_shape(local))}", path=self._prefix or self._path, key=fqn)
        torch_dtype = to_torch_dtype(stored.dtype)
        if target.device.type == "cpu" and target.dtype == torch_dtype:
            view = numpy_view(target, stored.dtype, contiguous=False)  # the destination's own memory
            return item, target, Read(fqn, local, view, piece)
        if target.device.type == "cuda" and target.dtype == torch_dtype and streams:
            # read and checked into a page-locked buffer of torch's cache, then copied on the caller's stream
            host = torch.empty(tuple(target.shape), dtype=torch_dtype, pin_memory=True)
            stream = streams[target.device.index or 0]
            return item, target, Read(fqn, local, numpy_view(host, stored.dtype), piece,
                                      then=lambda _: copy_on(stream, target, host))
        # another device or dtype: through a temporary of this item only, read and checked, then copy_
        return item, target, Read(fqn, local, None, piece, then=lambda temp: _copy_cast(temp, target, torch_dtype))


def _copy_cast(temp: np.ndarray, target: torch.Tensor, torch_dtype: Any) -> None:
    """``target.copy_`` of a read temporary (its stored dtype), which casts as DCP's own reader does."""
    source = torch.from_numpy(temp.view(_CARRIERS[temp.dtype.itemsize]) if temp.dtype.kind == "V" else temp)
    if torch_dtype is not None and source.dtype != torch_dtype:
        source = source.view(torch_dtype)
    target.copy_(source)


def _caller_streams() -> Dict[int, Any]:
    """The calling thread's current CUDA stream of each device (none when CUDA was never initialized:
    then no destination is on a GPU)."""
    if not torch.cuda.is_initialized():
        return {}
    return {i: torch.cuda.current_stream(i) for i in range(torch.cuda.device_count())}


def threads_per_rank() -> int:
    """The cores this process may run on, shared among the ranks on this host (``LOCAL_WORLD_SIZE``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, cores // max(1, local))


_SOLO = crc.ChecksumContext(workers=0)  # no helper threads: whole entries are read and checksummed by the caller
_CARRIERS = {1: np.uint8, 2: np.int16}  # NumPy views of ml_dtypes values that torch.from_numpy accepts


def _open_as_prefix_on_object_store(path: Any, context: Any) -> Optional[BundleReader]:
    """On an object store, the bundle at ``path`` opened as a prefix (its listing and index GET answer
    what resolving the path would ask: one request fewer); ``None`` where that is not it (a directory,
    a local path: resolved by :func:`._layout.reader_prefix`)."""
    text = normalize(os.fspath(path))
    store = get_fs(text)
    if not isinstance(store, ObjectStore):
        return None
    try:
        return BundleReader(text, fs=store, context=context)
    except NotFoundError:
        return None
