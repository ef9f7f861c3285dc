"""One client of tests/test_tiers_multiclient.py, started by torchrun or mpiexec (4 clients).

    tiers_worker.py OUTDIR DATADIR

Four clients as two simulated nodes: ``SHARDCKPT_NODE`` is set to ``rank // 2`` (clients 0, 1 on
node 0; 2, 3 on node 1) before anything is built. Every client builds the model of
manager_worker.py (DVariables of every layout of ``dtensor_worker.VARS`` on
``create_distributed_mesh([("x", 2), ("y", 4)])`` and a plain ``Variable``), a
``LocalTier(DATADIR/tier/{node}, replicas=1, keep=2)`` and a
``CheckpointManager(DATADIR/persistent, max_to_keep=3, local=tier, persist_every=5)``. Phases:

* ``save1`` .. ``save6``: generation ``g`` saved by save ``g``;
* ``restore_nothing_wiped``: a new model and manager run ``restore_or_initialize`` (step 6);
* ``restore_other_layout``: every variable in another layout (``dtensor_worker.OTHER_24``): a client's
  new pieces were saved partly by the other node; each node holds both bundles (its own and the
  replica), so every client restores step 6 from a merged view of them;
* ``restore_node1_wiped``: node 1's leader (client 2) removes node 1's whole tier first (after a
  barrier); then the same restore (step 6, node 1's bundle from node 0's replica; behind it node
  1's tier gets its own bundle and the replica it held of node 0's back);
* ``restore_node0_wiped_next``: node 0's whole tier removed (client 0), no save since: the same
  restore (step 6, node 0's bundle from the replica node 1 got back);
* ``replica_fault``: a new manager restores step 6; then a directory stands where node 1 must
  write node 0's replica of step 7 (``tier/1/node-0/ckpt-7.index``): the save of generation 7
  must fail on every client; then the files are looked at (no marker of step 7 anywhere) and the fault removed;
* ``restore_after_fault``: a restore gives step 6 again;
* ``save7``: generation 7 saved (step 7: every bundle and replica in place again);
* ``restore_own_bundles_lost``: each node's own bundles removed, the replicas kept: each node
  holds what the other lost, so the bundles move both ways first (files, over the lanes), then
  every client restores step 7 from its own tier;
* ``restore_damaged_replica``: node 1's tier removed again and a byte of every data file of node
  0's replica of node 1's step 7 flipped: node 1's clients fail its checksums while they restore
  from the replica, so every client restores the persistent ``ckpt-5`` (never a mix of steps);
* ``restore_both_wiped``: both tiers removed: the restore gives the persistent ``ckpt-5``;
* ``async_save6``, ``async_save7``: a new manager restores step 5, then saves generations 6 and 7
  with ``CheckpointOptions(enable_async=True)``, the values clobbered right after each return,
  then ``sync()``; ``restore_after_async`` gives step 7 exactly, from the tiers.

Each restore phase records what ``restore_or_initialize`` returned, the tier's
``last_restore``, the bytes this client passed to ``send_bytes`` / ``send_many`` during the call
(on its thread or a holder's serving thread: every byte that crossed between clients outside the
collectives) and on the checkpoint's saver thread behind it (``sent_behind``: a lost node's tier
repopulated, until ``sync()``), the reads
of files under the persistent directory (opens and bytes), the mismatches against the expected
generation and the tier's ``last_save_error`` after ``sync()``.
Results go to ``OUTDIR/rank<R>.json``.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from typing import Any, Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dtensor_worker as W  # noqa: E402  (tests/helpers)
import manager_worker as M  # noqa: E402  (tests/helpers)

SAVES = 6
PERSIST_EVERY = 5
COUNTS: Dict[str, int] = {"sent": 0, "sent_behind": 0, "persistent_opens": 0, "persistent_bytes": 0}


def count(coordinator, persistent: str) -> None:
    """Count bytes this client sends point-to-point, and its reads of files under ``persistent``."""
    from shardckpt.storage.local import LocalFileSystem

    send, send_many = type(coordinator).send_bytes, type(coordinator).send_many
    depth = [0]  # send_many may send through send_bytes: its bytes counted once

    def counter() -> str:  # the call (its thread, or a holder's serving thread), or the work behind it
        behind = threading.current_thread().name.startswith("shardckpt-async-save")  # the checkpoint's saver thread
        return "sent_behind" if behind else "sent"

    def sending(self, data, dst, tag=0):
        if not depth[0]:
            COUNTS[counter()] += memoryview(data).nbytes
        return send(self, data, dst, tag)

    def sending_many(self, buffers, dst, tag=0):
        COUNTS[counter()] += sum(memoryview(b).nbytes for b in buffers)
        depth[0] += 1
        try:
            return send_many(self, buffers, dst, tag)
        finally:
            depth[0] -= 1

    type(coordinator).send_bytes = sending
    type(coordinator).send_many = sending_many
    open_read, pread = LocalFileSystem.open_read, LocalFileSystem.pread_into

    def opening(self, path, *args, **kwargs):
        if os.path.abspath(str(path)).startswith(persistent):
            COUNTS["persistent_opens"] += 1
        return open_read(self, path, *args, **kwargs)

    def reading(self, fd, buf, offset, path=""):
        if os.path.abspath(str(path)).startswith(persistent):
            COUNTS["persistent_bytes"] += memoryview(buf).nbytes
        return pread(self, fd, buf, offset, path)

    LocalFileSystem.open_read = opening
    LocalFileSystem.pread_into = reading


def manager_for(model, data: str):
    import shardckpt

    tier = shardckpt.LocalTier(os.path.join(data, "tier", "{node}"), replicas=1, keep=2)
    return shardckpt.CheckpointManager(shardckpt.Checkpoint(root=model), os.path.join(data, "persistent"),
                                       max_to_keep=3, local=tier, persist_every=PERSIST_EVERY)


def restore_phase(mesh, data: str, expected: int, layouts: Any = None) -> Dict[str, Any]:
    """A new model (every variable in ``layouts`` when given, e.g. ``W.OTHER_24``) restored through the
    tiers: what the restore did and the values it gave."""
    import shardckpt

    if layouts is None:
        model, variables = M.build_model(mesh, 0)
    else:
        model, variables = shardckpt.Module(), W.zero_dvariables(mesh, layouts)
        for name, var in variables.items():
            setattr(model, name, var)
        model.plain = shardckpt.Variable(np.zeros((3, 4), np.float32))
    manager = manager_for(model, data)
    before = dict(COUNTS)
    returned = manager.restore_or_initialize()
    last = manager.local.last_restore
    out = {"returned": returned, "step": last.step, "reason": last.reason, "bytes_received": last.bytes_received,
           "bytes_sent": last.bytes_sent, "save_counter": int(manager.checkpoint.save_counter.numpy())}
    out.update(M.check_values(model, variables, expected))
    manager.sync()  # what runs behind the restore (a lost node's tier repopulated) ends here
    out.update({k: COUNTS[k] - before[k] for k in COUNTS})
    out["error_behind"] = manager.local.last_save_error
    out["files"] = tier_files(data) if W.result["coordinator"].rank == 0 else None
    return out


def lose_node(mesh, data: str, node: int, phase: str, files_phase: str) -> None:
    """Node ``node``'s whole tier removed by its leader; then a restore (``phase``), then the tiers' files once
    what runs behind it is done (``files_phase``)."""
    coord = W.result["coordinator"]
    coord.barrier(f"wipe node {node}")
    if coord.rank == 2 * node:
        shutil.rmtree(os.path.join(data, "tier", str(node)))
    coord.barrier(f"wiped node {node}")
    W.phase(phase, lambda: restore_phase(mesh, data, SAVES))
    coord.barrier(f"repopulated node {node}")
    W.phase(files_phase, lambda: tier_files(data) if coord.rank == 0 else None)


def tier_files(data: str) -> Dict[str, list]:
    root = os.path.join(data, "tier")
    out: Dict[str, list] = {}
    for folder, _, names in os.walk(root):
        out[os.path.relpath(folder, root)] = sorted(names)
    return out


def run(data: str) -> None:
    from shardckpt import dtensor as dt

    coord = W.result["coordinator"]
    rank = coord.rank
    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
    model, variables = M.build_model(mesh, 1)
    manager = manager_for(model, data)
    for generation in range(1, SAVES + 1):
        W.set_generation(variables, model.plain, generation)
        W.phase(f"save{generation}", lambda: str(manager.save()))
    manager.sync()  # a save returns once committed; each node's leader drops its older steps behind it
    coord.barrier("saved")
    W.phase("files_after_saves", lambda: tier_files(data) if rank == 0 else None)
    W.phase("restore_nothing_wiped", lambda: restore_phase(mesh, data, SAVES))
    W.phase("restore_other_layout", lambda: restore_phase(mesh, data, SAVES, W.OTHER_24))

    lose_node(mesh, data, 1, "restore_node1_wiped", "files_after_repopulation")
    lose_node(mesh, data, 0, "restore_node0_wiped_next", "files_after_second_loss")  # no save since the first

    model7, variables7 = M.build_model(mesh, 0)
    manager7 = manager_for(model7, data)
    W.phase("fault_restore", lambda: manager7.restore_or_initialize())
    fault = os.path.join(data, "tier", "1", "node-0", f"ckpt-{SAVES + 1}.index")
    if rank == 2:
        os.makedirs(fault)
    coord.barrier("fault placed")
    W.set_generation(variables7, model7.plain, SAVES + 1)
    W.phase("replica_fault", lambda: str(manager7.save()))
    W.phase("after_fault", lambda: {"save_counter": int(manager7.checkpoint.save_counter.numpy()),
                                    "files": tier_files(data) if rank == 0 else None})
    coord.barrier("fault seen")
    if rank == 2:
        os.rmdir(fault)
    coord.barrier("fault removed")
    W.phase("restore_after_fault", lambda: restore_phase(mesh, data, SAVES))

    W.phase("save7", lambda: str(manager7.save()))  # generation 7 again, now with every replica in place
    manager7.sync()
    coord.barrier("own bundles lost")
    if rank in (0, 2):  # each node loses its own bundles and keeps the replica it holds of the other's
        shutil.rmtree(os.path.join(data, "tier", str(rank // 2), f"node-{rank // 2}"))
    coord.barrier("own bundles removed")
    W.phase("restore_own_bundles_lost", lambda: restore_phase(mesh, data, SAVES + 1))
    coord.barrier("own bundles back")
    W.phase("files_after_own_bundles_lost", lambda: tier_files(data) if rank == 0 else None)

    coord.barrier("wipe node 1 again")
    if rank == 2:
        shutil.rmtree(os.path.join(data, "tier", "1"))
    if rank == 0:  # the first byte of every data file of node 0's replica of node 1's step 7, flipped
        replica = os.path.join(data, "tier", "0", "node-1")
        for name in sorted(os.listdir(replica)):
            if name.startswith(f"ckpt-{SAVES + 1}.data-"):
                with open(os.path.join(replica, name), "r+b") as f:
                    byte = f.read(1)
                    f.seek(0)
                    f.write(bytes([byte[0] ^ 0x01]))
    coord.barrier("replica damaged")
    W.phase("restore_damaged_replica", lambda: restore_phase(mesh, data, PERSIST_EVERY))

    coord.barrier("wipe both")
    if rank in (0, 2):
        shutil.rmtree(os.path.join(data, "tier", str(rank // 2)), ignore_errors=True)  # node 1: gone already
    coord.barrier("wiped both")
    W.phase("restore_both_wiped", lambda: restore_phase(mesh, data, PERSIST_EVERY))

    modela, variablesa = M.build_model(mesh, 0)
    managera = manager_for(modela, data)
    W.phase("async_restore", lambda: managera.restore_or_initialize())
    options = shardckpt_options(enable_async=True)
    for generation in (PERSIST_EVERY + 1, PERSIST_EVERY + 2):
        W.set_generation(variablesa, modela.plain, generation)

        def save_async():
            path = str(managera.save(options=options))
            W.set_generation(variablesa, modela.plain, W.CLOBBER_GEN)  # after the return: not in the step
            return path

        W.phase(f"async_save{generation}", save_async)
    W.phase("async_sync", managera.sync)
    W.phase("restore_after_async", lambda: restore_phase(mesh, data, PERSIST_EVERY + 2))


def shardckpt_options(**kwargs: Any) -> Any:
    import shardckpt

    return shardckpt.CheckpointOptions(**kwargs)


def counted(data: str) -> None:
    count(W.result["coordinator"], os.path.join(data, "persistent"))
    run(data)


if __name__ == "__main__":
    W.launched(counted, node_of_rank=lambda rank: rank // 2, register=True)
