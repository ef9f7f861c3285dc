"""``DistributedValue`` and :func:`pieces_of`: the one way front doors turn values into pieces.

A value laid out over several devices or clients (a DTensor, a DVariable's value; later
torch and JAX arrays) implements :class:`DistributedValue`: it lists the distinct
pieces *this client* writes (each piece once, by its lowest holder unless told
otherwise) and fills itself from a checkpoint, reading only its own bytes. Any other
value is one whole piece, written by one client (the io client in a collective save).

``Checkpoint``, ``DTensorCheckpoint`` and ``dtensor.sharded_save`` call :func:`pieces_of`
for every value; the object graph and the restore matching never ask what a value is.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from ..sharding.shardable import ShardableTensor

try:
    from typing import Protocol, runtime_checkable
except ImportError:  # pragma: no cover - Python < 3.8
    from typing_extensions import Protocol, runtime_checkable  # type: ignore[assignment]

__all__ = ["DistributedValue", "pieces_of"]


@runtime_checkable
class DistributedValue(Protocol):
    """A value whose pieces lie on several devices or clients.

    A restore asks it what to read (``restore_reads``) and the restore engine
    (:mod:`shardckpt.restoring`) reads it with every other value of the call: announced
    together, on one pool, each read's follow-up (a copy to other replicas, a value built
    from its regions) run once its bytes are in.
    """

    def shardable_pieces(self, key: str, *, clients: int = 1, replica_writer: str = "lowest"
                         ) -> List[ShardableTensor]:
        """The distinct pieces this client writes under ``key`` when ``clients`` clients save together
        (an error naming ``key`` when the value's layout spans another number of clients)."""

    def restore_reads(self, key: str) -> List[Any]:
        """What fills this client's pieces from checkpoint ``key`` (only their bytes): restore-engine
        reads (``shardckpt.restoring.Read`` / ``ReadGroup``) with their follow-ups."""


def _distributed(value: Any) -> bool:
    """``isinstance(value, DistributedValue)`` without the protocol check's cost (~25 us a call)."""
    return callable(getattr(value, "shardable_pieces", None)) and callable(getattr(value, "restore_reads", None))


def pieces_of(key: str, value: Any, *, clients: int = 1, writes_whole: bool = True, device: Optional[str] = None,
              trackable: Any = None, replica_writer: str = "lowest") -> List[ShardableTensor]:
    """The pieces of ``value`` this client saves under ``key``.

    A :class:`DistributedValue` lists its own; any other value is one whole piece, saved
    only where ``writes_whole`` (the io client of a collective save; always in one process).
    """
    if not isinstance(value, np.ndarray) and _distributed(value):
        return value.shardable_pieces(key, clients=clients, replica_writer=replica_writer)
    if not writes_whole:
        return []
    return [ShardableTensor.from_value(key, value, device=device, trackable=trackable)]
