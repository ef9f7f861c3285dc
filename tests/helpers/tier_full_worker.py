"""One client of tests/test_tier_full.py, started by torchrun or mpiexec (2 clients, 2 nodes).

    tier_full_worker.py OUTDIR DATADIR

Rank 0 is node 0, rank 1 node 1 (``SHARDCKPT_NODE``), a ``DVariable`` of 1 MiB replicated on both,
each node with ``LocalTier(DATADIR/tier/{node}, replicas=1, keep=1)``; the test mounted a 3.5 MiB
tmpfs at ``DATADIR/tier/1`` (node 1's RAM disk), where one step (node 1's bundle of the value and
node 0's replica of it) fits, and node 1's bundle of the next step beside it, but not node 0's
replica of that step. Phases: ``save1`` (step 1 committed on both nodes); ``save2`` (fails on both
clients: node 1's tier is full); ``after`` (what both tiers hold: step 1 whole, nothing of step 2);
``restore`` (a new manager restores step 1 from the tiers, exactly).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dtensor_worker as W  # noqa: E402  (tests/helpers)

N = 1 << 18  # float32 values: 1 MiB


def manager_for(mesh, data: str, generation: int):
    import shardckpt
    from shardckpt import dtensor as dt

    # replicated on both clients: each node's bundle holds all of it (1 MiB), and so does its replica
    value = dt.DVariable.from_global(np.full(N, float(generation), np.float32), dt.Layout(["unsharded"], mesh))
    tier = shardckpt.LocalTier(os.path.join(data, "tier", "{node}"), replicas=1, keep=1)
    return value, shardckpt.CheckpointManager(shardckpt.Checkpoint(v=value), os.path.join(data, "persistent"),
                                              max_to_keep=1, local=tier, persist_every=5)


def holdings(data: str) -> Dict[str, Any]:
    out = {}
    for node in ("0", "1"):
        root = os.path.join(data, "tier", node)
        out[node] = sorted(os.path.join(sub, name) for sub in os.listdir(root)
                           for name in os.listdir(os.path.join(root, sub)))
    return out


def run(data: str) -> None:
    from shardckpt import dtensor as dt

    coord = W.result["coordinator"]
    mesh = dt.create_distributed_mesh([("x", 2)])
    value, manager = manager_for(mesh, data, 1)
    W.phase("save1", lambda: str(manager.save()))
    value.assign(dt.from_global(np.full(N, 2.0, np.float32), value.layout))
    W.phase("save2", lambda: str(manager.save()))
    manager.sync()  # what runs behind a save (retention) has run
    coord.barrier("saved")
    W.phase("after", lambda: holdings(data))
    coord.barrier("looked")
    restored, again = manager_for(mesh, data, 0)

    def restore() -> Dict[str, Any]:
        returned = again.restore_or_initialize()
        return {"returned": returned, "step": again.local.last_restore.step,
                "mismatches": W.mismatches(restored, np.full(N, 1.0, np.float32))}

    W.phase("restore", restore)


if __name__ == "__main__":
    W.launched(run, node_of_rank=str, register=True)
