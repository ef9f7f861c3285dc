"""The saving engine: one save path (plan -> stage -> write -> commit -> after) over a
coordinator, a committer per storage kind, async staging.

Front doors: :func:`save_tensors` (one process), :func:`save_tensors_distributed`
(collective). Restores are :mod:`shardckpt.restoring`'s.
"""

from .distributed import save_tensors_distributed
from .engine import SaveStats
from .options import CheckpointOptions
from .plan import SavePlan, ShardPlan, make_save_plan
from .request import SaveRequest
from .save import save_tensors

__all__ = ["CheckpointOptions", "SavePlan", "ShardPlan", "make_save_plan", "SaveRequest",
           "SaveStats", "save_tensors", "save_tensors_distributed"]
