"""``SaveRequest``: everything one save needs to know, as one frozen object.

Front doors (``save_tensors``, ``Checkpoint``, ``DTensorCheckpoint``, ``sharded_save``)
build it once; the engine and the committers read it and never receive loose
arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from ..storage.location import Location
from .commit.base import BundleMaker
from .options import CheckpointOptions

__all__ = ["SaveRequest", "SharedCommitStep", "default_workers"]


def default_workers(num_shards: int) -> int:
    """Threads writing shards in parallel: one per shard, at most two per core."""
    return max(1, min(num_shards, 2 * (os.cpu_count() or 1)))


class SharedCommitStep:
    """An ``on_commit`` whose result every client learns: the io client runs ``record(prefix)``
    right after the commit; its result (JSON: dicts, lists, strings, numbers, ``None``) travels
    with the commit's outcome, and every client (the io client too) then runs
    ``adopt(prefix, result)``, on the save's own thread (an asynchronous save's background
    thread), before the write callbacks. A failed ``record`` fails the save everywhere and
    nobody adopts anything.
    """

    def __init__(self, record: Callable[[str], Any], adopt: Callable[[str, Any], None]) -> None:
        self.record = record
        self.adopt = adopt

    def __call__(self, prefix: str) -> Any:
        return self.record(prefix)


@dataclass(frozen=True)
class SaveRequest:
    """One save: where, with which options, and the front door's hooks.

    Attributes:
      location: the checkpoint's store and prefix.
      options: the user's :class:`~shardckpt.CheckpointOptions`.
      fsync: make data, names and index durable before and at the commit.
      max_workers: threads writing this client's shards (``None``: :func:`default_workers`).
      io_rank: the client that prepares, merges, commits and runs ``on_commit``.
      funnel: every client sends its values to ``io_rank``, which alone writes.
      timeout: seconds each collective may wait (``None``: the coordinator's).
      extra_bundles: registered savers' step, run by the io client before the shards.
      on_commit: the front door's step right after the commit (e.g. the state file),
        on the io client; its failure is the save's failure. A :class:`SharedCommitStep`
        also tells every client its result.
      on_failure: run when an asynchronous save's error is raised to the caller.
      previous: with ``options.incremental``, the checkpoint whose unchanged data files
        may be reused (``None``: the checkpoint at ``location`` itself, if any).
      held: every variable this client holds, written by it or not
        (:func:`~shardckpt.saving.agreement.describe_held`); clients whose lists differ fail
        the save (``None``: the front door lists nothing, only the pieces are compared).
    """

    location: Location
    options: CheckpointOptions
    fsync: bool = True
    max_workers: Optional[int] = None
    io_rank: int = 0
    funnel: bool = False
    timeout: Optional[float] = None
    extra_bundles: Optional[BundleMaker] = None
    on_commit: Optional[Callable[[str], None]] = None
    on_failure: Optional[Callable[[], None]] = None
    previous: Optional[str] = None
    held: Optional[Sequence[List[Any]]] = None

    @property
    def prefix(self) -> str:
        """The checkpoint's prefix."""
        return self.location.prefix
