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
per group and keeps it (its own gloo group over the same ranks, made collectively over
those ranks only: a subgroup's coordinator is made with ``use_local_synchronization``,
so ranks outside it take no part). A call that is not distributed gets a
:class:`~shardckpt.distributed.single.SingleProcessCoordinator`: nothing collective
happens. Without a DCP frame (a caller driving the StorageWriter protocol itself) the
call is taken as collective over the default group when ``torch.distributed`` is
initialized with several ranks.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from ..distributed import get_coordinator
from ..distributed.coordinator import Coordinator
from ..distributed.single import SingleProcessCoordinator

__all__ = ["DcpCall", "current_call", "coordinator_for"]

_MODULE = "torch.distributed.checkpoint"
_FUNCTIONS = ("_save_state_dict", "_load_state_dict", "async_save")


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


_LOCK = threading.Lock()
_COORDINATORS: Dict[Tuple[int, str], Tuple[Any, Coordinator]] = {}


def _key(group: Any) -> Tuple[Tuple[int, str], Any]:
    """A cache key of ``group`` in the current default group (a re-initialized world gets new ones)."""
    default = dist.distributed_c10d._get_default_group()
    if group is None or group is default or group is dist.group.WORLD:
        return (id(default), ""), default
    return (id(default), dist.distributed_c10d._get_process_group_name(group)), default


def coordinator_for(call: DcpCall) -> Coordinator:
    """The coordinator over the call's ranks (made the first time, collectively over them; then kept)."""
    if not call.distributed or call.size() == 1:
        return SingleProcessCoordinator()
    key, default = _key(call.group)
    with _LOCK:
        known = _COORDINATORS.get(key)
        if known is not None:
            return known[1]
        from ..distributed.torch_backend import TorchCoordinator

        coordinator: Optional[Coordinator] = None
        if key[1] == "":
            current = get_coordinator() if _process_coordinator_is_torch() else None
            if current is not None and current.size == dist.get_world_size():
                coordinator = current  # the process's own torch coordinator over the world
            else:
                coordinator = TorchCoordinator()
        else:
            coordinator = TorchCoordinator(group=call.group)
        _COORDINATORS[key] = (default, coordinator)  # the default group is held: its id stays unique
        return coordinator


def _process_coordinator_is_torch() -> bool:
    from ..distributed import select

    current = getattr(select, "_CURRENT", None)
    return current is not None and current.backend == "torch"
