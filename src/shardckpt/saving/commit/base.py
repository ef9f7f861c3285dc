"""The ``Committer``: how one storage kind turns written shards into a committed checkpoint.

The engine (:mod:`shardckpt.saving.engine`) runs the same steps for every save; a
committer, chosen once from the store (:func:`shardckpt.saving.commit.committer_for`),
says where each shard's bytes go and what makes the checkpoint visible. One
committer object serves one save on each client.

Call sequence of one save (``io``: the io client only; ``all``: every client)::

    c = committer_for(location, fsync=...)           all
    setup = c.prepare(extra_bundles)                  io    -> JSON object, broadcast to all
    c.adopt(setup)                                    all   (the io client's decisions)
    num_shards = c.plan(total)                        all   total: shards of every client
    written = c.write_shard(shard, shard_id)          all   once per own shard, in parallel -> JSON object
    ...  barrier; every client reports success; ``written`` all-gathered in shard-id order
    c.commit(written_by_id)                           io    the commit point (nothing visible before)
    c.finish()                                        io    after a successful commit: clean up
    c.abort()                                         io    after any failure before ``commit`` returned

``prepare`` may run ``extra_bundles`` (registered savers): bundles the io client
writes before any shard; their data files take shard ids ``0..k-1`` and
``setup["first_shard_id"] == k``, so the clients' shards are numbered from ``k``.

``abort`` never removes what a committed index uses: a failure *after* the commit
point (a lost reply, a failing clean-up) leaves the new checkpoint readable.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Dict, List, Optional

from ...storage.location import Location
from ..plan import ShardPlan

__all__ = ["Committer", "BundleMaker", "Setup", "Written"]

#: Registered savers' step: called with a scratch folder, returns prefixes of bundles it wrote there.
BundleMaker = Callable[[str], List[str]]
#: What the io client decided in ``prepare`` (JSON: it is broadcast).
Setup = Dict[str, Any]
#: What writing one shard produced (JSON: it is all-gathered to the io client).
Written = Dict[str, Any]


class Committer(abc.ABC):
    """One save's commit protocol on one kind of store (see the module docstring for the call sequence)."""

    def __init__(self, location: Location, *, fsync: bool = True) -> None:
        self.location = location
        self.fsync = fsync
        self.setup: Setup = {}
        self.num_shards = -1

    @abc.abstractmethod
    def prepare(self, extra_bundles: Optional[BundleMaker] = None) -> Setup:
        """[io client] Clean what dead saves left, decide where shards go; write registered savers' bundles."""

    def adopt(self, setup: Setup) -> None:
        """[all] Take the io client's decisions."""
        self.setup = setup

    @property
    def first_shard_id(self) -> int:
        """Shard id of the clients' first shard (after the registered savers' data files)."""
        return int(self.setup.get("first_shard_id", 0))

    @abc.abstractmethod
    def plan(self, total: int) -> int:
        """[all] Fix the number of data files for ``total`` shards (same answer on every client)."""

    @abc.abstractmethod
    def write_shard(self, shard: ShardPlan, shard_id: int) -> Written:
        """[all] Write one shard's values as shard ``shard_id``; ``written["bytes"]`` is its size."""

    @abc.abstractmethod
    def commit(self, written: List[Written]) -> None:
        """[io client] Make the checkpoint visible: after this, readers see it whole."""

    @abc.abstractmethod
    def finish(self) -> None:
        """[io client] After the commit: remove the previous checkpoint's unused files and the scratch area."""

    @abc.abstractmethod
    def abort(self) -> None:
        """[io client] After a failure: remove what this save wrote, unless a committed index uses it."""
