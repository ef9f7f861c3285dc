"""One client of tests/test_tier_reshard.py, started by torchrun or mpiexec (3 clients, 3 nodes).

    tier_reshard_worker.py OUTDIR DATADIR

Each client is a simulated node of its own (``SHARDCKPT_NODE`` = its rank), with a
``LocalTier(DATADIR/tier/{node}, replicas=1, keep=1)``: node ``k``'s tier holds its own bundle
and the replica of node ``k-1``'s, so it lacks one of the three bundles of a step. A
``DVariable`` of shape (6, 6) sharded by rows over the mesh ``("x", 3)`` and a plain ``Variable``
are saved twice (generations 1 and 2) through ``CheckpointManager(..., persist_every=5)``: nothing
persistent. Phases:

* ``restore_columns``: a new model holds the variable sharded by *columns*: each client's
  new piece (every row, two columns) was saved by all three nodes. The restore must give step 2
  exactly from the tiers (there is nothing else): each node first gets the bundle it lacks
  (``last_restore.bytes_received``), then restores from a merged view of the three;
* ``restore_rows``: the saved layout again: step 2 from each node's own bundle, no byte moved;
  then each node drops the bundle ``restore_columns`` brought it (back to what the saves left);
* ``restore_columns_lost``: node 1's tier wiped, then the columns again: node 1's client finds,
  from its replica's index on node 2, that it restores pieces that bundle lacks; every node gets
  the bundles it lacks (node 1 all three), then restores step 2 from a merged view; then back to
  what the saves left.

``tier_reshard_worker.py shrink OUTDIR DATADIR`` (2 clients, nodes 0 and 1: node 2 is gone), on the
same DATADIR afterwards:

* ``restore_shrunk``: the variable sharded by rows over ``("x", 2)``: step 2, saved by the job of
  nodes 0, 1, 2, is whole between nodes 0 (its own bundle, node 2's replica) and 1 (its own,
  node 0's replica): each gets what it lacks, then restores from a merged view;
* ``save3`` and ``restore_own``: generation 3 saved by this job, then restored from its own tiers.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dtensor_worker as W  # noqa: E402  (tests/helpers)

SHAPE = (6, 6)


def full(generation: int) -> np.ndarray:
    return np.arange(36, dtype=np.float32).reshape(SHAPE) + 100 * generation


def model_of(mesh, spec, generation: int):
    import shardckpt
    from shardckpt import dtensor as dt

    model = shardckpt.Module()
    model.w = dt.DVariable.from_global(full(generation) if generation else np.zeros(SHAPE, np.float32),
                                       dt.Layout(spec, mesh))
    model.plain = shardckpt.Variable(np.full(3, float(generation), np.float32))
    return model


def manager_for(model, data: str):
    import shardckpt

    tier = shardckpt.LocalTier(os.path.join(data, "tier", "{node}"), replicas=1, keep=1)
    return shardckpt.CheckpointManager(shardckpt.Checkpoint(root=model), os.path.join(data, "persistent"),
                                       max_to_keep=2, local=tier, persist_every=5)


def restore(mesh, data: str, spec, generation: int = 2) -> Dict[str, Any]:
    model = model_of(mesh, spec, 0)
    manager = manager_for(model, data)
    returned = manager.restore_or_initialize()
    last = manager.local.last_restore
    out = {"returned": returned, "step": last.step, "reason": last.reason, "bytes_received": last.bytes_received,
           "bytes_sent": last.bytes_sent,
           "mismatches": W.mismatches(model.w, full(generation)),
           "plain": model.plain.numpy().tolist()}
    manager.sync()
    coord = W.result["coordinator"]
    root = os.path.join(data, "tier", str(coord.rank))
    out["tier"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return out


def run(data: str) -> None:
    from shardckpt import dtensor as dt

    mesh = dt.create_distributed_mesh([("x", 3)])
    model = model_of(mesh, ["x", "unsharded"], 1)
    manager = manager_for(model, data)
    W.phase("save1", lambda: str(manager.save()))
    model.w.assign(dt.from_global(full(2), model.w.layout))
    model.plain.assign(np.full(3, 2.0, np.float32))
    W.phase("save2", lambda: str(manager.save()))
    manager.sync()
    W.phase("restore_columns", lambda: restore(mesh, data, ["unsharded", "x"]))
    W.phase("restore_rows", lambda: restore(mesh, data, ["x", "unsharded"]))
    coord = W.result["coordinator"]
    as_saved(coord, data)
    if coord.rank == 1:  # node 1 lost: its tier gone
        shutil.rmtree(os.path.join(data, "tier", "1"))
    coord.barrier("node 1 lost")
    W.phase("restore_columns_lost", lambda: restore(mesh, data, ["unsharded", "x"]))
    as_saved(coord, data)


def as_saved(coord, data: str) -> None:
    """Each node back to what the saves left: its own bundle and node k-1's (a restore brought it the third)."""
    coord.barrier("restored")
    lacked = (coord.rank + 1) % 3
    shutil.rmtree(os.path.join(data, "tier", str(coord.rank), f"node-{lacked}"), ignore_errors=True)
    coord.barrier("as saved")


def shrink(data: str) -> None:
    from shardckpt import dtensor as dt

    mesh = dt.create_distributed_mesh([("x", 2)])
    W.phase("restore_shrunk", lambda: restore(mesh, data, ["x", "unsharded"]))
    model = model_of(mesh, ["x", "unsharded"], 3)
    manager = manager_for(model, data)
    W.phase("save3", lambda: str(manager.save(checkpoint_number=3)))
    manager.sync()
    W.phase("restore_own", lambda: restore(mesh, data, ["x", "unsharded"], 3))


if __name__ == "__main__":
    shrunk = len(sys.argv) > 3 and sys.argv[1] == "shrink"
    if shrunk:
        del sys.argv[1]
    W.launched(shrink if shrunk else run, node_of_rank=lambda rank: rank, register=True)
