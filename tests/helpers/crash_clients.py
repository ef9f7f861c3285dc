"""Client processes of tests/test_crash_states.py's multi-client scenario (started with multiprocessing).

Each client saves its half of ``w`` (a slice) and a tensor of its own through the one save
path, collectively over a :class:`LocalProcessCoordinator`, with local paths served by a
``RecordingFileSystem``; it then writes its log of operations to ``<out>/rank<R>.json``
(data as hex: a test artefact, never a checkpoint).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

import numpy as np

ROWS = 64


def values(generation: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + generation)
    return {"w": rng.standard_normal((ROWS, 32)).astype(np.float32),
            "a0": rng.standard_normal(700).astype(np.float32), "a1": rng.standard_normal(900).astype(np.float32)}


def client(group: Any, rank: int, prefix: str, generation: int, out: str) -> None:
    from shardckpt import CheckpointOptions, ShardableTensor
    from shardckpt.distributed.local import LocalProcessCoordinator
    from shardckpt.saving.distributed import save_tensors_distributed
    from shardckpt.storage.local import local_fs
    from shardckpt.storage.registry import mounted
    from shardckpt.storage.wrappers import RecordingFileSystem

    coordinator = LocalProcessCoordinator(group, rank, timeout=60)
    v = values(generation)
    half = ROWS // 2
    rows = slice(rank * half, (rank + 1) * half)
    pieces = [ShardableTensor.from_value("w", v["w"][rows], slice_spec=f"{ROWS} 32 {rank * half},{half}:-",
                                         device=f"/job:worker/replica:0/task:{rank}/device:CPU:0"),
              ShardableTensor.from_value(f"a{rank}", v[f"a{rank}"],
                                         device=f"/job:worker/replica:0/task:{rank}/device:CPU:0")]
    recorder = RecordingFileSystem(local_fs)
    with mounted(recorder):
        save_tensors_distributed(prefix, pieces, CheckpointOptions(), coordinator)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump([[k, p, e if k == "rename" else (e.hex() if isinstance(e, bytes) else e)]
                   for k, p, e in recorder.ops], f)
