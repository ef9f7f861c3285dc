"""Sharding callbacks: how a task's tensors are split into shards (one data file each).

The contract is TensorFlow's (``tf.train.experimental.ShardingCallback``): a
callback has a ``description`` and is called once per task with that task's
:class:`ShardableTensor` list; it returns a list of shards, each a mapping
``{checkpoint_key: {slice_spec: tensor}}``. A TF user's callback ports by
changing the import. Unlike TensorFlow, shardckpt validates every result
(:mod:`shardckpt.sharding.validation`) before a byte is written.
"""

from __future__ import annotations

import abc
import logging
import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..errors import InvalidArgumentError
from ..format.strings import as_bytes_elements
from ..format.tensor_slice import Box, TensorSlice, format_shape_and_slice
from .shardable import ShardableTensor

__all__ = ["ShardingCallback", "ShardByTaskPolicy", "ShardByDevicePolicy", "MaxShardSizePolicy",
           "Shard", "OBJECT_GRAPH_KEY"]

Shard = Dict[str, Dict[str, Any]]
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_log = logging.getLogger("shardckpt")


class ShardingCallback(abc.ABC):
    """Base class of sharding policies (``tf.train.experimental.ShardingCallback``)."""

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """A short human-readable description of the policy."""

    @abc.abstractmethod
    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> List[Shard]:
        """Split one task's tensors into shards ``[{checkpoint_key: {slice_spec: tensor}}, ...]``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r})"


class ShardByTaskPolicy(ShardingCallback):
    """One shard per task (the default): everything a task holds goes into one data file."""

    @property
    def description(self) -> str:
        """What the policy does."""
        return "Split tensors into shards based on their device spec task."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> List[Shard]:
        """All of the task's tensors in one shard."""
        shard: Shard = {}
        for st in shardable_tensors:
            shard.setdefault(st.checkpoint_key, {})[st.slice_spec] = st.tensor
        return [shard] if shard else []


class ShardByDevicePolicy(ShardingCallback):
    """One shard per device, in order of first appearance (TF documents it; 2.21 lacks it)."""

    @property
    def description(self) -> str:
        """What the policy does."""
        return "Split tensors into shards based on their device spec."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> List[Shard]:
        """One shard per device."""
        by_device: Dict[str, Shard] = {}
        for st in shardable_tensors:
            by_device.setdefault(st.device, {}).setdefault(st.checkpoint_key, {})[st.slice_spec] = st.tensor
        return list(by_device.values())


class MaxShardSizePolicy(ShardingCallback):
    """Shards of at most ``max_shard_size`` bytes; large tensors are split into slices.

    Tensors are taken in order and packed into the current shard. A tensor that
    does not fit is cut along the axis that needs the fewest pieces (axis 0 unless
    another needs strictly fewer and its average piece fits), as TensorFlow does.
    Sizes are element bytes; for strings, the sum of their lengths (the longest
    string for the size of a slab). The object graph counts as 0 bytes.

    Unlike TensorFlow's, this policy always terminates: a piece that cannot fit
    any shard (a scalar, or a slab one index thick that is larger than the limit)
    is put alone in its own shard, with a warning.
    """

    class MaxShardSizePartitioner:
        """The partitioner the policy runs, as TensorFlow's (``get_shards(max_shard_size, shardable_tensors)``)."""

        def get_shards(self, max_shard_size: int, shardable_tensors: Sequence[ShardableTensor]) -> List[Shard]:
            """Split ``shardable_tensors`` into shards of at most ``max_shard_size`` bytes."""
            packer = _Packer(int(max_shard_size))
            for st in shardable_tensors:
                packer.add_tensor(st)
            return packer.result()

    def __init__(self, max_shard_size: int) -> None:
        if int(max_shard_size) <= 0:
            raise InvalidArgumentError(f"max_shard_size must be positive, got {max_shard_size}")
        self.max_shard_size = int(max_shard_size)

    @property
    def description(self) -> str:
        """What the policy does."""
        return "Split tensors into shards with a max shard size."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> List[Shard]:
        """Shards of at most ``max_shard_size`` bytes (see the class docstring)."""
        return self.MaxShardSizePartitioner().get_shards(self.max_shard_size, shardable_tensors)


def _sizes(st: ShardableTensor, value: np.ndarray) -> Tuple[int, int]:
    """(total bytes, bytes per element estimate) of a tensor, as the policy counts them."""
    if st.checkpoint_key == OBJECT_GRAPH_KEY or st.dtype.is_variant:
        return 0, 0
    if st.dtype.is_numeric:
        assert st.dtype.itemsize is not None
        return int(value.size) * st.dtype.itemsize, st.dtype.itemsize
    lengths = [len(b) for b in as_bytes_elements(value)]
    return sum(lengths), max(lengths, default=0)


class _Packer:
    """The state of :class:`MaxShardSizePolicy` while it walks the tensors."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.shards: List[Shard] = [{}]
        self.remaining = limit
        self.oversize: List[Shard] = []

    def _new_shard(self) -> None:
        if self.shards[-1]:
            self.shards.append({})
        self.remaining = self.limit

    def _put(self, st: ShardableTensor, spec: str, value: Any, nbytes: int) -> None:
        self.shards[-1].setdefault(st.checkpoint_key, {})[spec] = value
        self.remaining -= nbytes
        if self.remaining <= 0:
            self._new_shard()

    def _put_alone(self, st: ShardableTensor, spec: str, value: Any, nbytes: int) -> None:
        _log.warning("MaxShardSizePolicy: %s (%s, %d bytes) is larger than max_shard_size=%d; "
                     "it gets a shard of its own", st.checkpoint_key, spec or "whole", nbytes, self.limit)
        self.oversize.append({st.checkpoint_key: {spec: value}})

    def add_tensor(self, st: ShardableTensor) -> None:
        value = st.value()
        total, elem = _sizes(st, value)
        if total <= self.remaining:
            self._put(st, st.slice_spec, st.tensor, total)
            return
        if not st.shape:  # scalars are never split
            if total > self.limit:
                self._put_alone(st, st.slice_spec, st.tensor, total)
            else:
                self._new_shard()
                self._put(st, st.slice_spec, st.tensor, total)
            return
        origin = st.box
        full_shape = st.full_shape
        region = [[0, d] for d in st.shape]  # what is left to place, in the value's coordinates

        def piece(bounds: List[List[int]]) -> Tuple[str, Any]:
            local: Box = tuple((a, b) for a, b in bounds)
            value_part = value[tuple(slice(a, b) for a, b in local)]
            global_box = tuple((a + o, b + o) for (a, b), (o, _) in zip(local, origin))
            return format_shape_and_slice(full_shape, TensorSlice.from_box(global_box)), value_part

        def region_bytes(bounds: List[List[int]]) -> int:
            n = 1
            for a, b in bounds:
                n *= b - a
            return n * elem

        while region_bytes(region) > self.remaining:
            lengths = [b - a for a, b in region]
            volume = math.prod(lengths)
            parts = []
            for length in lengths:
                slab = (volume // length if length else 0) * elem
                thick = self.remaining // slab if slab else length
                parts.append(math.ceil(length / thick) if thick else math.inf)
            if all(p == math.inf for p in parts):
                if self.remaining < self.limit:
                    self._new_shard()  # retry in an empty shard
                    continue
                # Not even a one-index slab fits an empty shard: cut the thinnest slab alone.
                axis = min(range(len(lengths)), key=lambda a: volume // lengths[a] if lengths[a] else 0)
                cut = [list(r) for r in region]
                cut[axis][1] = cut[axis][0] + 1
                spec, part = piece(cut)
                self._put_alone(st, spec, part, region_bytes(cut))
                region[axis][0] += 1
                if region_bytes(region) == 0:
                    return
                continue
            axis = 0
            total_bytes = region_bytes(region)
            for a, p in enumerate(parts):
                if p < parts[axis] and total_bytes / p <= self.remaining:
                    axis = a
            if parts[axis] == math.inf:
                axis = min(range(len(parts)), key=lambda a: parts[a])
            count = math.ceil(lengths[axis] / parts[axis])
            cut = [list(r) for r in region]
            cut[axis][1] = cut[axis][0] + count
            spec, part = piece(cut)
            self._put(st, spec, part, region_bytes(cut))
            region[axis][0] += count
        if tuple(tuple(r) for r in region) == tuple((0, d) for d in st.shape):
            self._put(st, st.slice_spec, st.tensor, region_bytes(region))
        elif all(b > a for a, b in region):
            spec, part = piece(region)
            self._put(st, spec, part, region_bytes(region))

    def result(self) -> List[Shard]:
        return [s for s in self.shards if s] + self.oversize
