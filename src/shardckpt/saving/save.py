"""``save_tensors``: the function-level front door of a single-process save.

::

    save_tensors("/ckpt/model-3", {"w": w, "b": b}, CheckpointOptions(
        sharding_callback=MaxShardSizePolicy(1 << 30)))

It runs the one save path (:mod:`shardckpt.saving.engine`) over a
:class:`~shardckpt.distributed.single.SingleProcessCoordinator`; see
:mod:`shardckpt.saving.commit` for what is on disk at every moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from ..distributed.single import SingleProcessCoordinator
from ..storage.location import Location
from .commit.base import BundleMaker
from .engine import save
from .options import CheckpointOptions
from .plan import TensorsToSave
from .request import SaveRequest

if TYPE_CHECKING:
    from .async_save import AsyncSaver

__all__ = ["save_tensors"]


def save_tensors(prefix: str, tensors: TensorsToSave, options: Optional[CheckpointOptions] = None, *,
                 fsync: bool = True, max_workers: Optional[int] = None,
                 extra_bundles: Optional[BundleMaker] = None,
                 on_commit: Optional[Callable[[str], None]] = None,
                 saver: Optional["AsyncSaver"] = None,
                 on_failure: Optional[Callable[[], None]] = None, previous: Optional[str] = None) -> str:
    """Save ``tensors`` as a (sharded) checkpoint at ``prefix``; return ``prefix``.

    ``tensors`` maps checkpoint keys to arrays (or :class:`~shardckpt.ShardableTensor`),
    or is a list of :class:`~shardckpt.ShardableTensor`. The sharding callback of
    ``options`` (default: one shard per task) decides the shards; they are
    written in parallel by ``max_workers`` threads, fsynced (unless ``fsync=False``),
    merged and committed atomically; then ``on_commit`` (a front door's own step,
    such as updating the ``checkpoint`` state file) and ``options.write_callbacks`` run.

    ``extra_bundles``, when given, is called with a scratch folder first and returns
    prefixes of bundles it wrote there (registered savers); they are merged into the
    checkpoint, inside the same commit.

    With ``options.enable_async`` the values are copied to host buffers and the call
    returns; everything else happens on ``saver``'s background thread (see
    :mod:`shardckpt.saving.async_save`); ``on_failure`` runs when its error is raised.

    With ``options.incremental`` values unchanged since ``previous`` (default: the
    checkpoint at ``prefix`` itself, if any) are not written again: their data files are
    linked or copied (see :mod:`shardckpt.saving.incremental`).
    """
    options = options or CheckpointOptions()
    request = SaveRequest(Location.of(prefix), options, fsync=fsync, max_workers=max_workers,
                          timeout=options.timeout, extra_bundles=extra_bundles, on_commit=on_commit,
                          on_failure=on_failure, previous=previous)
    return save(tensors, request, SingleProcessCoordinator(), saver)
