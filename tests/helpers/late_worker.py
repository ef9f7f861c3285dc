"""One client of tests/test_late_client.py, started by torchrun or mpiexec with 4 clients.

    late_worker.py MODE OUTDIR DATADIR

Every client saves ``DATADIR/first`` together (``dtensor.sharded_save`` of one (8, 16)
variable on ``create_distributed_mesh([("x", 2), ("y", 4)])``), then ``DATADIR/second``
with ``CheckpointOptions(timeout=TIMEOUT)``, which client :data:`LATE` starts only after
the others have given up on it (it waits until their outcome files exist):

* ``gone``: the others end once they have failed (their process groups torn down, as
  when a script ends): the late client's collectives meet closed connections;
* ``stay``: the others stay alive (idle) until the late client has recorded its outcome.

Each client's outcome of the second save (exception type, message, ``missing``, seconds)
goes to ``OUTDIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Dict

import numpy as np

LATE = 2
TIMEOUT = 3.0
WAIT = 120.0  # at most this long for the other clients' files


def _write(out: str, rank: int, result: Dict[str, Any]) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def _wait_for(paths: list) -> None:
    end = time.monotonic() + WAIT
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < end:
        time.sleep(0.05)


def main() -> None:
    mode, out, data = sys.argv[1], sys.argv[2], sys.argv[3]
    result: Dict[str, Any] = {}
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    try:
        from shardckpt import CheckpointOptions
        from shardckpt import dtensor as dt
        from shardckpt.distributed import CoordinationError, CoordinationTimeout, get_coordinator

        coordinator = get_coordinator()
        rank = coordinator.rank
        mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
        value = dt.from_global(np.arange(128, dtype=np.float32).reshape(8, 16), dt.Layout(["x", "y"], mesh))
        dt.sharded_save(mesh, os.path.join(data, "first"), ["w"], [""], [value], CheckpointOptions(timeout=60))
        others = [os.path.join(out, f"rank{r}.json") for r in range(coordinator.size) if r != LATE]
        if rank == LATE:
            _wait_for(others)
            time.sleep(1.0 if mode == "gone" else 0.2)  # the others' processes end meanwhile ("gone")
        t0 = time.monotonic()
        try:
            dt.sharded_save(mesh, os.path.join(data, "second"), ["w"], [""], [value],
                            CheckpointOptions(timeout=TIMEOUT))
            result["outcome"] = {"ok": True}
        except Exception as e:  # judged by the test
            result["outcome"] = {"ok": False, "type": type(e).__name__, "message": str(e),
                                 "missing": getattr(e, "missing", None),
                                 "coordination": isinstance(e, CoordinationError),
                                 "timeout": isinstance(e, CoordinationTimeout),
                                 "traceback": traceback.format_exc()}
        result["outcome"]["elapsed"] = time.monotonic() - t0
        result["done"] = True
        _write(out, rank, result)
        if rank != LATE and mode == "stay":
            _wait_for([os.path.join(out, f"rank{LATE}.json")])
    except Exception:
        result["fatal"] = traceback.format_exc()
        _write(out, rank if rank >= 0 else os.getpid(), result)


if __name__ == "__main__":
    main()
