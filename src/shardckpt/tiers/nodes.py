"""Which node a client runs on, and where a node's replicas go.

A *node* is a machine (a failure domain): its clients share its local tier folder, and it
loses its tier when it is lost. This client's node id is, first that applies:

1. ``$SHARDCKPT_NODE`` (any string; tests and one-machine simulations set it per client);
2. torchrun's ``$GROUP_RANK`` (the elastic agent's node rank);
3. under MPI (the coordinator's backend ``"mpi"``): the lowest ``COMM_WORLD`` rank of this
   process's shared-memory communicator (``Split_type(COMM_TYPE_SHARED)``);
4. under JAX (backend ``"jax"``): ``jax.process_index()`` (one process per host);
5. the host name.

:class:`NodeMap` is every client's node, gathered once (one all-gather): the distinct node
ids sorted (numerically when they are all integers) give node indexes ``0..n-1``; the
lowest rank of a node is its *leader*, the one client that merges the node's bundle,
sends and receives its replicas and writes its markers.

Placement (documented and fixed): node ``i``'s bundle is also held by nodes
``i+1, ..., i+r (mod n)`` with ``r = min(replicas, n - 1)``: never by node ``i`` itself, and
two copies of a bundle are lost only when two neighbouring nodes (in that ring) are.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..distributed.coordinator import Coordinator
from ..errors import InvalidArgumentError

__all__ = ["NODE_ENV", "node_id", "NodeMap", "replica_targets"]

NODE_ENV = "SHARDCKPT_NODE"


def node_id(coordinator: Optional[Coordinator] = None) -> str:
    """This client's node id (see the module docstring for the order of the rules)."""
    for var in (NODE_ENV, "GROUP_RANK"):
        value = os.environ.get(var, "").strip()
        if value:
            return value
    backend = getattr(coordinator, "backend", "") if coordinator is not None else ""
    if backend == "mpi":
        try:
            from mpi4py import MPI

            shared = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            lowest = shared.allreduce(MPI.COMM_WORLD.Get_rank(), op=MPI.MIN)
            shared.Free()
            return str(lowest)
        except Exception:  # noqa: BLE001 - fall through to the host name
            pass
    if backend == "jax":
        try:
            import jax

            return str(jax.process_index())
        except Exception:  # noqa: BLE001
            pass
    return socket.gethostname()


def checked_node_id(coordinator: Optional[Coordinator] = None, my_node: Optional[str] = None) -> str:
    """This client's node id (``my_node`` when given), checked to name a folder."""
    mine = node_id(coordinator) if my_node is None else my_node
    if "/" in mine or mine in ("", ".", ".."):
        raise InvalidArgumentError(f"node id {mine!r} cannot name a folder ({NODE_ENV})")
    return mine


def _order(ids: List[str]) -> List[str]:
    if all(i.lstrip("-").isdigit() for i in ids):
        return sorted(ids, key=int)
    return sorted(ids)


def replica_targets(index: int, nodes: int, replicas: int) -> List[int]:
    """The node indexes holding replicas of node ``index``'s bundle: the next ``replicas`` nodes in the ring."""
    if replicas < 0:
        raise InvalidArgumentError(f"replicas must be >= 0, got {replicas}")
    return [(index + j) % nodes for j in range(1, min(replicas, nodes - 1) + 1)]


@dataclass(frozen=True)
class NodeMap:
    """Every client's node: ``node_of_rank[r]`` is client ``r``'s node id; ``nodes`` the ids in index order."""

    node_of_rank: Tuple[str, ...]
    nodes: Tuple[str, ...]

    @classmethod
    def gather(cls, coordinator: Coordinator, my_node: Optional[str] = None) -> "NodeMap":
        """Every client's node id (collective: one all-gather)."""
        return cls.of([str(n) for n in coordinator.all_gather(checked_node_id(coordinator, my_node))])

    @classmethod
    def of(cls, ids: List[str]) -> "NodeMap":
        """The map of every client's node id, in rank order (as gathered)."""
        return cls(tuple(ids), tuple(_order(list(set(ids)))))

    def index(self, node: str) -> int:
        return self.nodes.index(node)

    def ranks_of(self, node: str) -> List[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    def leader(self, node: str) -> int:
        """The lowest rank on ``node``."""
        return self.ranks_of(node)[0]

    def replicas_of(self, node: str, replicas: int) -> List[str]:
        """The nodes that hold replicas of ``node``'s bundle."""
        return [self.nodes[i] for i in replica_targets(self.index(node), len(self.nodes), replicas)]

    def as_json(self) -> Dict[str, Any]:
        return {"nodes": list(self.nodes), "node_of_rank": list(self.node_of_rank)}
