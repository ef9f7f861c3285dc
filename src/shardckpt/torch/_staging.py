"""Staging for ``dcp.async_save``: copy a state dict into host buffers kept across saves.

``async_save`` calls the writer's ``stage(state_dict)`` on the training thread and
then writes the returned copy on a background thread, so training may change the
originals right after ``stage`` returns. :class:`HostStager` copies every tensor into a
host buffer it keeps for the next save: same structure, shapes and dtypes -> the same
buffers, so the steady state allocates nothing. A DTensor's local shard is copied and
rewrapped with the same spec (mesh, placements, global shape), its local part on the
host even where the mesh is on a GPU. Non-tensor values are deep-copied.

The buffer of a CUDA tensor is page-locked with ``cudaHostRegister``, exactly its size
(torch's pinned-memory cache would round it up to a power of two and keep the memory
after it is dropped), filled with a non-blocking copy; ``stage`` then waits on the
current stream of each device copied from. A buffer is unregistered when it is dropped
(before its memory is freed), so :func:`release_staging_buffers` returns the memory to
the system. Where registering fails, the copy runs to unpinned memory: slower, the same
bytes.

Writers share the process's :func:`default_stager` (a writer is usually made per
save, its buffers should outlive it; the process's :mod:`~shardckpt.runtime` keeps it).
A save still writing the previous copy owns its buffers: ``stage`` then makes new
ones (it never waits, never overwrites bytes a writer may still read). ``stage``
returns a ticket; the writer calls :meth:`release` with it once its save finished,
successfully or not.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

import torch

from ..runtime import Slot

__all__ = ["HostStager", "copy_on", "default_stager", "pinned_copy", "release_staging_buffers"]

_Slot = Tuple[Any, ...]


class HostStager:
    """Reusable host buffers for staged copies of state dicts (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: Dict[_Slot, torch.Tensor] = {}  # slot + (shape, dtype, device type) -> buffer
        self._owner: Optional[int] = None  # the staging whose save still reads the buffers
        self._count = 0

    def stage(self, state_dict: Any, *, shared: bool = False, keep: bool = True) -> Tuple[Any, int]:
        """A copy of ``state_dict`` whose tensors live in this stager's host buffers, and its ticket.

        ``shared``: the copy goes to another process (DCP's PROCESS checkpointer): new
        buffers in shared memory, never reused (this process cannot tell when they are read).
        ``keep=False``: new buffers that this stager does not keep (freed with the copy;
        the ticket then stands for nothing)."""
        if not keep:
            return _copy_all(state_dict, {}, shared), 0
        with self._lock:
            if self._owner is not None or shared:  # a save may still write the buffers' bytes: leave them to it
                self._buffers = {}
            self._count += 1
            ticket = self._owner = self._count
            buffers = self._buffers
        return _copy_all(state_dict, buffers, shared), ticket

    def release(self, ticket: int) -> None:
        """The save of staging ``ticket`` is over: if its buffers are the current ones, they may be refilled."""
        with self._lock:
            if self._owner == ticket:
                self._owner = None

    def clear(self) -> None:
        """Drop the kept buffers: the next ``stage`` allocates new ones. A save still writing a staged
        copy keeps those buffers alive until it ends (it holds them, not this stager)."""
        with self._lock:
            self._buffers = {}


def _copy_all(state_dict: Any, buffers: Dict[_Slot, torch.Tensor], shared: bool) -> Any:
    """The staged copy of ``state_dict`` (through ``buffers``), complete on return."""
    streams: Dict[torch.device, Any] = {}
    staged = _copy(state_dict, (), buffers, streams, shared)
    for stream in streams.values():
        stream.synchronize()
    return staged


def _new_buffer(like: torch.Tensor, *, shared: bool) -> torch.Tensor:
    """A host tensor shaped like ``like``; in shared memory when ``shared``; page-locked when ``like`` is on CUDA."""
    buf = torch.empty(tuple(like.shape), dtype=like.dtype, device="cpu")
    if shared:
        buf.share_memory_()
    nbytes = buf.numel() * buf.element_size()
    if like.device.type == "cuda" and nbytes:
        cudart = torch.cuda.cudart()
        address = buf.data_ptr()
        if int(cudart.cudaHostRegister(address, nbytes, 0)) == 0:  # else (a locked-memory limit): unpinned
            weakref.finalize(buf, cudart.cudaHostUnregister, address)  # before its memory can be freed
    return buf


def _copy(value: Any, path: _Slot, buffers: Dict[_Slot, torch.Tensor], streams: Dict[torch.device, Any],
          shared: bool) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, torch.Tensor):
        local = value.to_local() if isinstance(value, DTensor) else value
        key = path + (tuple(local.shape), local.dtype, local.device.type)
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = _new_buffer(local, shared=shared)
        on_cuda = local.device.type == "cuda"
        if on_cuda and local.device not in streams:
            streams[local.device] = torch.cuda.current_stream(local.device)
        buf.copy_(local.detach(), non_blocking=on_cuda)
        if isinstance(value, DTensor):  # the same spec (mesh, placements, global shape), its local part on the host
            return DTensor(buf, value._spec, requires_grad=False)  # (from_local would move it to the mesh's device)
        return buf
    if isinstance(value, dict):
        return {k: _copy(v, path + (k,), buffers, streams, shared) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v, path + (i,), buffers, streams, shared) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_copy(v, path + (i,), buffers, streams, shared) for i, v in enumerate(value))
    return copy.deepcopy(value)


def pinned_copy(tensor: torch.Tensor, stream: Any) -> torch.Tensor:
    """A host copy of CUDA ``tensor`` in a page-locked buffer of torch's pinned-memory cache, made on
    ``stream`` (after the work queued there) and complete on return.

    For one shard at a time (a synchronous save, a load's temporary): the cache hands the
    buffer to the next shard once this one is dropped, so a save allocates page-locked
    memory for the shards in flight only, once per process. A device-to-host copy into
    pageable memory runs at a small fraction of the bus's speed (1.9 GB/s against 53 GB/s
    on an H200 host, ``benchmarks/bench_torch_cuda.py``)."""
    host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
    copy_on(stream, host, tensor.detach())
    return host


def copy_on(stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` between host and GPU as a non-blocking copy on ``stream`` (after the work
    queued there), complete on return (so a page-locked end may go back to torch's cache)."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()


#: The process's stager (a slot of the process's runtime: new after a reset; a forked child makes its own and
#: leaves its parent's buffers alone).
_DEFAULT: "Slot[HostStager]" = Slot("the host stager of dcp.async_save", HostStager)


def default_stager() -> HostStager:
    """The process's stager, shared by every writer (made once, under the runtime's lock)."""
    return _DEFAULT.get()


def release_staging_buffers() -> None:
    """Free the host buffers that ``dcp.async_save`` with :class:`~shardckpt.torch.TFBundleWriter` keeps
    for the next save (as much memory as the state dict's local tensors; for CUDA tensors, page-locked):
    e.g. before a large load, or when no more async saves follow. The next async save allocates them again."""
    default_stager().clear()
