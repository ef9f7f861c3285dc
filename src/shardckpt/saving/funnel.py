"""Funnelling (``CheckpointOptions(io_device=...)`` in a multi-client save): every byte goes
through the io client, which alone touches storage.

Protocol, after the plan is made on every client:

1. all-gather: each client other than the io client describes its shards as JSON
   (key, slice, dtype, shape; string values travel inside the description, hex-encoded);
2. each such client sends the bytes of its numeric values to the io client, in
   description order (releasing each staged buffer once sent);
3. the io client receives them into fresh arrays and writes those shards as its own.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from ..distributed.coordinator import Coordinator
from ..format.bundle_writer import byte_view
from ..format.dtypes import as_dtype
from ..format.strings import as_bytes_elements
from ..sharding.shardable import ShardableTensor
from .plan import ArraySource, PlanItem, SavePlan, ShardPlan

__all__ = ["describe_plan", "receive_plan", "send_plan"]

Description = List[List[Dict[str, Any]]]


def describe_plan(plan: SavePlan) -> Description:
    """JSON description of each shard's values (no wait for a staged copy except for strings)."""
    shards = []
    for shard in plan.shards:
        items = []
        for item in shard.items:
            entry: Dict[str, Any] = {"key": item.key, "spec": item.slice_spec, "dtype": item.dtype.enum,
                                     "shape": list(item.shape)}
            if item.dtype.is_string:
                value = np.asarray(item.source.get())
                entry["shape"] = list(value.shape)
                entry["strings"] = [b.hex() for b in as_bytes_elements(value)]
            items.append(entry)
        shards.append(items)
    return shards


def receive_plan(described: Description, coordinator: Coordinator, source: int) -> List[ShardPlan]:
    """[io client] The shards of client ``source``, their bytes received into new arrays."""
    shards = []
    for items in described:
        plan_items = []
        for entry in items:
            dt = as_dtype(int(entry["dtype"]))
            if dt.is_string:
                value = np.empty(len(entry["strings"]), dtype=object)
                value[:] = [bytes.fromhex(h) for h in entry["strings"]]
                value = value.reshape(entry["shape"])
            else:
                value = np.empty(entry["shape"], dtype=dt.numpy)
                if value.nbytes:
                    coordinator.recv_bytes(source, value.nbytes, byte_view(value))
            st = ShardableTensor.from_value(entry["key"], value, slice_spec=entry["spec"])
            plan_items.append(PlanItem(entry["key"], entry["spec"], st.box, st, ArraySource(value)))
        shards.append(ShardPlan(0, f"/task:{source}", tuple(plan_items)))
    return shards


def send_plan(plan: SavePlan, coordinator: Coordinator, dst: int) -> None:
    """[other clients] Send every numeric value's bytes to ``dst``, in :func:`describe_plan` order."""
    for item in plan.items:
        if item.dtype.is_string:
            continue
        value = np.ascontiguousarray(item.source.get())
        if value.nbytes:
            coordinator.send_bytes(byte_view(value), dst)
        item.source.release()  # sent: a staged buffer may be refilled
