"""A writer for the racing-writers tests (tests/test_s3_racing_writers.py): save a recognisable checkpoint
to a prefix that another writer saves to at the same moment, and read back what the prefix holds.

As a process: ``python s3_race_writer.py PREFIX WRITER ROUNDS START SHARD_BYTES OUT`` saves once per
round at ``START + round * ROUND_SECONDS`` (wall clock), reads the checkpoint near the end of the
round and writes one JSON line per round to ``OUT``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, Optional

import numpy as np

KEYS = ("t0", "t1", "t2", "t3")
ROUND_SECONDS = 5.0  # a round must hold a whole save even on a loaded 2-core machine


def values(fill: int) -> Dict[str, np.ndarray]:
    """Four 64 KiB tensors, every element ``fill`` (fill = round * 10 + writer)."""
    return {k: np.full(16384, fill, dtype=np.float32) for k in KEYS}


def save(prefix: str, fill: int, shard_bytes: int) -> Dict[str, Any]:
    """One save; ``{"ok": True}`` or the error's class and message."""
    import shardckpt

    try:
        shardckpt.save_tensors(prefix, values(fill), shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(shard_bytes)))
        return {"ok": True, "fill": fill}
    except Exception as exc:  # reported to the test, which judges it
        return {"ok": False, "fill": fill, "error": type(exc).__name__, "message": str(exc)}


def read_fill(prefix: str) -> Optional[Any]:
    """The single fill value of every tensor at the prefix; ``None`` when nothing was ever committed there;
    ``"mixed: ..."`` or ``"unreadable: ..."`` when it is not one whole checkpoint."""
    import shardckpt
    from shardckpt.storage import get_fs

    if not get_fs(prefix).exists(prefix + ".index"):
        return None
    try:
        with shardckpt.load_checkpoint(prefix) as reader:
            fills = {float(v) for k in KEYS for v in np.unique(reader.get_tensor(k))}
    except Exception as exc:
        return f"unreadable: {type(exc).__name__}: {exc}"
    return int(fills.pop()) if len(fills) == 1 else f"mixed: {sorted(fills)}"


def main() -> None:
    prefix, writer, rounds, start, shard_bytes, out = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                        float(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    save(f"{prefix}-warmup-{writer}", 0, shard_bytes)  # imports, connections: the rounds then race for real
    with open(out, "w") as f:
        for r in range(rounds):
            begin = start + r * ROUND_SECONDS
            time.sleep(max(0.0, begin - time.time()))
            result = save(prefix, (r + 1) * 10 + writer, shard_bytes)
            result["seconds"] = time.time() - begin
            time.sleep(max(0.0, begin + ROUND_SECONDS * 0.8 - time.time()))
            result["round"] = r
            result["read"] = read_fill(prefix)
            f.write(json.dumps(result) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
