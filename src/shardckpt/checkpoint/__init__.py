"""The object-graph front door: ``Checkpoint``, ``CheckpointManager``, trackables, and checkpoint paths."""

from .checkpoint import Checkpoint
from .iterator import checkpoints_iterator
from .manager import CheckpointManager
from .reader import CheckpointReader, list_variables, load_checkpoint, load_variable
from .registration import register_checkpoint_saver
from .slots import Optimizer
from .state import get_checkpoint_state, latest_checkpoint, update_checkpoint_state
from .trackable import Module, Trackable, Variable

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointReader", "load_checkpoint", "list_variables",
           "load_variable", "latest_checkpoint", "get_checkpoint_state", "update_checkpoint_state",
           "register_checkpoint_saver", "Optimizer", "Module", "Trackable", "Variable", "checkpoints_iterator"]
