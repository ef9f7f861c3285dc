"""Staging for ``dcp.async_save``: copy a state dict into host buffers kept across saves.

``async_save`` calls the writer's ``stage(state_dict)`` on the training thread and
then writes the returned copy on a background thread, so training may change the
originals right after ``stage`` returns. :class:`HostStager` copies every tensor
(the local shard of a DTensor, rewrapped with the same mesh and placements) into a
host buffer it keeps for the next save: same structure, shapes and dtypes -> the
same buffers, so the steady state allocates nothing. Buffers of CUDA tensors are
pinned and filled with non-blocking copies, then one synchronize; CPU tensors get
plain buffers. Non-tensor values are deep-copied.

A save still writing the previous copy owns its buffers: ``stage`` then makes new
ones (it never waits, never overwrites bytes a writer may still read). The writer
calls :meth:`release` once its save finished, successfully or not.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Dict, Tuple

import torch

__all__ = ["HostStager"]

_Slot = Tuple[Any, ...]


class HostStager:
    """Reusable host buffers for staged copies of state dicts (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: Dict[_Slot, torch.Tensor] = {}
        self._busy = False

    def stage(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` whose tensors live in this stager's host buffers."""
        with self._lock:
            if self._busy:  # the previous copy is still being written: leave its buffers alone
                self._buffers = {}
            self._busy = True
            buffers = self._buffers
        cuda = [False]
        staged = self._copy(state_dict, (), buffers, cuda)
        if cuda[0]:
            torch.cuda.synchronize()
        return staged

    def release(self) -> None:
        """The save of the last staged copy is over: its buffers may be refilled."""
        with self._lock:
            self._busy = False

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
