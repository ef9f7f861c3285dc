"""One client of tests/test_disagreement.py, started by torchrun or mpiexec with 4 clients.

    disagree_worker.py OUTDIR DATADIR

On ``create_distributed_mesh([("x", 2), ("y", 4)])`` every client calls
``dtensor.sharded_save`` of one (8, 16) variable per phase, each at its own prefix
``DATADIR/<phase>``. In the phases after ``agree`` client 2 disagrees:

* ``rename``: client 2 names the variable ``w2``;
* ``layout``: client 2 lays it out as ``["y", "x"]`` instead of ``["x", "y"]``;
* ``mesh``: client 2 builds its mesh as ``[("x", 4), ("y", 2)]``;
* ``dtype``: client 2 saves float64;
* ``shape``: client 2 saves a (8, 32) variable (same layout, another global shape);
* ``root_shape``: client 0 (the io client) does, the others save (8, 16);
* ``skip``: client 2 skips the save to ``skip_a``; the others' save to ``skip_a`` meets
  client 2's save to ``skip_b``;
* ``resync``: everyone (client 2 for the second time) saves to ``skip_b``: this works.

Each phase's outcome goes to ``OUTDIR/rank<R>.json``; the test judges it and the files.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable, Dict

import numpy as np

SHAPE = (8, 16)


def main() -> None:
    out, data = sys.argv[1], sys.argv[2]
    result: Dict[str, Any] = {"phases": {}}
    rank = -1
    try:
        from shardckpt import CheckpointOptions
        from shardckpt import dtensor as dt
        from shardckpt.distributed import get_coordinator

        coordinator = get_coordinator()
        rank = result["rank"] = coordinator.rank
        mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
        other_mesh = dt.create_distributed_mesh([("x", 4), ("y", 2)])
        value = np.arange(np.prod(SHAPE), dtype=np.float64).reshape(SHAPE)
        options = CheckpointOptions(timeout=30)

        def save(prefix: str, name: str = "w", layout=("x", "y"), on=None, dtype: Any = np.float32,
                 wide: bool = False) -> None:
            m = on or mesh
            array = np.hstack([value, value]) if wide else value
            v = dt.from_global(array.astype(dtype), dt.Layout(list(layout), m))
            dt.sharded_save(m, os.path.join(data, prefix), [name], [""], [v], options)

        def phase(name: str, fn: Callable[[], None]) -> None:
            try:
                fn()
                result["phases"][name] = {"ok": True}
            except Exception as e:  # judged by the test
                result["phases"][name] = {"ok": False, "type": type(e).__name__, "message": str(e),
                                          "traceback": traceback.format_exc()}

        odd = rank == 2
        phase("agree", lambda: save("agree"))
        phase("rename", lambda: save("rename", name="w2" if odd else "w"))
        phase("layout", lambda: save("layout", layout=("y", "x") if odd else ("x", "y")))
        phase("mesh", lambda: save("mesh", on=other_mesh if odd else mesh))
        phase("dtype", lambda: save("dtype", dtype=np.float64 if odd else np.float32))
        phase("shape", lambda: save("shape", wide=odd))
        phase("root_shape", lambda: save("root_shape", wide=rank == 0))
        phase("skip", lambda: save("skip_b" if odd else "skip_a"))
        phase("resync", lambda: save("skip_b"))
        result["done"] = True
    except Exception:
        result["fatal"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{max(rank, 0) if rank >= 0 else os.getpid()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
