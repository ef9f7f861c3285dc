"""Staging for ``dcp.async_save``: copy a state dict into host buffers kept across saves.

``async_save`` calls the writer's ``stage(state_dict)`` on the training thread and
then writes the returned copy on a background thread, so training may change the
originals right after ``stage`` returns. :class:`HostStager` copies every tensor
(the local shard of a DTensor, rewrapped with the same mesh and placements) into a
host buffer it keeps for the next save: same structure, shapes and dtypes -> the
same buffers, so the steady state allocates nothing. Buffers of CUDA tensors are
pinned and filled with non-blocking copies, then one synchronize; CPU tensors get
plain buffers. Non-tensor values are deep-copied.

Writers share the process's :func:`default_stager` (a writer is usually made per
save, its buffers should outlive it). A save still writing the previous copy owns its buffers: ``stage`` then makes new
ones (it never waits, never overwrites bytes a writer may still read). ``stage``
returns a ticket; the writer calls :meth:`release` with it once its save finished,
successfully or not.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["HostStager", "default_stager", "release_staging_buffers"]

_Slot = Tuple[Any, ...]


class HostStager:
    """Reusable host buffers for staged copies of state dicts (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: Dict[_Slot, torch.Tensor] = {}
        self._owner: Optional[int] = None  # the staging whose save still reads the buffers
        self._count = 0

    def stage(self, state_dict: Any) -> Tuple[Any, int]:
        """A copy of ``state_dict`` whose tensors live in this stager's host buffers, and its ticket."""
        with self._lock:
            if self._owner is not None:  # a save still writes the buffers' bytes: leave them to it
                self._buffers = {}
            self._count += 1
            ticket = self._owner = self._count
            buffers = self._buffers
        cuda = [False]
        staged = self._copy(state_dict, (), buffers, cuda)
        if cuda[0]:
            torch.cuda.synchronize()
        return staged, ticket

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

    def _buffer(self, slot: _Slot, like: torch.Tensor, buffers: Dict[_Slot, torch.Tensor]) -> torch.Tensor:
        key = slot + (tuple(like.shape), like.dtype, like.device.type)
        buf = buffers.get(key)
        if buf is None:
            buf = torch.empty(tuple(like.shape), dtype=like.dtype, device="cpu",
                              pin_memory=like.device.type == "cuda")
            buffers[key] = buf
        return buf

    def _copy(self, value: Any, path: _Slot, buffers: Dict[_Slot, torch.Tensor], cuda: list) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            local = value.to_local()
            buf = self._buffer(path, local, buffers)
            buf.copy_(local.detach(), non_blocking=local.device.type == "cuda")
            cuda[0] |= local.device.type == "cuda"
            return DTensor.from_local(buf, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            buf = self._buffer(path, value, buffers)
            buf.copy_(value.detach(), non_blocking=value.device.type == "cuda")
            cuda[0] |= value.device.type == "cuda"
            return buf
        if isinstance(value, dict):
            return {k: self._copy(v, path + (k,), buffers, cuda) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, path + (i,), buffers, cuda) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(v, path + (i,), buffers, cuda) for i, v in enumerate(value))
        return copy.deepcopy(value)


_LOCK = threading.Lock()
_DEFAULT: "list[HostStager]" = []


def default_stager() -> HostStager:
    """The process's stager, shared by every writer (made once, under a lock)."""
    with _LOCK:
        if not _DEFAULT:
            _DEFAULT.append(HostStager())
        return _DEFAULT[0]


def release_staging_buffers() -> None:
    """Free the host buffers that ``dcp.async_save`` with :class:`~shardckpt.torch.TFBundleWriter` keeps
    for the next save (as much memory as the state dict's local tensors): e.g. before a large load,
    or when no more async saves follow. The next async save allocates them again."""
    default_stager().clear()
