"""``TFBundleWriter``: a ``torch.distributed.checkpoint`` StorageWriter that writes a tensor bundle.

::

    dcp.save(state_dict, storage_writer=TFBundleWriter("/ckpt/step-100"))

``path`` is a checkpoint *prefix*, as in TensorFlow: the files are
``/ckpt/step-100.index`` and ``/ckpt/step-100.data-NNNNN-of-NNNNN``; ``s3://``
prefixes work like local ones (the index-last committer).

DCP's call sequence, and what each step does here::

    set_up_storage_writer  all   pick the coordinator (one process: trivial; else a
                                 torch coordinator made in the constructor, i.e. in
                                 the caller's thread, with its own gloo group)
    prepare_local_plan     all   every tensor item's dtype is checked (an error names the key)
    prepare_global_plan    coord one plan in a multi-rank job (no_dist): write alone
    write_data             all   items -> ShardableTensors (a chunk of a tensor is a slice
                                 entry of its global key in TF's slice spelling; a whole
                                 tensor a plain entry; a non-tensor a JSON string scalar,
                                 see _objects); every rank agrees that all converted
                                 before any byte is written; then the ONE save engine
                                 (saving.engine.save): plan -> write -> agree -> commit
    finish                 coord nothing: the engine committed (the index write) inside
                                 write_data, and DCP's pickled Metadata is not written

On disk at every moment: what the engine's committer promises (rename-commit
locally: shards under ``<prefix>_temp_<id>/`` until the index rename; index-last on
object stores). A save that dies anywhere leaves the previous checkpoint at the
prefix readable and untouched. No ``.metadata`` pickle, no pickle at all: the reader
rebuilds DCP's ``Metadata`` from the index.

CPU tensors are written from their own memory (NumPy views, no copy); tensors on
other devices are copied to host when their shard is written: a CUDA tensor into a
page-locked buffer of torch's pinned-memory cache (:func:`._staging.pinned_copy`, one
shard at a time, the buffers reused by the next shards and saves), others with
``.to("cpu")``. For
``dcp.async_save`` the writer is also DCP's ``AsyncStager``: ``stage`` copies the
state dict into reusable (pinned, for CUDA) host buffers (:mod:`._staging`), and the
background write runs on a clone of the coordinator made during ``stage``. With the
PROCESS checkpointer DCP pickles the writer (in memory) to its checkpoint process:
the coordinators and the stager stay behind (``__getstate__``), and the checkpoint
process makes its own world coordinator in ``write_data`` (its torch.distributed world
is the gloo default group DCP initialized there, the same ranks). The staged copy
is made in shared memory, so it travels by file descriptor without another copy; this
process cannot tell when the checkpoint process is done with it, so with that
checkpointer each staging gets new buffers (the old ones are freed with DCP's request)
instead of reusing them.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..distributed import get_coordinator
from ..distributed.coordinator import CoordinationError, Coordinator
from ..distributed.single import SingleProcessCoordinator
from ..errors import InvalidArgumentError
from ..format.tensor_slice import FULL, TensorSlice, format_shape_and_slice
from ..saving.context import default_context
from ..saving.engine import save as engine_save
from ..saving.options import CheckpointOptions
from ..saving.request import SaveRequest
from ..sharding.shardable import ShardableTensor
from ..storage.location import Location
from ._dtypes import numpy_view, to_bundle_dtype
from ._objects import encode_object
from ._staging import default_stager, pinned_copy

__all__ = ["TFBundleWriter"]

_LOCK = threading.Lock()
_OWN: List[Coordinator] = []  # the torch coordinator made here when the process has none of the world


def _world_coordinator() -> Coordinator:
    """A coordinator over every rank of the initialized default group (made once per process)."""
    current = get_coordinator()
    if current.backend == "torch" and current.size == dist.get_world_size():
        return current
    with _LOCK:
        if not _OWN:
            from ..distributed.torch_backend import TorchCoordinator

            _OWN.append(TorchCoordinator())
        return _OWN[0]


def _world_size() -> int:
    """The initialized torch.distributed world's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _world_coordinator_or_none() -> Optional[Coordinator]:
    """The world's coordinator when this process is one of several initialized ranks, else ``None``."""
    return _world_coordinator() if _world_size() > 1 else None


def _async_save_mode() -> Tuple[bool, bool]:
    """``(no_dist, process)`` of the ``dcp.async_save`` call that is staging (``(False, False)`` if none found).

    DCP does not tell a stager how the save will run, and both matter before the
    save starts: a ``no_dist`` save on one rank must not make the collective clone
    of the coordinator, and a save in DCP's checkpoint process has no use for it. The
    arguments are read from ``async_save``'s frame on the stack (its parameter
    names, public API); without such a frame the save is taken as collective.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "async_save" and str(frame.f_globals.get("__name__", "")).startswith(
                "torch.distributed.checkpoint"):
            kind = frame.f_locals.get("async_checkpointer_type")
            return bool(frame.f_locals.get("no_dist", False)), getattr(kind, "name", "") == "PROCESS"
        frame = frame.f_back  # type: ignore[assignment]
    return False, False


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

    ``path``: the checkpoint prefix (``None``: given later as ``dcp.save(checkpoint_id=...)``).
    ``options``: :class:`~shardckpt.CheckpointOptions` (sharding callback, timeout,
    write callbacks; ``enable_async`` is refused: use ``dcp.async_save``).
    ``coordinator``: the ranks' coordinator (default: one process -> trivial; an
    initialized ``torch.distributed`` -> a torch coordinator over the world, made
    here, so every rank must construct the writer, as every rank calls ``dcp.save``;
    ``dcp.save(..., no_dist=True)`` on some ranks of such a job is detected and written
    by each process alone, see :meth:`prepare_global_plan`).
    ``fsync``: make data and index durable at the commit.
    """

    _synchronize_after_execute: bool = True  # DCP's AsyncStager protocol: staging is synchronous

    def __init__(self, path: Any = None, *, options: Optional[CheckpointOptions] = None,
                 coordinator: Optional[Coordinator] = None, fsync: bool = True) -> None:
        super().__init__()
        self._path: Optional[str] = None if path is None else os.fspath(path)
        options = options or CheckpointOptions()
        if options.enable_async:
            raise InvalidArgumentError("TFBundleWriter writes synchronously inside DCP; for a background save "
                                       "use torch.distributed.checkpoint.async_save")
        self._options = options
        self._fsync = fsync
        self._world = coordinator is None  # the coordinator is (re)made from the process's own world
        if coordinator is None:
            coordinator = _world_coordinator_or_none()
        self._coordinator = coordinator
        self._background: Optional[Coordinator] = None
        self._ticket: Optional[int] = None  # the staging of the next write_data (dcp.async_save)
        self._rank = 0
        self._collective = coordinator is not None and coordinator.size > 1
        self._stager = default_stager()

    # -- StorageWriter ------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save begins; ``checkpoint_id`` (when given) is its prefix."""
        if checkpoint_id is not None:
            self._path = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn this rank and whether DCP runs collectively (``no_dist`` / ``use_collectives=False``: one process)."""
        rank = int(kwargs.get("rank", 0))
        use_collectives = bool(kwargs.get("use_collectives", True))
        if self._coordinator is None and self._world and _world_size() > 1:
            # unpickled in DCP's checkpoint process: its world's coordinator is made by _write, once
            # prepare_global_plan has told whether the other ranks take part (making it is collective)
            self._collective = use_collectives and rank == dist.get_rank()
            self._rank = rank if self._collective else 0
            return
        coordinator = self._coordinator
        self._collective = (coordinator is not None and coordinator.size > 1 and use_collectives
                            and rank == coordinator.rank)
        self._rank = rank if self._collective else 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse, naming the key, any tensor whose dtype has no TensorFlow dtype."""
        for item in plan.items:
            if item.tensor_data is not None:
                to_bundle_dtype(item.tensor_data.properties.dtype, item.index.fqn, self._path)
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """One plan in a multi-rank job: DCP saves without the other ranks (``no_dist``) -> write alone.

        DCP calls this on its coordinator only, with every participant's plan: a
        collective save brings the world's plans, ``no_dist=True`` (every process its own
        coordinator) or a one-rank ``process_group`` brings one. The engine numbers the
        shards itself, so the plans are returned as they are.
        """
        if len(plans) == 1 and self._collective:
            self._collective = False
            self._rank = 0
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """Convert the items, agree that every rank could, run the save engine (which commits)."""
        ticket, self._ticket = self._ticket, None
        try:
            return self._write(plan, planner, ticket is not None)
        finally:
            if ticket is not None:
                self._stager.release(ticket)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Nothing left to do: the checkpoint was committed by ``write_data``; DCP's Metadata is not stored."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Any path-like prefix (local or ``scheme://``) will do."""
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
        """Copy ``state_dict`` into reusable host buffers; runs on the caller's thread, before the background save."""
        alone, in_process = _async_save_mode()
        coordinator = self._coordinator
        if not alone and not in_process and coordinator is not None and coordinator.size > 1:
            self._background = default_context().background(coordinator)  # collective the first time
        staged, self._ticket = self._stager.stage(state_dict, shared=in_process)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Nothing to close (the staging buffers belong to the process's stager and are reused)."""

    # -- pickling (dcp.async_save with the PROCESS checkpointer sends the writer to its checkpoint process) --
    def __getstate__(self) -> Dict[str, Any]:
        """Everything but the coordinators and the stager, which belong to this process.

        The checkpoint process remakes the coordinator from its own torch.distributed
        world (DCP initializes a gloo default group there, one process per rank) the first
        time DCP sets the writer up. A coordinator given to the constructor other than a
        one-process one cannot go along: that is an error naming the thread checkpointer.
        """
        state = dict(self.__dict__)
        coordinator = self._coordinator
        if coordinator is not None and coordinator.size > 1:
            if not (self._world or (coordinator.backend == "torch" and dist.is_initialized()
                                    and coordinator.size == dist.get_world_size())):
                raise InvalidArgumentError(
                    f"a TFBundleWriter with a {coordinator.backend} coordinator of {coordinator.size} ranks cannot "
                    "be sent to another process; use dcp.async_save with the THREAD checkpointer, or give no "
                    "coordinator", path=self._path)
            state["_world"] = True
            state["_coordinator"] = None
        state["_background"] = None
        state["_ticket"] = None  # the staging's buffers are this process's; the copy arrives with the request
        del state["_stager"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stager = default_stager()

    # -- the write ---------------------------------------------------------------------------------------
    def _write(self, plan: SavePlan, planner: SavePlanner, staged: bool) -> "Future[List[WriteResult]]":
        if self._path is None:
            raise InvalidArgumentError("TFBundleWriter has no path: give one to the constructor or as "
                                       "dcp.save(checkpoint_id=...)")
        coordinator: Coordinator = SingleProcessCoordinator()
        if self._collective:
            if self._coordinator is None:  # in DCP's checkpoint process, every rank's is here now
                self._coordinator = _world_coordinator()
            coordinator = self._background if staged and self._background is not None else self._coordinator
        problem: Optional[Exception] = None
        tensors: List[ShardableTensor] = []
        results: List[WriteResult] = []
        try:
            tensors, results = self._convert(plan, planner)
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
        request = SaveRequest(Location.of(self._path), self._options, fsync=self._fsync, io_rank=0,
                              timeout=self._options.timeout)
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
        dtype = to_bundle_dtype(td.properties.dtype, fqn, self._path)
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
                                       path=self._path, key=fqn)
        if tuple(tensor.shape) != sizes:
            raise InvalidArgumentError(f"the planner resolved a chunk of shape {list(tensor.shape)}, the plan "
                                       f"says {list(sizes)}", path=self._path, key=fqn)
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


