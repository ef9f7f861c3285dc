"""Save plans: which values go into which shard, as frozen data.

A plan is made from the tensors to save and a sharding callback: tensors are
grouped by task (in order of first appearance), the callback runs once per task,
its result is validated, and the shards of all tasks are numbered ``0..N-1`` in
task order, as TensorFlow's ``MultiDeviceSaver`` numbers them.

Every :class:`PlanItem` carries a :class:`ValueSource`, the one way the engine gets
an item's bytes: ``get()`` returns the array (waiting for a staged copy when the
snapshot streams), ``release()`` says its bytes are on their way to storage (a
staging buffer may be refilled), ``fail(exc)`` says the writer gave up on it. An
:class:`ArraySource` serves a value that is already in host memory (or a
zero-argument callable that produces it); staging (:mod:`shardckpt.saving.staging`)
returns a *new* plan whose items carry staged sources. Nobody rewrites a plan in place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import InvalidArgumentError
from ..format.dtypes import DType
from ..format.tensor_slice import Box
from ..sharding.callback import ShardByTaskPolicy, ShardingCallback
from ..sharding.shardable import ShardableTensor
from ..sharding.validation import validate_shards

try:
    from typing import Protocol
except ImportError:  # pragma: no cover - Python < 3.8
    from typing_extensions import Protocol  # type: ignore[assignment]

__all__ = ["ValueSource", "ArraySource", "PlanItem", "Reuse", "ShardPlan", "change_token", "token_proves", "SavePlan",
           "make_save_plan", "as_shardable_tensors", "TensorsToSave"]

_log = logging.getLogger("shardckpt")

TensorsToSave = Union[Mapping[str, Any], Sequence[ShardableTensor]]


class ValueSource(Protocol):
    """Where a plan item's bytes come from (see the module docstring for the call sequence)."""

    def get(self) -> Any:
        """The value: a host array of the item's shape and dtype (object array for strings)."""

    def release(self) -> None:
        """The value's bytes are written (or sent): its buffer may be reused."""

    def fail(self, exc: BaseException) -> None:
        """The writer of this value failed; nothing will wait for it any more."""


@dataclass(frozen=True)
class ArraySource:
    """A value already in host memory, or a zero-argument callable that returns it."""

    value: Any

    def get(self) -> Any:
        """The array (the callable's result, called now)."""
        return self.value() if callable(self.value) else self.value

    def release(self) -> None:
        """Nothing to give back: the caller owns the array."""

    def fail(self, exc: BaseException) -> None:
        """Nothing waits for an array already in memory."""


@dataclass(frozen=True)
class PlanItem:
    """One value of one shard: its checkpoint key, slice, box in the global tensor, what it is, and its bytes."""

    key: str
    slice_spec: str
    box: Box
    tensor: ShardableTensor
    source: ValueSource
    #: the value's change token when it was planned (a ``Variable``'s version stamp), for incremental saves
    version: Optional[str] = None
    #: whether an unchanged ``version`` alone proves the bytes unchanged (a ``Variable`` that never
    #: handed out its live buffer); otherwise only ``trust_versions`` makes it count
    version_proves: bool = False

    @property
    def dtype(self) -> DType:
        """The value's dtype (as stored)."""
        return self.tensor.dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        """Shape of this value (the slice's shape for a slice)."""
        return tuple(b - a for a, b in self.box)

    @property
    def nbytes(self) -> int:
        """Bytes of the value (strings counted as one byte per element)."""
        n = 1
        for d in self.shape:
            n *= d
        return n * (self.dtype.itemsize or 1)

    def with_source(self, source: ValueSource) -> "PlanItem":
        """The same item, its bytes served by ``source``."""
        return replace(self, source=source)


@dataclass(frozen=True)
class Reuse:
    """A data file of an earlier checkpoint that holds a shard's values, unchanged (and maybe
    bytes of pieces no longer saved from it, which no entry names).

    ``source`` is the data file's path; ``entries`` the index entries (serialized
    ``BundleEntryProto``) of the shard's pieces, by the key stored in the index (a slice's
    entry under its encoded key; a sliced tensor's full entry lists only this file's
    slices), with offsets into ``source``; ``size`` the bytes of those pieces; ``record``
    what the incremental save tells the new checkpoint's sidecar about the file (its stamp
    as checked, the age of its last proof: :mod:`shardckpt.saving.scrub`).
    """

    source: str
    entries: Tuple[Tuple[bytes, bytes], ...]
    size: int
    record: Tuple[Tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class ShardPlan:
    """One shard: written as one bundle with one data file, by ``task``.

    Incremental saves (:mod:`shardckpt.saving.incremental`) set ``hashes`` (one
    content hash per item, ``None`` where it is computed while the bytes stream) and,
    for a shard whose values all lie unchanged in one earlier data file, ``reuse``:
    the committer then links or copies that file instead of writing the values.
    """

    index: int
    task: str
    items: Tuple[PlanItem, ...]
    hashes: Optional[Tuple[Optional[str], ...]] = None
    reuse: Optional[Reuse] = None
    #: incremental saves: each item's head hash (:func:`shardckpt.saving.incremental.head_hash`)
    heads: Optional[Tuple[Optional[str], ...]] = None
    #: incremental saves: each item's sample hash (:func:`shardckpt.saving.incremental.sample_hash`),
    #: ``None`` where it is computed on the writer's pass
    samples: Optional[Tuple[Optional[str], ...]] = None

    @property
    def nbytes(self) -> int:
        """Bytes of the shard's values (strings counted as one byte per element)."""
        return sum(item.nbytes for item in self.items)


@dataclass(frozen=True)
class SavePlan:
    """All shards of one save, numbered in order."""

    shards: Tuple[ShardPlan, ...]
    callback_description: str
    callback_seconds: float = 0.0
    tasks: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_shards(self) -> int:
        """Number of shards (this client's, in a multi-client save)."""
        return len(self.shards)

    @property
    def items(self) -> List[PlanItem]:
        """Every item, in shard order."""
        return [item for shard in self.shards for item in shard.items]

    def with_sources(self, make: Callable[[PlanItem], ValueSource]) -> "SavePlan":
        """A new plan whose items' bytes come from ``make(item)`` (shards that reuse a data file keep theirs:
        their bytes are never read)."""
        shards = tuple(s if s.reuse is not None else replace(s, items=tuple(i.with_source(make(i)) for i in s.items))
                       for s in self.shards)
        return replace(self, shards=shards)

    @classmethod
    def empty(cls) -> "SavePlan":
        """The plan of a client with nothing to save (others in a collective save may have values)."""
        return cls((), "none")


def as_shardable_tensors(tensors: TensorsToSave) -> List[ShardableTensor]:
    """Normalise ``{key: array | ShardableTensor}`` or a list of ``ShardableTensor``."""
    if isinstance(tensors, Mapping):
        out = []
        for key, value in tensors.items():
            if isinstance(value, ShardableTensor):
                if value.checkpoint_key != key:
                    raise InvalidArgumentError(f"ShardableTensor under key {key!r} has checkpoint_key "
                                               f"{value.checkpoint_key!r}")
                out.append(value)
            else:
                out.append(ShardableTensor.from_value(key, value))
        return out
    out = list(tensors)
    for st in out:
        if not isinstance(st, ShardableTensor):
            raise InvalidArgumentError(f"expected ShardableTensor, got {type(st).__name__}")
    return out


def change_token(tensor: ShardableTensor) -> Optional[str]:
    """What says that a value did not change since an earlier save: its trackable's ``_change_token()``
    (a :class:`~shardckpt.Variable`'s version), read now, before any bytes are copied."""
    token = getattr(tensor.trackable, "_change_token", None)
    if token is None:
        return None
    value = token()
    return None if value is None else f"{value}/{tensor.slice_spec}"


def token_proves(tensor: ShardableTensor) -> bool:
    """Whether :func:`change_token` alone proves the value unchanged (the trackable's
    ``_token_proves_unchanged()``: a :class:`~shardckpt.Variable` whose live buffer never left it)."""
    proves = getattr(tensor.trackable, "_token_proves_unchanged", None)
    return bool(proves()) if proves is not None else False


def make_save_plan(tensors: TensorsToSave, callback: Optional[ShardingCallback] = None) -> SavePlan:
    """Group by task, run the callback per task, validate, number the shards."""
    callback = callback or ShardByTaskPolicy()
    shardables = as_shardable_tensors(tensors)
    if not shardables:
        raise InvalidArgumentError("nothing to save")
    by_task: Dict[str, List[ShardableTensor]] = {}
    for st in shardables:
        by_task.setdefault(st.task, []).append(st)
    shards: List[ShardPlan] = []
    started = time.perf_counter()
    for task, group in by_task.items():
        result = callback(group)
        for checked in validate_shards(result, group, callback.description):
            items = tuple(PlanItem(i.key, i.slice_spec, i.box, i.source, ArraySource(i.value), change_token(i.source),
                                   token_proves(i.source)) for i in checked)
            shards.append(ShardPlan(len(shards), task, items))
    elapsed = time.perf_counter() - started
    _log.debug("sharding callback %r took %.1f us", callback.description, elapsed * 1e6)
    return SavePlan(tuple(shards), callback.description, elapsed, tuple(by_task))
