"""What one restore reads: :class:`Read` (a region of a stored tensor into a destination),
:class:`ReadGroup` (reads that complete together) and :class:`RestorePlan` (every group of one
call, on one :class:`~.source.PieceSource`, with the call's verification, threads and budget).

All three are frozen plain data, built by a front door (``Checkpoint.restore``, DTensor,
JAX, DCP's ``TFBundleReader``, ``restore_tensors``) from the source's metadata, and handed
to :func:`~.engine.run`, the one read loop. Nothing here touches storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import InvalidArgumentError
from ..format.tensor_slice import Box

__all__ = ["Read", "ReadGroup", "RestorePlan"]


@dataclass(frozen=True)
class Read:
    """Read ``region`` of stored tensor ``key`` into ``out``.

    ``region``: a box of ``(start, stop)`` pairs of the global tensor (``None``: all of it),
    or, with ``piece`` (a :class:`~shardckpt.format.bundle_reader.StoredPiece` the front door
    already looked up, e.g. the chunk a DCP read item names), a box relative to that piece.
    ``out``: the destination (shape of the region, the stored dtype; a strided view is fine);
    ``None``: a new array, 64-byte aligned, is returned. ``then(out)`` runs on the reading
    thread as soon as this read's bytes are in and checked (a copy to a GPU, a cast, a copy to
    other replicas); a read with ``then`` is never deferred to the end of the restore.
    """

    key: Union[str, bytes]
    region: Optional[Box] = None
    out: Optional[np.ndarray] = None
    piece: Any = None
    then: Optional[Callable[[np.ndarray], None]] = None

    @property
    def whole(self) -> bool:
        """A whole tensor read without a follow-up: the engine batches these (one pass of planning,
        read and checksummed by the source's helpers)."""
        return self.region is None and self.piece is None and self.then is None


@dataclass(frozen=True)
class ReadGroup:
    """Reads whose values are used together: ``done(values)`` runs on the calling thread once every
    read of the group is in (and, for a deferring plan, once every read of the plan is checked).

    ``nbytes``: host bytes the group holds until ``done`` returns; a plan with a budget admits
    groups in order while the bytes in flight stay within it (a group larger than the budget is
    read alone).
    """

    reads: Tuple[Read, ...]
    done: Optional[Callable[[List[np.ndarray]], Any]] = None
    nbytes: int = 0


def _as_group(item: Union[Read, ReadGroup]) -> ReadGroup:
    return item if isinstance(item, ReadGroup) else ReadGroup((item,))


@dataclass(frozen=True)
class RestorePlan:
    """Every read of one restore call from one source.

    ``verify``: check the CRC32C of every piece read whole (parts of pieces have their
    file's identity checked instead). ``workers``: threads reading at once (``1``: every
    read on the calling thread). ``budget``: host bytes of groups in flight (``None``: no
    bound). ``defer``: whole reads may complete (and be checked) when the plan ends —
    groups' ``done`` then run after every check; without it each group is complete and
    checked when its ``done`` runs (streaming restores that build values as they go).
    """

    source: Any  # a PieceSource (typed loosely: restoring.source imports this module)
    groups: Tuple[ReadGroup, ...]
    verify: bool = True
    workers: int = 2
    budget: Optional[int] = None
    defer: bool = True
    name: str = field(default="", compare=False)

    @classmethod
    def of(cls, source: Any, items: Sequence[Union[Read, ReadGroup]], **kwargs: Any) -> "RestorePlan":
        """A plan of ``items`` (reads, each its own group, or groups)."""
        plan = cls(source, tuple(_as_group(i) for i in items), **kwargs)
        if plan.workers < 1:
            raise InvalidArgumentError(f"a restore needs at least one reading thread, got workers={plan.workers}")
        if plan.budget is not None and plan.budget <= 0:
            raise InvalidArgumentError(f"a restore's memory budget must be positive, got {plan.budget}")
        return plan

    @property
    def reads(self) -> List[Read]:
        """Every read, in order."""
        return [r for g in self.groups for r in g.reads]
