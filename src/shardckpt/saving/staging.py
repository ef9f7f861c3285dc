"""Staging: copying values to host buffers so a save can finish in the background.

A snapshot copies every value into a host buffer on the calling thread; after
that the caller may change its arrays freely. Buffers are kept in a
:class:`StagingPool` and reused by the next save of the same tensors, so memory
does not grow from save to save. With a byte budget the pool holds at most that
many bytes: the snapshot then streams, copying the next value only when the
background writer has written (and released) enough earlier ones.

Values that are not NumPy arrays are copied by a *stager* registered for their
type (:func:`register_stager`; registrations are kept by the process's
:mod:`~shardckpt.runtime`): e.g. a PyTorch adapter copies a device tensor into
a pinned host buffer. The staging step only needs "copy this value into that
host array".

Some values need no copy at all: a *holder* registered for their type
(:func:`register_holder`) may return a host array whose bytes cannot change for as
long as it is referenced (e.g. a view of an immutable ``jax.Array`` on a CPU device:
JAX neither frees nor donates a buffer with an outside reference). The staged plan
then serves that array itself, costs no buffer and no budget, and drops the reference
once the writer has released it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import numpy as np

from ..errors import InvalidArgumentError
from ..runtime import Slot
from .plan import PlanItem, SavePlan

__all__ = ["StagingPool", "register_stager", "register_holder", "stage_value", "StagedValue"]

Stager = Callable[[Any, np.ndarray], None]
Holder = Callable[[Any], Optional[np.ndarray]]

#: Registrations by type, kept by the process's runtime; made at import, so a runtime reset and a fork keep them.
_STAGERS: "Slot[Dict[Type[Any], Stager]]" = Slot("stagers by type", dict, keep_on_reset=True, keep_in_child=True)
_HOLDERS: "Slot[Dict[Type[Any], Holder]]" = Slot("holders by type", dict, keep_on_reset=True, keep_in_child=True)


def register_stager(kind: Type[Any], stager: Stager) -> None:
    """Copy values of type ``kind`` into host arrays with ``stager(value, out)``."""
    _STAGERS.get()[kind] = stager


def register_holder(kind: Type[Any], holder: Holder) -> None:
    """Snapshot values of type ``kind`` (a plan item's value or the callable producing it) without a copy:
    ``holder(value)`` returns a host array whose bytes stay unchanged while it is referenced, or ``None``
    when the value must be copied."""
    _HOLDERS.get()[kind] = holder


def _registered(slot: "Slot[Dict[Type[Any], Any]]", value: Any) -> Any:
    """What ``slot`` registered for the type of ``value`` or its nearest base (``None``: nothing)."""
    table = slot.get()
    for kind in type(value).__mro__:
        if kind in table:
            return table[kind]
    return None


def _held(value: Any) -> Optional[np.ndarray]:
    holder = _registered(_HOLDERS, value)
    return None if holder is None else holder(value)  # type: ignore[no-any-return]


def _stager_for(value: Any) -> Optional[Stager]:
    return _registered(_STAGERS, value)  # type: ignore[no-any-return]


def stage_value(value: Any, out: np.ndarray) -> None:
    """Copy ``value`` into the host array ``out`` (same shape and dtype)."""
    stager = _stager_for(value)
    if stager is not None:
        stager(value, out)
    else:
        np.copyto(out, np.asarray(value), casting="no" if out.dtype != object else "unsafe")


_READY = threading.Event()  # shared by every held value: ready from the start, never waited on long
_READY.set()


class StagedValue:
    """The staged copy of one value: the :class:`~shardckpt.saving.plan.ValueSource` of a staged plan's item.

    When the snapshot streams, ``get()`` waits until the copy is made. The writer
    calls ``release()`` once the bytes are on their way to disk, giving them back
    to the pool's budget.
    """

    __slots__ = ("array", "_pool", "_nbytes", "_released", "_ready", "_taken", "_block", "_shape", "_dtype",
                 "_held")

    def __init__(self, array: Optional[np.ndarray], pool: "StagingPool", nbytes: int,
                 shape: Tuple[int, ...] = (), dtype: Any = None, held: bool = False) -> None:
        self.array = array
        self._held = held
        self._pool = pool
        self._nbytes = nbytes
        self._released = False
        self._taken = False
        self._block: Optional[np.ndarray] = None
        self._shape, self._dtype = shape, dtype
        self._ready = _READY if held else threading.Event()

    def get(self) -> np.ndarray:
        """The staged copy (waits for it while the snapshot streams)."""
        self._ready.wait()
        if self.array is None or self._pool._failed is not None and not self._taken:
            raise RuntimeError("the snapshot was abandoned") from self._pool._failed
        return self.array

    def release(self) -> None:
        """The copy's bytes are written: its buffer goes back to the pool's budget."""
        self._pool._release(self)

    def fail(self, exc: BaseException) -> None:
        """The writer of this value failed: stop the snapshot (nothing waits for budget any more)."""
        self._pool.fail(exc)


class StagingPool:
    """Host buffers reused across saves, optionally bounded by ``budget_bytes``."""

    def __init__(self, budget_bytes: Optional[int] = None) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise InvalidArgumentError(f"staging budget must be positive, got {budget_bytes}")
        self.budget = budget_bytes
        self._buffers: Dict[Tuple[str, str], np.ndarray] = {}
        self._free: List[np.ndarray] = []  # with a budget: byte blocks to reuse
        self._held = 0  # with a budget: bytes of all blocks (in use and free)
        self._in_use = 0
        self._failed: Optional[BaseException] = None
        self._current: List[StagedValue] = []
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool's buffers."""
        if self.budget is not None:
            return self._held
        return sum(b.nbytes for b in self._buffers.values() if b.dtype != object)

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = exc
            self._cond.notify_all()
        for staged in self._current:
            staged._ready.set()  # writers waiting for values that will not come raise

    def _acquire(self, staged: StagedValue) -> None:
        """With a budget: wait for room, then point ``staged`` at a (reused) block."""
        n = staged._nbytes
        self._take(n)
        with self._cond:
            fits = [b for b in self._free if b.nbytes >= n]
            block = min(fits, key=lambda b: b.nbytes) if fits else None
            if block is not None:
                self._free = [b for b in self._free if b is not block]
            else:
                limit = max(self.budget or 0, n)
                while self._free and self._held + n > limit:  # drop what cannot serve
                    dropped = max(self._free, key=lambda b: b.nbytes)
                    self._free = [b for b in self._free if b is not dropped]
                    self._held -= dropped.nbytes
                self._held += n
        if block is None:
            block = np.empty(n, np.uint8)
        staged._block = block
        staged._taken = True
        staged.array = block[:n].view(staged._dtype).reshape(staged._shape)

    def _release(self, staged: StagedValue) -> None:
        if staged._held:  # written: the caller's buffer is its own again (JAX may donate it)
            staged._released = True
            staged.array = None
            return
        with self._cond:
            if staged._released or not staged._taken:
                staged._released = True
                return
            staged._released = True
            if self.budget is not None:
                self._in_use -= staged._nbytes
                if staged._block is not None:
                    self._free.append(staged._block)
                    staged._block = None
                self._cond.notify_all()

    def _buffer(self, key: str, spec: str, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buf = self._buffers.get((key, spec))
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
            buf = np.empty(shape, dtype=dtype)
            self._buffers[(key, spec)] = buf
        return buf

    def _take(self, nbytes: int) -> None:
        if self.budget is None:
            return
        with self._cond:
            while self._failed is None and self._in_use > 0 and self._in_use + nbytes > self.budget:
                self._cond.wait()  # a lone big value may pass
            if self._failed is not None:
                raise RuntimeError("the snapshot was abandoned: the writer failed") from self._failed
            self._in_use += nbytes

    def _give_back(self, nbytes: int) -> None:
        if self.budget is None:
            return
        with self._cond:
            self._in_use -= nbytes
            self._cond.notify_all()

    def stage_plan(self, plan: SavePlan) -> Tuple[SavePlan, Callable[[], None]]:
        """A new plan whose every value is served from a staging buffer, and the function that copies them.

        Start the writer on the staged plan, then call the function (the snapshot):
        the writer takes each value as soon as its copy is made (``StagedValue.get``
        waits for it). The function copies in plan order; with a budget it waits for
        the writer to release buffers whenever the budget is spent.
        """
        with self._cond:  # no save is in flight: start afresh
            self._in_use = 0
            self._failed = None
        work: List[Tuple[Any, StagedValue]] = []

        def stage(item: PlanItem) -> StagedValue:
            held = _held(getattr(item.source, "value", None))
            if held is not None:  # no copy: the bytes cannot change while the staged value holds them
                staged = StagedValue(held, self, 0, held=True)
                staged._taken = True
                return staged
            source = item.source.get()
            array = np.asarray(source) if _stager_for(source) is None else None
            shape = tuple(array.shape) if array is not None else item.shape
            dtype = np.dtype(item.dtype.numpy)
            if self.budget is None or dtype.kind == "O":
                staged = StagedValue(self._buffer(item.key, item.slice_spec, shape, dtype), self, 0)
            else:
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                staged = StagedValue(None, self, nbytes, shape, dtype)
            work.append((source, staged))
            return staged

        staged_plan = plan.with_sources(stage)
        # values that cost no budget (strings) first: nothing waiting for them waits for budget
        work.sort(key=lambda w: w[1]._nbytes != 0)
        self._current = [staged for _, staged in work]

        def fill() -> None:
            try:
                for source, staged in work:
                    if staged.array is None:
                        self._acquire(staged)
                    else:
                        staged._taken = True
                    assert staged.array is not None
                    stage_value(source, staged.array)
                    staged._ready.set()
            except BaseException as exc:
                self.fail(exc)
                raise

        return staged_plan, fill
