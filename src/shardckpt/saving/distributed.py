"""``save_tensors_distributed``: the front door of a multi-client save over a coordinator.

Every client calls it with its own pieces; they all run the one save path
(:mod:`shardckpt.saving.engine`) together: the io client prepares and commits, every
client writes its own shards (or, with ``io_device`` naming a client, funnels its
values to that client, which alone touches storage).
"""

from __future__ import annotations

import re
from typing import Any, Callable, List, Optional, Sequence

from ..distributed.coordinator import Coordinator
from ..errors import InvalidArgumentError
from ..sharding.shardable import ShardableTensor
from ..storage.base import FileSystem
from ..storage.location import Location
from .async_save import AsyncSaver
from .engine import save
from .options import CheckpointOptions
from .request import SaveRequest

__all__ = ["save_tensors_distributed", "io_rank_of"]

_TASK = re.compile(r"/task:(\d+)")


def io_rank_of(options: CheckpointOptions, size: int, default: int = 0) -> int:
    """The rank that merges and commits: ``options.io_device`` (``"/task:K"`` or ``K``), else ``default``."""
    device = options.io_device
    if device is None:
        return default
    if isinstance(device, int) or (isinstance(device, str) and device.isdigit()):
        rank = int(device)
    else:
        m = _TASK.search(str(device))
        if m is None:
            raise InvalidArgumentError(f"io_device {device!r} names no task (expected '/job:...:/task:K/...')")
        rank = int(m.group(1))
    if not 0 <= rank < size:
        raise InvalidArgumentError(f"io_device {device!r} names task {rank}, but there are {size} clients")
    return rank


def save_tensors_distributed(prefix: str, local_tensors: List[ShardableTensor], options: CheckpointOptions,
                             coordinator: Coordinator, *, fsync: bool = True, max_workers: Optional[int] = None,
                             io_rank: Optional[int] = None, funnel: Optional[bool] = None,
                             on_commit: Optional[Callable[[str], None]] = None, timeout: Optional[float] = None,
                             saver: Optional[AsyncSaver] = None, on_failure: Optional[Callable[[], None]] = None,
                             fs: Optional[FileSystem] = None, previous: Optional[str] = None,
                             held: Optional[Sequence[List[Any]]] = None) -> str:
    """Collective save of every client's ``local_tensors`` into one checkpoint at ``prefix``.

    ``io_rank`` (default: from ``options.io_device``, else 0) prepares, commits and runs
    ``on_commit``; ``funnel`` (default: whether ``options.io_device`` is set and there
    are several clients) sends every value to it. ``timeout`` (default:
    ``options.timeout``, else the coordinator's) bounds each collective.

    With ``options.enable_async`` each client snapshots its values and returns; the
    collective write runs on ``saver``'s thread over a clone of ``coordinator`` (its
    own communicator), and every client learns there whether the save committed.

    ``previous``: with ``options.incremental``, the checkpoint whose unchanged data files
    may be reused (default: the one at ``prefix``, if any).

    ``held``: every variable this client holds, written by it or not
    (:func:`~shardckpt.saving.agreement.describe_held`): the save commits only when every
    client's list is the same (``None``: only the written pieces are compared).
    """
    size = coordinator.size
    request = SaveRequest(
        Location.of(prefix, fs), options, fsync=fsync, max_workers=max_workers,
        io_rank=io_rank_of(options, size) if io_rank is None else io_rank,
        funnel=(options.io_device is not None and size > 1) if funnel is None else funnel,
        timeout=timeout if timeout is not None else options.timeout,
        on_commit=on_commit, on_failure=on_failure, previous=previous, held=held)
    return save(local_tensors, request, coordinator, saver)
