"""The ``Committer``: how one storage kind turns written shards into a committed checkpoint.

The engine (:mod:`shardckpt.saving.engine`) runs the same steps for every save; a
committer, chosen once from the store (:func:`shardckpt.saving.commit.committer_for`),
says where each shard's bytes go and what makes the checkpoint visible. One
committer object serves one save on each client.

Call sequence of one save (``io``: the io client only; ``all``: every client)::

    c = committer_for(location, fsync=...)           all
    setup = c.prepare(extra_bundles)                  io    -> Setup, sent to all
    c.adopt(setup)                                    all   (the io client's decisions)
    num_shards = c.plan(total)                        all   total: shards of every client
    written = c.write_shard(shard, shard_id)          all   once per own shard, in parallel -> Written
    ...  barrier; every client reports success; ``written`` all-gathered in shard-id order
    c.commit(written_by_id)                           io    the commit point (nothing visible before)
    c.finish()                                        io    after a successful commit: clean up
    c.abort()                                         io    after any failure before ``commit`` returned

``prepare`` may run ``extra_bundles`` (registered savers): bundles the io client
writes before any shard; their data files take shard ids ``0..k-1`` and
``setup.first_shard_id == k``, so the clients' shards are numbered from ``k``.

``abort`` never removes what a committed index uses: a failure *after* the commit
point (a lost reply, a failing clean-up) leaves the new checkpoint readable.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ...storage.location import Location
from ..plan import ShardPlan
from ..rounds import fields_from_json, fields_to_json

__all__ = ["Committer", "BundleMaker", "Setup", "Written"]

#: Registered savers' step: called with a scratch folder, returns prefixes of bundles it wrote there.
BundleMaker = Callable[[str], List[str]]


@dataclass(frozen=True)
class Setup:
    """What the io client decided in ``prepare``, sent to every client with the save's first round
    (a JSON object of the fields that differ from their defaults)."""

    #: shard id of the clients' first shard (registered savers' data files come before)
    first_shard_id: int = 0
    #: rename-commit: the scratch folder the parts are written to
    temp: Optional[str] = None
    #: index-last: shard counts whose data objects exist (never overwritten)
    avoid: Tuple[int, ...] = ()
    #: index-last: whether an index was there, and its ETag (the commit replaces only that one)
    has_index: bool = False
    index_etag: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return fields_to_json(self)

    @classmethod
    def from_json(cls, obj: Any) -> "Setup":
        setup = fields_from_json(cls, obj)
        return dataclasses.replace(setup, avoid=tuple(int(n) for n in setup.avoid))


@dataclass(frozen=True)
class Written:
    """What writing one shard produced, all-gathered to the io client for the commit (a JSON object
    of the fields that differ from their defaults: a few bytes beside ``entries``)."""

    #: bytes written (0 for a data file reused whole)
    bytes: int = 0
    #: rename-commit: the part bundle's prefix
    part: Optional[str] = None
    #: index-last: the shard's index entries as they travel (``index_last.encode_pairs``), its ETag
    entries: Optional[str] = None
    etag: Optional[str] = None
    #: incremental saves: each piece's ``[key, slice spec, hash, token, head, sample]`` (the sidecar's)
    pieces: Optional[Sequence[Sequence[Any]]] = None
    #: incremental saves, a data file reused: its bytes, how ("link" or "copy"), from where, its record
    reused: int = 0
    how: str = "written"
    source: Optional[str] = None
    file: Optional[Mapping[str, Any]] = None
    #: a linked part (rename-commit): its index entries, as ``entries`` (no part index is written)
    index_entries: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return fields_to_json(self)

    @classmethod
    def from_json(cls, obj: Any) -> "Written":
        return fields_from_json(cls, obj)


class Committer(abc.ABC):
    """One save's commit protocol on one kind of store (see the module docstring for the call sequence)."""

    def __init__(self, location: Location, *, fsync: bool = True) -> None:
        self.location = location
        self.fsync = fsync
        self.setup = Setup()
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
        return self.setup.first_shard_id

    @abc.abstractmethod
    def plan(self, total: int) -> int:
        """[all] Fix the number of data files for ``total`` shards (same answer on every client)."""

    @abc.abstractmethod
    def write_shard(self, shard: ShardPlan, shard_id: int) -> Written:
        """[all] Write one shard's values as shard ``shard_id``; ``written.bytes`` is its size."""

    @abc.abstractmethod
    def commit(self, written: List[Written]) -> None:
        """[io client] Make the checkpoint visible: after this, readers see it whole."""

    @abc.abstractmethod
    def finish(self) -> None:
        """[io client] After the commit: remove the previous checkpoint's unused files and the scratch area."""

    @abc.abstractmethod
    def abort(self) -> None:
        """[io client] After a failure: remove what this save wrote, unless a committed index uses it."""
