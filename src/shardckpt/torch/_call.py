"""Which ranks take part in a DCP call, and the coordinator over them.

DCP 2.13 hands a storage layer only ``is_coordinator``, the rank *in* the call's group
and ``use_collectives``; the group itself (``dcp.save(process_group=...)``, the default
group, or none under ``no_dist=True``) stays in DCP's ``_DistWrapper``, which the
stock ``FileSystemWriter`` never needs: it does nothing collective of its own (DCP's
``reduce_scatter`` / ``all_reduce`` over that group carry its plans and results). The
save engine does coordinate, so the writer needs a coordinator over exactly the call's
ranks. :func:`current_call` reads them from DCP's frame on the stack:
``_save_state_dict`` / ``_load_state_dict`` (their local ``distW``, the group and
whether the call is distributed) or, while staging for ``dcp.async_save``, that
function's arguments (``process_group``, ``no_dist``, the checkpointer type).

:func:`coordinator_for` makes one :class:`~shardckpt.distributed.torch_backend.TorchCoordinator`
per group and keeps it in the process's :mod:`~shardckpt.runtime` (its own gloo group over
the same ranks, made collectively over those ranks only: a subgroup's coordinator is made
with ``use_local_synchronization``, so ranks outside it take no part). A call that is not
distributed gets a :class:`~shardckpt.distributed.single.SingleProcessCoordinator`: nothing
collective happens. Without a DCP frame (a caller driving the StorageWriter protocol itself) the
call is taken as collective over the default group when ``torch.distributed`` is
initialized with several ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..distributed.coordinator import Coordinator
from ..distributed.select import current_coordinator
from ..distributed.single import SingleProcessCoordinator
from ..runtime import runtime

__all__ = ["DcpCall", "current_call", "coordinator_for"]

_MODULE = "torch.distributed.checkpoint"
_FUNCTIONS = ("_save_state_dict", "_load_state_dict", "async_save")

#: The key of a torch group's coordinator in the runtime's keyed cache: ``(TORCH_GROUP, group name)``.
TORCH_GROUP = "torch group"


@dataclass(frozen=True)
class DcpCall:
    """The ranks of one DCP call: ``distributed`` (else this process alone), ``group`` (``None``: the
    default group), ``process`` (``async_save`` with the PROCESS checkpointer: the save runs elsewhere)."""

    distributed: bool
    group: Any = None
    process: bool = False

    def size(self) -> int:
        """How many ranks take part."""
        if not self.distributed:
            return 1
        return dist.get_world_size(self.group)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def current_call() -> DcpCall:
    """The innermost DCP call on this thread's stack (see the module docstring)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_name
        if name in _FUNCTIONS and str(frame.f_globals.get("__name__", "")).startswith(_MODULE):
            local = frame.f_locals
            if name == "async_save":
                kind = local.get("async_checkpointer_type")
                distributed = not local.get("no_dist", False) and _initialized()
                return DcpCall(distributed, local.get("process_group"), getattr(kind, "name", "") == "PROCESS")
            wrapper = local.get("distW")
            if wrapper is not None:
                return DcpCall(bool(wrapper.use_dist) and _initialized(), wrapper.group)
        frame = frame.f_back  # type: ignore[assignment]
    return DcpCall(_initialized() and dist.get_world_size() > 1)


def coordinator_for(call: DcpCall) -> Coordinator:
    """The coordinator over the call's ranks (made the first time, collectively over them; then kept).

    Kept in the process runtime's keyed cache under the group's name, anchored on the
    default group it belongs to (a re-initialized world gets new ones)."""
    if not call.distributed or call.size() == 1:
        return SingleProcessCoordinator()
    default = dist.distributed_c10d._get_default_group()
    group = call.group
    world = group is None or group is default or group is dist.group.WORLD
    name = "" if world else dist.distributed_c10d._get_process_group_name(group)

    def make() -> Coordinator:
        from ..distributed.torch_backend import TorchCoordinator

        if world:
            current = current_coordinator()
            if current is not None and current.backend == "torch" and current.size == dist.get_world_size():
                return current  # the process's own torch coordinator over the world
            return TorchCoordinator()
        return TorchCoordinator(group=group)

    return runtime().keep((TORCH_GROUP, name), make, anchor=default)
