"""One client of tests/test_tier_spread.py, started by torchrun or mpiexec (4 clients, 3 nodes).

    tier_spread_worker.py OUTDIR DATADIR

Ranks 0 and 1 are node 1, rank 2 is node 0, rank 3 is node 2 (``SHARDCKPT_NODE``), each node with a
``LocalTier(DATADIR/tier/{node}, replicas=2, keep=1)``: every node's bundle is also on both other
nodes. A ``DVariable`` of shape (8, 6) sharded by rows over ``("x", 4)`` and a plain ``Variable`` are
saved twice (generations 1 and 2) through ``CheckpointManager(..., persist_every=5)``: nothing
persistent. Phase ``recover``: node 1's tier wiped, then a new model restores: node 1's two clients
read its bundle from its two holders at once, one from node 0's client and one from node 2's
(``last_restore.bytes_sent`` / ``bytes_received``), step 2 exactly; after ``sync()`` node 1's tier
holds its own bundle again and the replicas it held.

Phase ``one_server``: the same with ``replicas=1`` in ``DATADIR/tier1``: node 1's bundle is held by
node 2 alone, whose one client (rank 3) serves both of node 1's clients at once.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dtensor_worker as W  # noqa: E402  (tests/helpers)

SHAPE = (8, 6)
NODE_OF_RANK = {0: "1", 1: "1", 2: "0", 3: "2"}


def full(generation: int) -> np.ndarray:
    return np.arange(48, dtype=np.float32).reshape(SHAPE) + 100 * generation


def model_of(mesh, generation: int):
    import shardckpt
    from shardckpt import dtensor as dt

    model = shardckpt.Module()
    model.w = dt.DVariable.from_global(full(generation) if generation else np.zeros(SHAPE, np.float32),
                                       dt.Layout(["x", "unsharded"], mesh))
    model.plain = shardckpt.Variable(np.full(3, float(generation), np.float32))
    return model


def manager_for(model, data: str, replicas: int = 2):
    import shardckpt

    tier = shardckpt.LocalTier(os.path.join(data, "tier" if replicas == 2 else f"tier{replicas}", "{node}"),
                               replicas=replicas, keep=1)
    return shardckpt.CheckpointManager(shardckpt.Checkpoint(root=model), os.path.join(data, "persistent"),
                                       max_to_keep=2, local=tier, persist_every=5)


def recover(mesh, data: str, replicas: int = 2) -> Dict[str, Any]:
    model = model_of(mesh, 0)
    manager = manager_for(model, data, replicas)
    returned = manager.restore_or_initialize()
    last = manager.local.last_restore
    out = {"returned": returned, "step": last.step, "reason": last.reason, "bytes_received": last.bytes_received,
           "bytes_sent": last.bytes_sent, "mismatches": W.mismatches(model.w, full(2)),
           "plain": model.plain.numpy().tolist()}
    manager.sync()  # node 1's tier repopulated behind the restore
    W.result["coordinator"].barrier("repopulated")
    root = os.path.join(data, "tier" if replicas == 2 else f"tier{replicas}", "1")
    out["node1_tier"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return out


def run(data: str) -> None:
    from shardckpt import dtensor as dt

    coord = W.result["coordinator"]
    mesh = dt.create_distributed_mesh([("x", 4)])
    for replicas, phase in ((2, "recover"), (1, "one_server")):
        model = model_of(mesh, 1)
        manager = manager_for(model, data, replicas)
        W.phase(f"save1 {phase}", lambda manager=manager: str(manager.save()))
        model.w.assign(dt.from_global(full(2), model.w.layout))
        model.plain.assign(np.full(3, 2.0, np.float32))
        W.phase(f"save2 {phase}", lambda manager=manager: str(manager.save()))
        manager.sync()
        coord.barrier("saved")
        if coord.rank == 0:  # node 1 lost: its tier gone
            shutil.rmtree(os.path.join(data, "tier" if replicas == 2 else f"tier{replicas}", "1"))
        coord.barrier("node 1 lost")
        W.phase(phase, lambda replicas=replicas: recover(mesh, data, replicas))


if __name__ == "__main__":
    W.launched(run, node_of_rank=NODE_OF_RANK.__getitem__, register=True)
