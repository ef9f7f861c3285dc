"""One of two clients of tests/test_timeouts.py, started by torchrun with ``SHARDCKPT_TIMEOUT`` set.

    timeout_worker.py OUTDIR DATADIR

Each step makes a new process-wide coordinator (``set_coordinator(None)``, then
``get_coordinator(...)``; collective) and client 0 saves alone while client 1 stays away,
so client 0's error says which timeout its first collective waited: ``env`` (no argument,
no option), ``argument`` (``get_coordinator(timeout=2.5)``), ``option``
(``get_coordinator(timeout=2.5)`` and ``CheckpointOptions(timeout=1)``). In ``longer``
(``get_coordinator(timeout=1)``, ``CheckpointOptions(timeout=8)``) client 1 joins the save
2.5 s late and it succeeds. ``existing``: ``get_coordinator(timeout=2)`` on the existing
coordinator. Outcomes go to ``OUTDIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Dict

import numpy as np


def main() -> None:
    out, data = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    result: Dict[str, Any] = {"steps": {}}
    try:
        import shardckpt
        from shardckpt import dtensor as dt
        from shardckpt.distributed import get_coordinator, set_coordinator

        def marker(step: str) -> str:
            return os.path.join(out, f"{step}.done")

        def save(step: str, options: Any) -> None:
            mesh = dt.create_distributed_mesh([("x", 2)])  # over the current coordinator
            value = dt.from_global(np.arange(8, dtype=np.float32), dt.Layout(["x"], mesh))
            dt.sharded_save(mesh, os.path.join(data, step), ["v"], [""], [value], options)

        def alone(step: str, timeout: Any, options: Any) -> None:
            """Client 0 saves; client 1 waits until client 0 is done with it."""
            set_coordinator(None)
            coordinator = get_coordinator(timeout=timeout)
            entry: Dict[str, Any] = {"coordinator_timeout": coordinator.timeout}
            if rank == 0:
                t0 = time.monotonic()
                try:
                    save(step, options)
                    entry["ok"] = True
                except Exception as e:  # judged by the test
                    entry.update(ok=False, type=type(e).__name__, message=str(e))
                entry["elapsed"] = time.monotonic() - t0
                with open(marker(step), "w"):
                    pass
            else:
                end = time.monotonic() + 120
                while not os.path.exists(marker(step)) and time.monotonic() < end:
                    time.sleep(0.05)
            result["steps"][step] = entry

        alone("env", None, None)
        alone("argument", 2.5, None)
        alone("option", 2.5, shardckpt.CheckpointOptions(timeout=1))

        set_coordinator(None)
        coordinator = get_coordinator(timeout=1)
        if rank == 1:
            time.sleep(2.5)  # longer than the coordinator's timeout, shorter than the save's
        t0 = time.monotonic()
        try:
            save("longer", shardckpt.CheckpointOptions(timeout=8))
            result["steps"]["longer"] = {"ok": True, "coordinator_timeout": coordinator.timeout}
        except Exception as e:  # judged by the test
            result["steps"]["longer"] = {"ok": False, "type": type(e).__name__, "message": str(e)}
        result["steps"]["longer"]["elapsed"] = time.monotonic() - t0

        get_coordinator(timeout=2)
        result["steps"]["existing"] = {"same": get_coordinator() is coordinator, "timeout": coordinator.timeout}
        result["done"] = True
    except Exception:
        result["fatal"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
