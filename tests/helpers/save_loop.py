"""Crash-test helper: save generation G of a test model to a prefix, in its own process.

Usage::

    python save_loop.py PREFIX GENERATION [GENERATION ...]

Builds the tensors of each generation (:func:`make_tensors`), prints ``READY`` once
they are in memory, then saves them one generation after the other with
``shardckpt.save_tensors`` and a ``MaxShardSizePolicy(8 MiB)``, printing
``SAVED <G>`` after each, and then keeps running for :data:`HOLD_AFTER_SAVES`
seconds, as a training process goes on after its save. The crash tests SIGKILL this
process at random moments and check that the prefix always holds exactly one
complete generation.

Each generation's values are distinct per (generation, tensor, element), and the
sizes (so the shard count) change with the generation, repeating for some
consecutive generations so that the "same shard count as the committed
checkpoint" path of the commit runs too.
"""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional

import numpy as np

MAX_SHARD_SIZE = 8 << 20
# Seconds the process stays alive after its last save: kills that land there find the
# new generation committed (and its clean-up done or cut short).
HOLD_AFTER_SAVES = 0.3
# Size factor per generation (cycled): equal neighbours give the same shard count.
SCALES = (3, 3, 5, 7, 7, 4, 6, 4, 4, 5)
_INT_BASE = tuple(60_000 + 13_000 * i for i in range(8))  # int64 elements per unit of scale
_COLS = 1024


def scale_of(generation: int) -> int:
    return SCALES[generation % len(SCALES)]


def make_tensors(generation: int) -> Dict[str, np.ndarray]:
    """The ~20-55 MB of tensors of ``generation`` (11 tensors; every value depends on it)."""
    if not 0 <= generation < 2048:
        raise ValueError("generation must be in [0, 2048) so the float32 values stay exact")
    s = scale_of(generation)
    g = np.int64(generation)
    tensors: Dict[str, np.ndarray] = {"generation": np.array(generation, dtype=np.int64)}
    for i, base in enumerate(_INT_BASE):
        n = base * s
        tensors[f"layer{i}/kernel"] = (g << 40) | (np.int64(i) << 32) | np.arange(n, dtype=np.int64)
    rows = 256 * s
    tensors["embedding/table"] = ((np.arange(rows * _COLS, dtype=np.float32) % 4096) / 4096
                                  + np.float32(generation)).reshape(rows, _COLS)
    tensors["vocab"] = np.array([f"gen-{generation}-word-{j}".encode() for j in range(50 + s)], dtype=object)
    return tensors


def save(prefix: str, generation: int, tensors: Optional[Dict[str, np.ndarray]] = None) -> None:
    """Save ``generation`` (its tensors, when already built) to ``prefix``."""
    import shardckpt

    options = shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(MAX_SHARD_SIZE))
    shardckpt.save_tensors(prefix, make_tensors(generation) if tensors is None else tensors, options)


def main(argv: List[str]) -> int:
    prefix, generations = argv[0], [int(a) for a in argv[1:]]
    all_tensors = [make_tensors(g) for g in generations]
    print("READY", flush=True)
    for g, tensors in zip(generations, all_tensors):
        save(prefix, g, tensors)
        print(f"SAVED {g}", flush=True)
    time.sleep(HOLD_AFTER_SAVES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
