"""A user's script under torchrun / mpiexec that saves a DTensorCheckpoint and then ends, calling no close method.

    exit_script.py MODE DIR

MODE: ``fall-off`` (the script simply ends), ``sys-exit`` (``sys.exit(0)``), ``user-error``
(an exception in user code after the save: the exit code must be non-zero, with the
user's traceback), ``async-pending`` (an asynchronous save still in flight when the script
ends: the interpreter waits for it).
"""

import os
import sys

import numpy as np

from shardckpt import CheckpointOptions
from shardckpt import dtensor as dt

mode, folder = sys.argv[1], sys.argv[2]
mesh = dt.create_distributed_mesh([("x", 2), ("y", 2)])
v = dt.DVariable(dt.from_global(np.arange(4096, dtype=np.float32).reshape(64, 64), dt.Layout(["x", "y"], mesh)))
ckpt = dt.DTensorCheckpoint(mesh, v=v)
options = CheckpointOptions(enable_async=mode == "async-pending")
ckpt.save(os.path.join(folder, "ck"), options=options)
if mode == "sys-exit":
    sys.exit(0)
if mode == "user-error":
    raise RuntimeError("user code failed after the save")
