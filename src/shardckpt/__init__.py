"""shardckpt: sharded, multi-client, asynchronous checkpoints in TensorFlow's format, without TensorFlow.

Reading what TensorFlow wrote::

    import shardckpt
    reader = shardckpt.load_checkpoint("/path/to/ckpt-5")   # or the directory
    reader.get_variable_to_shape_map()
    kernel = reader.get_tensor("dense/kernel/.ATTRIBUTES/VARIABLE_VALUE")

Saving object graphs TensorFlow restores::

    ckpt = shardckpt.Checkpoint(model=model, optimizer=optimizer)
    manager = shardckpt.CheckpointManager(ckpt, "/train", max_to_keep=3)
    manager.restore_or_initialize()
    manager.save()

Raw ops: :mod:`shardckpt.io` (``save_v2``, ``restore_v2``, ``merge_v2_checkpoints``).
"""

from . import errors, io
from .checkpoint import (
    Checkpoint,
    CheckpointManager,
    CheckpointReader,
    Module,
    Optimizer,
    Trackable,
    Variable,
    checkpoints_iterator,
    get_checkpoint_state,
    latest_checkpoint,
    list_variables,
    load_checkpoint,
    load_variable,
    register_checkpoint_saver,
)
from .format.dtypes import DType, as_dtype
from .restoring import RestoreRequest, restore_tensors
from .saving import CheckpointOptions, save_tensors
from .sharding import MaxShardSizePolicy, ShardableTensor, ShardByDevicePolicy, ShardByTaskPolicy, ShardingCallback
from .tiers import LocalTier

__version__ = "0.1.0"

__all__ = [
    "errors", "io",
    "Checkpoint", "CheckpointManager", "CheckpointOptions", "Module", "Variable", "Optimizer", "Trackable",
    "register_checkpoint_saver",
    "CheckpointReader", "load_checkpoint", "list_variables", "load_variable", "latest_checkpoint",
    "get_checkpoint_state", "checkpoints_iterator",
    "save_tensors", "restore_tensors", "RestoreRequest",
    "ShardableTensor", "ShardingCallback", "ShardByTaskPolicy", "ShardByDevicePolicy", "MaxShardSizePolicy",
    "DType", "as_dtype", "LocalTier", "__version__",
]
