"""Collective saves of an object graph: every client of a job saves one checkpoint together.

A :class:`~shardckpt.Checkpoint` is saved collectively when its graph holds a value laid
out over several clients (a DVariable on a mesh of several clients: its ``spanned_clients``
is above one), over the process-wide coordinator; a ``dtensor.DTensorCheckpoint`` always
is, over its own coordinator. Every client then calls ``save``/``write`` with the same
graph, in the same order:

* each client lists the distinct pieces it holds of the laid-out values (each piece once,
  by the client of its lowest holder device, or in turns with ``replica_writer="balanced"``);
* values that are not laid out, and the object graph itself, are written once, by the io
  client (``CheckpointOptions(io_device=...)``, else client 0), through its lowest device;
* the one save path (:mod:`shardckpt.saving.engine`) agrees on the pieces, and on every
  client's full list of the variables it holds (written by it or not, so a replicated
  variable one client lacks or names otherwise fails the save), before anything is committed,
  commits atomically on the io client (which then runs ``on_commit``: the
  ``checkpoint`` state file, a manager's record), and tells every client the outcome; with
  ``enable_async`` all of that runs on each client's background thread.

Files on disk are those of any multi-client save: ``<prefix>_temp_<id>/`` while the
clients write, then ``<prefix>.index`` (the commit) and ``<prefix>.data-*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from ..distributed import get_coordinator
from ..distributed.coordinator import Coordinator
from ..errors import InvalidArgumentError
from ..saving.agreement import describe_held
from ..saving.async_save import AsyncSaver
from ..saving.distributed import io_rank_of, save_tensors_distributed
from ..saving.options import CheckpointOptions
from ..saving.pieces import pieces_of
from ..sharding.callback import ShardByDevicePolicy
from ..sharding.shardable import ShardableTensor
from .graph import SaveableGraph

__all__ = ["Collective", "find_collective", "save_collective", "collective_options"]


@dataclass(frozen=True)
class Collective:
    """How the clients save together.

    Attributes:
      coordinator: the clients' coordinator (its rank and size are this job's).
      io_device: the device name through which client ``r`` writes the values that are not
        laid out (and the object graph) when it is the io client.
      replica_writer: which holder writes a replicated piece: ``"lowest"`` or ``"balanced"``.
    """

    coordinator: Coordinator
    io_device: Callable[[int], str]
    replica_writer: str = "lowest"

    @property
    def several(self) -> bool:
        """Whether more than one client takes part (else every collective is trivial)."""
        return int(self.coordinator.size) > 1


def spanned_clients(value: Any) -> int:
    """How many clients hold pieces of ``value`` (1 for anything not laid out over clients)."""
    return int(getattr(value, "spanned_clients", 1) or 1)


def find_collective(graph: SaveableGraph) -> Optional[Collective]:
    """The collective save of ``graph`` over the process's coordinator, when a value of the graph lies on
    several clients; ``None`` when this client saves alone."""
    for saved in graph.tensors:
        value: Any = saved.value
        if spanned_clients(value) > 1:
            return Collective(get_coordinator(), value.device_of_client)
    return None


def collective_options(options: Optional[CheckpointOptions]) -> CheckpointOptions:
    """``options`` with the collective default sharding: one shard per writing device."""
    options = options or CheckpointOptions()
    if options.sharding_callback is None:
        options = options.replace(sharding_callback=ShardByDevicePolicy())
    return options


def save_collective(collective: Collective, path: str, graph: SaveableGraph, graph_tensor: ShardableTensor,
                    options: CheckpointOptions, *, on_commit: Any, saver: Optional[AsyncSaver],
                    on_failure: Optional[Callable[[], None]], previous: Optional[str] = None) -> None:
    """This client's part of the collective save of ``graph`` at ``path`` (see the module docstring)."""
    if graph.registered:
        raise InvalidArgumentError("registered savers are not supported in multi-client checkpoints", path=path)
    coordinator = collective.coordinator
    options = collective_options(options)
    io = io_rank_of(options, coordinator.size)
    io_device = collective.io_device(io)
    is_io = coordinator.rank == io
    local: List[ShardableTensor] = []
    for t in graph.tensors:
        local += pieces_of(t.key, t.value, clients=coordinator.size, writes_whole=is_io, device=io_device,
                           trackable=t.obj, replica_writer=collective.replica_writer)
    if is_io:
        local.append(ShardableTensor.from_value(graph_tensor.checkpoint_key, graph_tensor.tensor, device=io_device))
    # every client's full list of what it holds, written by it or not, is agreed before the commit
    held = describe_held([(t.key, t.value) for t in graph.tensors]) if collective.several else None
    save_tensors_distributed(path, local, options, coordinator, io_rank=io, on_commit=on_commit, saver=saver,
                             on_failure=on_failure, previous=previous, held=held)
