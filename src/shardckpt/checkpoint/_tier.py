"""An object graph's part in a node's tier bundle (``CheckpointManager(Checkpoint(...), ..., local=LocalTier(...))``).

What :class:`~shardckpt.tiers.checkpoints.Tiered` asks of a :class:`~shardckpt.Checkpoint` (its
``_tier_pieces`` and ``_tier_missing``; a JAX ``PyTreeCheckpoint`` answers the same two from
``shardckpt.jax._tier``):

* :func:`tier_pieces`: the pieces this client writes into its node's bundle. A laid-out value
  (a DTensor: a ``layout`` with ``distinct_boxes`` over a mesh with ``client_of``) gives each
  distinct piece held on this node once, through the node's lowest device holding it; any
  other value is written whole by the node's leader, as is the object graph
  (``_CHECKPOINTABLE_OBJECT_GRAPH``). So every node's bundle holds what its clients hold,
  replicated copies included, and a restore onto the layouts of the save reads only its own
  node's bundle.
* :func:`tier_missing`: the first value or region this client restores (the current layouts)
  that a bundle does not hold, from its index alone: a restore onto another mesh or layout
  then reads a merged view of every node's bundle.

Nothing here reads or writes storage but the index of the bundle :func:`tier_missing` is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np

from ..errors import InvalidArgumentError
from ..format.tensor_slice import boxes_tile, full_box, intersect
from .graph import OBJECT_GRAPH_KEY, build_graph
from .trackable import Trackable

if TYPE_CHECKING:
    from ..tiers.nodes import NodeMap
    from ..tiers.save import TierPiece

__all__ = ["tier_pieces", "tier_missing", "node_pieces"]


def tier_pieces(root: Trackable, extra: Dict[str, Trackable], nodes: "NodeMap", rank: int,
                leader: bool) -> List["TierPiece"]:
    """Client ``rank``'s pieces of the graph at ``root`` (with ``extra`` children) for its node's bundle
    (``leader``: it is its node's leader, which writes whole values and the object graph)."""
    graph = build_graph(root, extra)
    out: List["TierPiece"] = []
    for t in graph.tensors:
        out += node_pieces(t.key, t.value, nodes, rank, leader)
    if leader:
        out.append((OBJECT_GRAPH_KEY, None, None, np.array(graph.proto.SerializeToString(), dtype=object)))
    return out


def node_pieces(key: str, value: Any, nodes: "NodeMap", rank: int, writes_whole: bool) -> List["TierPiece"]:
    """The pieces of ``value`` client ``rank`` writes into its node's bundle (see the module docstring;
    ``writes_whole``: it writes the whole values)."""
    layout = getattr(value, "layout", None)
    if layout is None or not hasattr(layout, "distinct_boxes"):
        if callable(getattr(value, "shardable_pieces", None)):
            raise InvalidArgumentError(f"{key!r}: a LocalTier saves DTensor values and whole values; "
                                       f"{type(value).__name__} is not supported yet")
        return [(key, None, None, value)] if writes_whole else []
    mesh = layout.mesh
    me = nodes.node_of_rank[rank]
    local = set(mesh.local_device_ids())
    shape = tuple(int(s) for s in value.shape)
    out: List["TierPiece"] = []
    for box, holders in layout.distinct_boxes(shape).items():
        on_node = [d for d in holders if nodes.node_of_rank[mesh.client_of(d)] == me]
        if not on_node or on_node[0] not in local:
            continue
        whole = box == full_box(shape)
        out.append((key, None if whole else shape, None if whole else box, value.components[on_node[0]]))
    return out


def tier_missing(root: Trackable, extra: Dict[str, Trackable], reader: Any) -> Optional[str]:
    """The first value (its key) or region (key and box) of the graph at ``root`` that this client restores
    and ``reader``'s bundle does not hold (``None``: it holds them all); its index only."""
    for t in build_graph(root, extra).tensors:
        if t.key not in reader:
            return t.key
        layout = getattr(t.value, "layout", None)
        if layout is None or not hasattr(layout, "distinct_boxes"):
            continue  # a whole value: present
        stored = reader.piece_boxes(t.key)
        shape = tuple(int(d) for d in t.value.shape)
        for device in layout.mesh.local_device_ids():
            box = layout.box(device, shape)
            parts = [c for c in (intersect(b, box) for b in stored) if c is not None]
            if boxes_tile(parts, box) is not None:
                return f"{t.key} {[list(b) for b in box]}"
    return None
