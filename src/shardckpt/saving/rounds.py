"""Collective rounds of a save, written once: every client contributes, one client (or all)
judges, the verdict reaches everyone — or every client fails with the same error.

A save (:mod:`shardckpt.saving.engine`) is a few such rounds over a
:class:`~shardckpt.distributed.Coordinator`, judged by its io client (the *root*).
:class:`Rounds` offers the shapes they take, each one or two collectives of JSON::

    all_gather(mine)                 all -> all         every client receives every message
                                                        and judges alike (one all-gather)
    decide(mine, judge, Verdict)     all -> root -> all the root judges every message; its
                                                        verdict is broadcast (gather, broadcast)
    announce(outcome, Kind, failed)  root -> all        what a step the root alone ran gave (one
                                                        broadcast)
    agree(outcome, Kind, barrier)    all -> all         every client's step succeeded: its values;
                                                        else the failures, named (barrier, all-gather)

What travels is a :class:`Message`: a frozen dataclass with typed fields that says how it is
encoded (``to_json``/``from_json``: JSON objects, never pickle; the coordinator carries them).
A step's result travels as an :class:`Outcome`: its value, or its error as text; the exception
itself stays on the client that raised it.

Failing alike: a step that failed on some client fails the round on every client with one
:class:`~shardckpt.distributed.CoordinationError` (the same text everywhere), chained to the
client's own error where it had one; a single client raises its own error (:meth:`Rounds.fail`).
A judge that raises on the root fails every client alike too, instead of leaving the others
waiting. :meth:`Rounds.undoing` runs the root's undo step (a committer's ``abort``) when any round
or step inside it fails, on every path, Ctrl-C included.

Nothing here touches storage; what is on disk is the caller's business.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, Iterator, List, NoReturn, Optional, Protocol, Type, TypeVar

from ..distributed.coordinator import CoordinationError, Coordinator, raise_failures

__all__ = ["Message", "Json", "Outcome", "Rounds", "describe", "fields_to_json", "fields_from_json"]

M = TypeVar("M", bound="Message")
V = TypeVar("V", bound="Message")


class Message(Protocol):
    """What one client sends in a round: encoded as JSON by ``to_json``, read back by ``from_json``."""

    def to_json(self) -> Any:
        """This message as JSON (dicts, lists, strings, numbers, booleans, ``None``)."""

    @classmethod
    def from_json(cls: Type[M], obj: Any) -> M:
        """The message ``to_json`` encoded."""


@dataclass(frozen=True)
class Json:
    """A message that is any JSON value (a front door's result, say): it travels as it is."""

    value: Any = None

    def to_json(self) -> Any:
        return self.value

    @classmethod
    def from_json(cls, obj: Any) -> "Json":
        return cls(obj)


def fields_to_json(message: Any) -> Dict[str, Any]:
    """A frozen dataclass's fields that differ from their defaults, as a JSON object (what travels)."""
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)
            if getattr(message, f.name) != f.default}


def fields_from_json(cls: Type[M], obj: Any) -> M:
    """The dataclass ``cls`` from what :func:`fields_to_json` made of one (fields not there: defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in obj.items() if k in names})


def describe(exc: BaseException) -> str:
    """An error as it travels to the other clients: ``Type: message``."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Outcome(Generic[V]):
    """What a step gave on one client: its ``value``, or its ``error`` (text; ``None``: it succeeded).

    ``raised`` is the exception itself, on the client that ran the step only (it never travels).
    On the wire: ``{"ok": bool, "error": text ("" when ok), "value": the value's JSON (when ok)}``.
    """

    value: Optional[V] = None  #: set exactly when ``error`` is ``None``
    error: Optional[str] = None
    raised: Optional[Exception] = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def of(cls, step: Callable[[], V], label: str = "") -> "Outcome[V]":
        """Run ``step``: its value, or the :class:`Exception` it raised (described after ``label``).
        Anything else (Ctrl-C, ``SystemExit``) propagates."""
        try:
            return cls(step())
        except Exception as exc:
            return cls.failed(exc, label)

    @classmethod
    def failed(cls, exc: Exception, label: str = "") -> "Outcome[V]":
        return cls(error=label + describe(exc), raised=exc)

    def to_json(self) -> Any:
        if self.value is not None:
            return {"ok": True, "error": "", "value": self.value.to_json()}
        return {"ok": False, "error": self.error}

    @classmethod
    def from_json(cls, obj: Any, kind: Type[V]) -> "Outcome[V]":
        if obj["ok"]:
            return cls(kind.from_json(obj["value"]))
        return cls(error=str(obj["error"]))


class Rounds:
    """The rounds of one collective step sequence over ``coordinator``, judged by ``root``;
    each collective waits ``timeout`` seconds (``None``: the coordinator's)."""

    def __init__(self, coordinator: Coordinator, root: int, timeout: Optional[float] = None) -> None:
        self.coordinator = coordinator
        self.root = root
        self.timeout = timeout

    @property
    def is_root(self) -> bool:
        return self.coordinator.rank == self.root

    def on_root(self, step: Callable[[], V]) -> Optional[Outcome[V]]:
        """[root] ``Outcome.of(step)``; ``None`` on the other clients, which do not run it."""
        return Outcome.of(step) if self.is_root else None

    @contextmanager
    def undoing(self, undo: Callable[[], None]) -> Iterator[None]:
        """On the root, run ``undo`` when anything inside fails (then the failure goes on)."""
        try:
            yield
        except BaseException:
            if self.is_root:
                undo()
            raise

    def all_gather(self, mine: M) -> List[M]:
        """[all] Every client's message, in rank order."""
        kind = type(mine)
        return [kind.from_json(o) for o in self.coordinator.all_gather(mine.to_json(), timeout=self.timeout)]

    def gather(self, mine: M) -> Optional[List[M]]:
        """[all] Every client's message, in rank order, on the root (``None`` elsewhere)."""
        gathered = self.coordinator.gather(mine.to_json(), root=self.root, timeout=self.timeout)
        return None if gathered is None else [type(mine).from_json(g) for g in gathered]

    def decide(self, mine: M, judge: Callable[[List[M]], V], verdict: Type[V], failed: str) -> V:
        """[all] Every client's message goes to the root only, which runs ``judge`` on them (in rank
        order); its verdict is broadcast. A judge that raises fails every client alike with
        ``CoordinationError(f"{failed}: {error}")``."""
        kind = type(mine)
        gathered = self.coordinator.gather(mine.to_json(), root=self.root, timeout=self.timeout)
        said: Optional[Outcome[V]] = None
        if gathered is not None:
            said = Outcome.of(lambda: judge([kind.from_json(g) for g in gathered]))
            del gathered
        return self.announce(said, verdict, failed)

    def announce(self, outcome: Optional[Outcome[V]], kind: Type[V], failed: str) -> V:
        """[all] The root's ``outcome`` (of a step only it ran; ``None`` elsewhere) on every client: its
        value, else ``CoordinationError(f"{failed}: {error}")`` everywhere (:meth:`settle`)."""
        sent = outcome.to_json() if outcome is not None else None
        received: Outcome[V] = Outcome.from_json(self.coordinator.broadcast(sent, root=self.root,
                                                                            timeout=self.timeout), kind)
        return self.settle(received, failed, outcome)

    def settle(self, outcome: Outcome[V], failed: str, own: Optional[Outcome[Any]] = None) -> V:
        """``outcome``'s value (one every client holds alike), else fail every client with
        ``CoordinationError(f"{failed}: {error}")`` (:meth:`fail`; ``own``: this client's outcome
        of the step, whose exception it is chained to)."""
        if outcome.ok:
            assert outcome.value is not None, "a step that succeeded gave no value"
            return outcome.value
        self.fail(own.raised if own is not None else None, CoordinationError(f"{failed}: {outcome.error}"))

    def agree(self, mine: Outcome[V], kind: Type[V], barrier: Optional[str] = None) -> List[V]:
        """[all] Every client's value, in rank order, when every client's step succeeded: (after the
        barrier ``barrier``, which names a client that never comes) one all-gather of every outcome.
        Any failure, or a failed collective, fails every client (:meth:`fail`); the error names each
        failed client (``k of n clients failed: rank r: ...``, as :meth:`Coordinator.agree`)."""
        try:
            if barrier is not None:
                self.coordinator.barrier(barrier, timeout=self.timeout)
            results = self.coordinator.all_gather(mine.to_json(), timeout=self.timeout)
            raise_failures(results)
            outcomes: List[Outcome[V]] = [Outcome.from_json(r, kind) for r in results]
        except BaseException as exc:
            self.fail(mine.raised, exc)
        return [o.value for o in outcomes if o.value is not None]  # every one: none failed

    def fail(self, own: Optional[BaseException], agreed: BaseException) -> NoReturn:
        """Raise a failed round's error: a single client's own error, else the ``agreed`` one (the
        same on every client), chained to this client's own error where it had one."""
        if own is not None and (self.coordinator.size == 1 or agreed is own):
            raise own
        if own is not None:
            raise agreed from own
        raise agreed
