"""How one rank's items are split into data files: DCP's ``thread_count`` and ``single_file_per_rank``.

DCP's ``FileSystemWriter`` writes a rank's items into ``thread_count`` files (one per
writer thread), or, with ``single_file_per_rank=False``, one file per item.
:func:`writer_sharding` gives the sharding callback that does the same in a tensor
bundle: :class:`SplitPerRank` packs a task's tensors into up to ``n`` shards of about
equal bytes (largest first, each to the lightest shard so far), or one shard per
checkpoint key. ``None`` means the engine's default (one shard per task).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..sharding.callback import Shard, ShardingCallback
from ..sharding.shardable import ShardableTensor

__all__ = ["SplitPerRank", "writer_sharding"]


def _nbytes(st: ShardableTensor) -> int:
    size = st.dtype.itemsize if st.dtype.is_numeric and st.dtype.itemsize else 1
    return int(np.prod(st.shape, dtype=np.int64)) * size


class SplitPerRank(ShardingCallback):
    """Up to ``files`` shards of balanced bytes per task, or (``per_key``) one shard per checkpoint key."""

    def __init__(self, files: int, per_key: bool = False) -> None:
        self.files = max(1, int(files))
        self.per_key = per_key

    @property
    def description(self) -> str:
        """What the policy does."""
        if self.per_key:
            return "One shard per checkpoint key of each task."
        return f"Split each task's tensors into up to {self.files} shards of balanced bytes."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> List[Shard]:
        """The task's shards (see the class docstring)."""
        if self.per_key:
            by_key: dict = {}
            for st in shardable_tensors:
                by_key.setdefault(st.checkpoint_key, {}).setdefault(st.checkpoint_key, {})[st.slice_spec] = st.tensor
            return list(by_key.values())
        shards: List[Shard] = [{} for _ in range(self.files)]
        loads = [0] * self.files
        keys: List[dict] = [{} for _ in range(self.files)]  # checkpoint key -> shard, so a key stays in one file
        for st in sorted(shardable_tensors, key=_nbytes, reverse=True):
            home = next((i for i in range(self.files) if st.checkpoint_key in keys[i]), None)
            if home is None:
                home = min(range(self.files), key=loads.__getitem__)
            keys[home][st.checkpoint_key] = True
            shards[home].setdefault(st.checkpoint_key, {})[st.slice_spec] = st.tensor
            loads[home] += _nbytes(st)
        return [s for s in shards if s]


def writer_sharding(callback: Optional[ShardingCallback], thread_count: int,
                    single_file_per_rank: bool) -> Optional[ShardingCallback]:
    """The sharding callback of a writer's options (see the module docstring)."""
    if int(thread_count) < 1:
        raise InvalidArgumentError(f"thread_count must be >= 1, got {thread_count}")
    if thread_count == 1 and single_file_per_rank:
        return callback
    if callback is not None:
        raise InvalidArgumentError("thread_count > 1 and single_file_per_rank=False choose the data files; "
                                   "they cannot be combined with options.sharding_callback")
    return SplitPerRank(thread_count, per_key=not single_file_per_rank)
