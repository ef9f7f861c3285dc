"""A pytree's part in a node's tier bundle (``CheckpointManager(PyTreeCheckpoint(state), ..., local=LocalTier(...))``).

What :class:`~shardckpt.tiers.checkpoints.Tiered` asks of a :class:`~shardckpt.jax.PyTreeCheckpoint`:

* :func:`tier_pieces`: the pieces this process writes into its node's bundle. Each
  ``jax.Array``'s distinct regions (over every device of the job:
  ``sharding.devices_indices_map``) held on this node, each once, through the node's
  lowest-numbered device holding it, written by the process owning that device; a
  region that is the whole array is written as a whole value. Host values (NumPy arrays,
  Python scalars, strings) and the pytree's metadata (:data:`~._tree.METADATA_KEY`: its
  structure, leaf kinds and the save counter) are written whole by the node's leader. So
  every node's bundle holds what its processes hold, replicated arrays included, and a
  restore onto the same shardings reads only its own node's bundle.
* :func:`tier_missing`: the first leaf region this process restores (the current
  ``state``'s shardings) that a bundle does not hold, from its index alone: a restore onto
  another mesh or layout then reads a merged view of every node's bundle.

The values are the shards' host arrays (``np.asarray``: a device-to-host copy on an
accelerator, every one started before the first is waited for; a view of the buffer on the
CPU); the tier's own staging copies them when the save is asynchronous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import jax
import numpy as np

from ..errors import InvalidArgumentError, NotFoundError
from ..format.tensor_slice import Box, boxes_tile, full_box, intersect
from ._restore import KeyMap, _checkpoint_key, _kind_of_target
from ._tree import METADATA_KEY, encode_metadata, host_value, leaf_kind, leaves_with_keys
from ._values import box_of, distinct_boxes

if TYPE_CHECKING:
    from ..tiers.nodes import NodeMap
    from ..tiers.save import TierPiece

__all__ = ["tier_pieces", "tier_missing"]


def tier_pieces(state: Any, extra_metadata: Dict[str, Any], nodes: "NodeMap", rank: int,
                leader: bool) -> List["TierPiece"]:
    """``(key, shape, box, value)`` of each piece this process writes into its node's bundle (module docstring);
    ``shape`` and ``box`` are ``None`` for a whole value."""
    if rank != jax.process_index() or len(nodes.node_of_rank) != jax.process_count():
        raise InvalidArgumentError(f"the coordinator is rank {rank} of {len(nodes.node_of_rank)}, JAX is process "
                                   f"{jax.process_index()} of {jax.process_count()}: a tier's pieces are placed "
                                   "by JAX's process index")
    me = nodes.node_of_rank[rank]
    kinds: Dict[str, str] = {}
    out: List["TierPiece"] = []
    for key, leaf in leaves_with_keys(state):
        kind = leaf_kind(key, leaf)
        kinds[key] = kind
        if kind == "jax":
            out += _array_pieces(key, leaf, nodes, me)
        elif leader:
            out.append((key, None, None, host_value(key, kind, leaf)))
    if leader:
        out.append((METADATA_KEY, None, None, encode_metadata(state, kinds, extra_metadata)))
    for piece in out:  # every device-to-host copy started before the first is waited for
        start = getattr(piece[3], "copy_to_host_async", None)
        if start is not None:
            start()
    return [(key, shape, box, np.asarray(value)) for key, shape, box, value in out]


def _array_pieces(key: str, array: Any, nodes: "NodeMap", me: str) -> List["TierPiece"]:
    shape = tuple(int(d) for d in array.shape)
    holders: Dict[Box, List[Any]] = {}
    for device, index in array.sharding.devices_indices_map(shape).items():
        holders.setdefault(box_of(index, shape), []).append(device)
    shards = {shard.device: shard for shard in array.addressable_shards}
    out: List["TierPiece"] = []
    for box, devices in holders.items():
        on_node = sorted((d for d in devices if nodes.node_of_rank[int(d.process_index)] == me), key=lambda d: d.id)
        if not on_node or on_node[0] not in shards:
            continue  # not on this node, or written by another process of it
        whole = box == full_box(shape)
        out.append((key, None if whole else shape, None if whole else box, shards[on_node[0]].data))
    return out


def tier_missing(state: Any, key_map: KeyMap, reader: Any) -> Optional[str]:
    """The first leaf (or region of one, on this process's devices) of ``state`` that ``reader``'s bundle does
    not hold, ``None`` when it holds them all: its index only, no data read."""
    for path_key, leaf in leaves_with_keys(state):
        try:
            key = _checkpoint_key(reader, path_key, key_map)
        except NotFoundError:  # not there, under any of its names
            return path_key
        if _kind_of_target(leaf) != "jax":
            continue
        shape = tuple(int(d) for d in leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        stored = reader.piece_boxes(key)
        for box in distinct_boxes(sharding, shape):
            parts = [c for c in (intersect(b, box) for b in stored) if c is not None]
            if boxes_tile(parts, box) is not None:
                return f"{key} {[list(b) for b in box]}"
    return None
