"""``TFBundleWriter``: a ``torch.distributed.checkpoint`` StorageWriter that writes a tensor bundle.

::

    dcp.save(state_dict, checkpoint_id="/ckpt/step-100", storage_writer=TFBundleWriter())
    dcp.save(state_dict, storage_writer=TFBundleWriter("/ckpt/model"))   # a prefix, as in TensorFlow

A ``checkpoint_id`` is a directory, as for DCP's ``FileSystemWriter``: the bundle is
written inside it (``<dir>/ckpt.index``, ``<dir>/ckpt.data-NNNNN-of-NNNNN``) with the
``checkpoint`` state file that TensorFlow's ``tf.train.load_checkpoint(dir)`` follows
(see :mod:`._layout`). A ``path`` given to the constructor is a checkpoint *prefix*
(``/ckpt/model.index`` ...), unless it is an existing directory or ends with ``/``.
``s3://`` locations work like local ones (the index-last committer).

DCP's call sequence, and what each step does here::

    set_up_storage_writer  all   the ranks of DCP's call (its process_group, the default
                                 group, or this process alone under no_dist) and their
                                 coordinator (_call.coordinator_for: made once per group,
                                 collectively over that group's ranks only; under no_dist
                                 a one-process coordinator: nothing collective happens)
    prepare_local_plan     all   every tensor item's dtype is checked (an error names the key);
                                 overwrite=False refuses an existing checkpoint
    prepare_global_plan    coord the plans' planner_data (DCP's key -> nesting path) kept
    write_data             all   items -> ShardableTensors (a chunk of a tensor is a slice
                                 entry of its global key in TF's slice spelling; a whole
                                 tensor a plain entry; a non-tensor a JSON string scalar,
                                 see _objects; DCP's coordinator adds the nesting entry,
                                 _objects.NESTING_KEY); every rank agrees that all converted
                                 before any byte is written; then the ONE save engine
                                 (saving.engine.save): plan -> write -> agree -> commit ->
                                 the directory's state file (on_commit)
    finish                 coord nothing: the engine committed inside write_data, and DCP's
                                 pickled Metadata is not written

On disk at every moment: what the engine's committer promises (rename-commit
locally: shards under ``<prefix>_temp_<id>/`` until the index rename; index-last on
object stores), then the state file replaced atomically. A save that dies anywhere
leaves the previous checkpoint at the prefix readable and untouched. No
``.metadata`` pickle, no pickle at all: the reader rebuilds DCP's ``Metadata`` from
the index.

CPU tensors are written from their own memory (NumPy views, no copy); tensors on
other devices are copied to host when their shard is written: a CUDA tensor into a
page-locked buffer of torch's pinned-memory cache (:func:`._staging.pinned_copy`, one
shard at a time, the buffers reused by the next shards and saves), others with
``.to("cpu")``. For ``dcp.async_save`` the writer is also DCP's ``AsyncStager``:
``stage`` copies the state dict into host buffers (:mod:`._staging`; kept for the next
save unless ``cache_staged_state_dict=False``), and, on the caller's thread, makes the
clone of the call's coordinator that the background write runs on (the group comes
from ``async_save``'s arguments). With the PROCESS checkpointer DCP pickles the
writer (in memory) to its checkpoint process: the coordinators and the stager stay
behind (``__getstate__``), and the checkpoint process makes its own world's coordinator
when DCP sets the writer up there (its torch.distributed world is the gloo default
group DCP initialized there, the same ranks). The staged copy is made in shared
memory, so it travels by file descriptor without another copy; this process cannot
tell when the checkpoint process is done with it, so with that checkpointer each
staging gets new buffers (the old ones are freed with DCP's request) instead of
reusing them.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..distributed.coordinator import CoordinationError, Coordinator
from ..distributed.single import SingleProcessCoordinator
from ..errors import AlreadyExistsError, InvalidArgumentError, UnsupportedError
from ..format.naming import index_filename
from ..format.tensor_slice import FULL, TensorSlice, format_shape_and_slice
from ..saving.context import default_context
from ..saving.engine import save as engine_save
from ..saving.options import CheckpointOptions
from ..saving.request import SaveRequest
from ..sharding.shardable import ShardableTensor
from ..storage.location import Location
from ..storage.registry import get_fs
from ._call import coordinator_for, current_call
from ._dtypes import numpy_view, to_bundle_dtype
from ._layout import write_state_file, writer_target
from ._objects import NESTING_KEY, encode_nesting, encode_object
from ._shards import writer_sharding
from ._staging import default_stager, pinned_copy

__all__ = ["TFBundleWriter"]


def _device(rank: int) -> str:
    return f"/job:localhost/replica:0/task:{rank}/device:CPU:0"


def _slice_spec(size: Tuple[int, ...], offsets: Tuple[int, ...], sizes: Tuple[int, ...]) -> str:
    """TF's spelling of a chunk: ``""`` for the whole tensor, else ``"<shape> <start,len or ->:..."``."""
    extents = tuple((0, FULL) if (o, s) == (0, d) else (o, s) for o, s, d in zip(offsets, sizes, size))
    if all(length == FULL for _, length in extents):
        return ""
    return format_shape_and_slice(size, TensorSlice(extents))


class TFBundleWriter(StorageWriter):
    """Write DCP checkpoints as TensorFlow tensor bundles through shardckpt's save engine.

    ``path``: a checkpoint prefix, or a checkpoint directory where it exists or ends with
    ``/`` (``None``: given later as ``dcp.save(checkpoint_id=dir)``, always a directory).
    ``options``: :class:`~shardckpt.CheckpointOptions` (sharding callback, timeout,
    write callbacks; ``enable_async`` is refused: use ``dcp.async_save``).
    ``coordinator``: the ranks' coordinator for collective calls (default: one over the
    ranks of DCP's call, i.e. its ``process_group`` or the default group, made when DCP
    sets the writer up; a ``no_dist=True`` call is this process's alone whatever is given).
    ``fsync``: make data, index and state file durable at the commit.

    DCP's ``FileSystemWriter`` options, with their meaning here:

    * ``sync_files``: the same as ``fsync`` (given, it wins).
    * ``thread_count``: this rank's items are split into up to that many data files
      (balanced by bytes), written by as many threads; with ``options.sharding_callback``
      only 1 is accepted.
    * ``single_file_per_rank``: ``True`` (the default): one data file per rank (times
      ``thread_count``); ``False``: one data file per tensor key of the rank.
    * ``per_thread_copy_ahead``: accepted, no effect: shards on a GPU are copied to host
      one at a time through page-locked buffers as they are written.
    * ``cache_staged_state_dict``: ``dcp.async_save`` keeps the staged copy's host
      buffers for the next save (``True``, the default here, unlike DCP's ``False``), or
      stages into buffers dropped after the save (``False``).
    * ``overwrite``: ``False`` refuses a save where a checkpoint already is
      (:class:`~shardckpt.errors.AlreadyExistsError`, nothing written).

    DCP's ``use_collectives=False`` on several ranks is refused: each rank would write
    its items alone as the whole checkpoint.
    """

    _synchronize_after_execute: bool = True  # DCP's AsyncStager protocol: staging is synchronous

    def __init__(self, path: Any = None, *, options: Optional[CheckpointOptions] = None,
                 coordinator: Optional[Coordinator] = None, fsync: bool = True,
                 sync_files: Optional[bool] = None, thread_count: int = 1, single_file_per_rank: bool = True,
                 per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = True,
                 overwrite: bool = True) -> None:
        super().__init__()
        self._target: Optional[Tuple[str, Optional[str]]] = (
            None if path is None else writer_target(path, directory=False))
        options = options or CheckpointOptions()
        if options.enable_async:
            raise InvalidArgumentError("TFBundleWriter writes synchronously inside DCP; for a background save "
                                       "use torch.distributed.checkpoint.async_save")
        if int(per_thread_copy_ahead) < 0:
            raise InvalidArgumentError(f"per_thread_copy_ahead must be >= 0, got {per_thread_copy_ahead}")
        self._sharding = writer_sharding(options.sharding_callback, int(thread_count), bool(single_file_per_rank))
        self._threads = max(1, int(thread_count))
        self._options = options
        self._fsync = fsync if sync_files is None else bool(sync_files)
        self._cache = bool(cache_staged_state_dict)
        self._overwrite = bool(overwrite)
        self._explicit = coordinator
        self._run: Optional[Coordinator] = None  # the coordinator of the save DCP set up
        self._background: Optional[Coordinator] = None  # made by stage() for the background save
        self._ticket: Optional[int] = None  # the staging of the next write_data (dcp.async_save)
        self._rank = 0
        self._is_coordinator = True
        self._nesting: Dict[str, Any] = {}
        self._stager = default_stager()

    @property
    def checkpoint_prefix(self) -> Optional[str]:
        """The prefix the next save writes (``None`` until a path or ``checkpoint_id`` is known)."""
        return None if self._target is None else self._target[0]

    # -- StorageWriter ------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save begins; ``checkpoint_id`` (when given) is its directory."""
        if checkpoint_id is not None:
            self._target = writer_target(checkpoint_id, directory=True)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn the call's ranks and pick their coordinator (see the module docstring)."""
        call = current_call()
        background, self._background = self._background, None
        self._is_coordinator = bool(is_coordinator)
        self._nesting = {}
        if call.distributed and call.size() > 1 and not bool(kwargs.get("use_collectives", True)):
            raise UnsupportedError("use_collectives=False: every rank would write its own items as the whole "
                                   "checkpoint; save collectively, or give each rank its own checkpoint_id with "
                                   "no_dist=True", path=self.checkpoint_prefix)
        if not call.distributed or call.size() == 1:
            self._run = SingleProcessCoordinator()
        elif background is not None:
            self._run = background
        else:
            self._run = self._explicit if self._explicit is not None else coordinator_for(call)
        self._rank = self._run.rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse, naming the key, any tensor whose dtype has no TensorFlow dtype; with
        ``overwrite=False``, refuse to save where a checkpoint is."""
        prefix = self._prefix()
        for item in plan.items:
            if item.tensor_data is not None:
                to_bundle_dtype(item.tensor_data.properties.dtype, item.index.fqn, prefix)
        if not self._overwrite and get_fs(prefix).exists(index_filename(prefix)):
            raise AlreadyExistsError("Checkpoint already exists here and overwrite=False", path=prefix)
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """Keep the plans' ``planner_data`` (DCP's flattened key -> its path in the nested state dict),
        which the coordinator stores for loads without a target; the plans are returned as they are."""
        nesting: Dict[str, Any] = {}
        for plan in plans:
            if isinstance(plan.planner_data, dict):
                nesting.update(plan.planner_data)
        self._nesting = nesting
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """Convert the items, agree that every rank could, run the save engine (which commits)."""
        ticket, self._ticket = self._ticket, None
        try:
            return self._write(plan, planner)
        finally:
            if ticket is not None:
                self._stager.release(ticket)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Nothing left to do: the checkpoint was committed by ``write_data``; DCP's Metadata is not stored."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Any path-like (local or ``scheme://``) will do."""
        try:
            return bool(os.fspath(checkpoint_id))
        except TypeError:
            return False

    # -- AsyncStager (dcp.async_save) --------------------------------------------------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        """Staging finishes inside :meth:`stage`."""
        return self._synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        """Copy ``state_dict`` into host buffers and, for a collective save in this process, make the
        background clone of the call's coordinator; runs on the caller's thread, before the background save."""
        call = current_call()
        self._background = None
        if call.distributed and not call.process and call.size() > 1:
            coordinator = self._explicit if self._explicit is not None else coordinator_for(call)
            self._background = default_context().background(coordinator)  # collective the first time
        staged, self._ticket = self._stager.stage(state_dict, shared=call.process, keep=self._cache)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Nothing to close (the staging buffers belong to the process's stager and are reused)."""

    # -- pickling (dcp.async_save with the PROCESS checkpointer sends the writer to its checkpoint process) --
    def __getstate__(self) -> Dict[str, Any]:
        """Everything but the coordinators and the stager, which belong to this process.

        The checkpoint process makes its own coordinator over its world (DCP initializes a
        gloo default group there, one process per rank) when DCP sets the writer up. A
        coordinator given to the constructor other than a one-process one or one over the
        whole world cannot go along: that is an error naming the thread checkpointer.
        """
        state = dict(self.__dict__)
        coordinator = self._explicit
        if coordinator is not None and coordinator.size > 1:
            if not (coordinator.backend == "torch" and dist.is_initialized()
                    and coordinator.size == dist.get_world_size()):
                raise InvalidArgumentError(
                    f"a TFBundleWriter with a {coordinator.backend} coordinator of {coordinator.size} ranks cannot "
                    "be sent to another process; use dcp.async_save with the THREAD checkpointer, or give no "
                    "coordinator", path=self.checkpoint_prefix)
        state["_explicit"] = None if coordinator is None or coordinator.size > 1 else coordinator
        state["_run"] = None
        state["_background"] = None
        state["_ticket"] = None  # the staging's buffers are this process's; the copy arrives with the request
        del state["_stager"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stager = default_stager()

    # -- the write ---------------------------------------------------------------------------------------
    def _prefix(self) -> str:
        if self._target is None:
            raise InvalidArgumentError("TFBundleWriter has no path: give one to the constructor or as "
                                       "dcp.save(checkpoint_id=...)")
        return self._target[0]

    def _write(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        prefix = self._prefix()
        folder = self._target[1] if self._target is not None else None
        coordinator = self._run if self._run is not None else SingleProcessCoordinator()
        problem: Optional[Exception] = None
        tensors: List[ShardableTensor] = []
        results: List[WriteResult] = []
        try:
            tensors, results = self._convert(plan, planner)
            if self._is_coordinator:  # DCP's coordinator: the nesting of the whole state dict, once
                tensors.append(ShardableTensor.from_value(NESTING_KEY, np.array(encode_nesting(self._nesting),
                                                                                dtype=object),
                                                          device=_device(self._rank)))
        except Exception as exc:  # every rank must learn of it before anyone writes a byte
            problem = exc
        if coordinator.size > 1:
            try:
                coordinator.agree(problem is None, "" if problem is None else f"{type(problem).__name__}: {problem}",
                                  timeout=self._options.timeout)
            except CoordinationError as agreed:
                if problem is not None:
                    raise problem from agreed
                raise
        elif problem is not None:
            raise problem
        options = self._options if self._sharding is None else self._options.replace(sharding_callback=self._sharding)
        fsync = self._fsync

        def state_file(committed: str) -> None:
            if folder is not None:
                write_state_file(folder, committed, fsync=fsync)

        request = SaveRequest(Location.of(prefix), options, fsync=fsync, io_rank=0, timeout=self._options.timeout,
                              max_workers=self._threads if self._threads > 1 else None,
                              on_commit=state_file if folder is not None else None)
        engine_save(tensors, request, coordinator)
        done: "Future[List[WriteResult]]" = Future()
        done.set_result(results)
        return done

    def _convert(self, plan: SavePlan, planner: SavePlanner) -> Tuple[List[ShardableTensor], List[WriteResult]]:
        tensors: List[ShardableTensor] = []
        results: List[WriteResult] = []
        device = _device(self._rank)
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = encode_object(self._lookup(planner, item), fqn)
                tensors.append(ShardableTensor.from_value(fqn, np.array(data, dtype=object), device=device))
                results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=None))
                continue
            st = self._tensor(item, planner, device)
            if st is not None:
                tensors.append(st)
            td = item.tensor_data
            assert td is not None
            nbytes = int(np.prod(td.chunk.sizes, dtype=np.int64)) * td.properties.dtype.itemsize
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        return tensors, results

    def _tensor(self, item: WriteItem, planner: SavePlanner, device: str) -> Optional[ShardableTensor]:
        td = item.tensor_data
        assert td is not None
        fqn = item.index.fqn
        dtype = to_bundle_dtype(td.properties.dtype, fqn, self.checkpoint_prefix)
        size = tuple(int(d) for d in td.size)
        offsets = tuple(int(d) for d in td.chunk.offsets)
        sizes = tuple(int(d) for d in td.chunk.sizes)
        volume = int(np.prod(sizes, dtype=np.int64))
        if volume == 0 and (int(np.prod(size, dtype=np.int64)) > 0 or any(offsets)):
            return None  # an empty chunk of a tensor (uneven sharding): nothing to store
        spec = _slice_spec(size, offsets, sizes)
        tensor = planner.resolve_data(item)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"the planner resolved a tensor item to {type(tensor).__name__}",
                                       path=self.checkpoint_prefix, key=fqn)
        if tuple(tensor.shape) != sizes:
            raise InvalidArgumentError(f"the planner resolved a chunk of shape {list(tensor.shape)}, the plan "
                                       f"says {list(sizes)}", path=self.checkpoint_prefix, key=fqn)
        if tensor.device.type == "cpu":
            value: Any = numpy_view(tensor, dtype)  # the tensor's own memory
        elif tensor.device.type == "cuda":  # on the caller's stream, after the work queued there
            caller = torch.cuda.current_stream(tensor.device)

            def value(t: torch.Tensor = tensor, stream: Any = caller) -> np.ndarray:
                return numpy_view(pinned_copy(t, stream), dtype)
        else:
            def value(t: torch.Tensor = tensor) -> np.ndarray:  # copied to host when its shard is written
                return numpy_view(t.detach().to("cpu"), dtype)
        return ShardableTensor(checkpoint_key=fqn, tensor=value, dtype=dtype, shape=sizes, slice_spec=spec,
                               device=device, name=fqn)

    def _lookup(self, planner: SavePlanner, item: WriteItem) -> Any:
        """The non-tensor value itself: through the default planner's lookup, else from DCP's in-memory bytes."""
        lookup = getattr(planner, "lookup_object", None)
        if callable(lookup):
            return lookup(item.index)
        data = planner.resolve_data(item)  # a custom planner: torch.save bytes, in memory only
        data.seek(0)  # type: ignore[union-attr]
        return torch.load(data, weights_only=True)  # type: ignore[arg-type]


