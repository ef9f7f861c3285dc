"""What the clients of a save send each other, round by round (:mod:`shardckpt.saving.engine`).

Each is a frozen dataclass with typed fields and its JSON form (the coordinator carries JSON,
never pickle); the committers' own messages, :class:`~.commit.base.Setup` and
:class:`~.commit.base.Written`, travel inside them::

    identity  all-gather  Hello        {"id": [prefix, number], "setup": Outcome[Setup] (io) or null,
                                        "shards": count or null}
    funnel    gather      Funnelled    [[{"key", "spec", "dtype", "shape"(, "strings")}, ...], ...]
    number    gather      Pieces       {"shards": count, "pieces": packed table, "held": digest or null}
              broadcast   Verdict      Outcome of {"problem"(, "counts")(, "held_from")}
              gather      HeldList     [[name, dtype, shape, layout, mesh], ...] or null (rarely)
              broadcast   Problem      Outcome of text or null
    agree     all-gather  Parts        Outcome of [Written, ...]
    commit    broadcast   Json         Outcome of a SharedCommitStep's result (else null)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .commit.base import Setup, Written
from .rounds import Outcome, fields_from_json, fields_to_json

__all__ = ["Hello", "Funnelled", "Pieces", "Verdict", "HeldList", "Problem", "Parts"]


@dataclass(frozen=True)
class Hello:
    """The identity round: which save this client runs, the io client's setup (or why it has none),
    and, when it is known this early, this client's shard count."""

    identity: Tuple[str, int]
    setup: Optional[Outcome[Setup]] = None
    shards: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return {"id": list(self.identity), "setup": None if self.setup is None else self.setup.to_json(),
                "shards": self.shards}

    @classmethod
    def from_json(cls, obj: Any) -> "Hello":
        setup = obj.get("setup")
        prefix, number = obj["id"]
        return cls((str(prefix), int(number)), None if setup is None else Outcome.from_json(setup, Setup),
                   None if obj.get("shards") is None else int(obj["shards"]))


@dataclass(frozen=True)
class Funnelled:
    """A funnelling client's description of its shards (:func:`~.funnel.describe_plan`)."""

    description: List[List[Dict[str, Any]]]

    def to_json(self) -> Any:
        return self.description

    @classmethod
    def from_json(cls, obj: Any) -> "Funnelled":
        return cls(obj)


@dataclass(frozen=True)
class Pieces:
    """What every client tells the io client before anything commits: its shard count, its pieces
    (:func:`~.agreement.pack_pieces`) and the digest of what it holds (:func:`~.agreement.held_digest`)."""

    shards: int
    pieces: str
    held: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return {"shards": self.shards, "pieces": self.pieces, "held": self.held}

    @classmethod
    def from_json(cls, obj: Any) -> "Pieces":
        return cls(int(obj["shards"]), obj["pieces"], obj.get("held"))


@dataclass(frozen=True)
class Verdict:
    """The io client's verdict on the clients' pieces: what is wrong (``None``: nothing), every
    client's shard count (when they were not known before), and the clients asked for their whole
    lists of what they hold (``None``: every digest is the same)."""

    problem: Optional[str] = None
    counts: Optional[Tuple[int, ...]] = None
    held_from: Optional[Tuple[int, ...]] = None

    def to_json(self) -> Dict[str, Any]:
        return fields_to_json(self)

    @classmethod
    def from_json(cls, obj: Any) -> "Verdict":
        v = fields_from_json(cls, obj)
        return cls(v.problem, None if v.counts is None else tuple(int(c) for c in v.counts),
                   None if v.held_from is None else tuple(int(r) for r in v.held_from))


@dataclass(frozen=True)
class HeldList:
    """A client's whole list of what it holds (:func:`~.agreement.describe_held`), when asked."""

    held: Optional[Sequence[List[Any]]] = None

    def to_json(self) -> Any:
        return None if self.held is None else list(self.held)

    @classmethod
    def from_json(cls, obj: Any) -> "HeldList":
        return cls(obj)


@dataclass(frozen=True)
class Problem:
    """What the io client found wrong (``None``: nothing)."""

    text: Optional[str] = None

    def to_json(self) -> Any:
        return self.text

    @classmethod
    def from_json(cls, obj: Any) -> "Problem":
        return cls(None if obj is None else str(obj))


@dataclass(frozen=True)
class Parts:
    """What one client's shards produced (:meth:`~.commit.base.Committer.write_shard`), in shard order."""

    written: Tuple[Written, ...] = ()

    def to_json(self) -> Any:
        return [w.to_json() for w in self.written]

    @classmethod
    def from_json(cls, obj: Any) -> "Parts":
        return cls(tuple(Written.from_json(w) for w in obj))
