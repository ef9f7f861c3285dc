"""One process of tests/test_jax_multiprocess.py's JAX-over-MPI tiers test, started by mpiexec (2 ranks).

    jax_mpi_tier_worker.py DIR PORT

Each rank joins a JAX job (``jax.distributed.initialize`` on loopback, its MPI rank as process id,
2 CPU devices) and is a node of its own (``SHARDCKPT_NODE``). A ``PyTreeCheckpoint`` whose coordinator
is an ``MPICoordinator`` (what the README advises for large states: the bytes between nodes then
travel over MPI, not JAX's key-value store) saves steps 1-3 into ``LocalTier(DIR/t/{node})`` with
``persist_every=5`` (nothing persistent). Rank 1 then removes node 1's tier, and a fresh checkpoint
restores: rank 1 reads node 0's replica over MPI. Each rank writes ``DIR/result-<rank>.json``: the
coordinator's backend, the tier step restored, the bytes received and sent, whether every addressable
shard holds step 3's values, and the restored ``step`` leaf.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

DIR, PORT = sys.argv[1], int(sys.argv[2])
RANK, SIZE = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["SHARDCKPT_NODE"] = str(RANK)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=SIZE, process_id=RANK,
                           initialization_timeout=60)

import shardckpt  # noqa: E402
import shardckpt.jax as sj  # noqa: E402
from shardckpt.distributed.mpi_backend import MPICoordinator  # noqa: E402

BASE = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)


def state(step: int) -> dict:
    mesh = jax.make_mesh((2 * SIZE,), ("x",))
    value = BASE * step
    return {"w": jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda index: value[index]),
            "step": step}


def manager_of(ckpt: sj.PyTreeCheckpoint) -> shardckpt.CheckpointManager:
    return shardckpt.CheckpointManager(ckpt, os.path.join(DIR, "p"), max_to_keep=2, persist_every=5,
                                       local=shardckpt.LocalTier(os.path.join(DIR, "t", "{node}")))


def main() -> None:
    coord = MPICoordinator(timeout=60)
    ckpt = sj.PyTreeCheckpoint(state(1), coordinator=coord)
    manager = manager_of(ckpt)
    for step in range(1, 4):
        ckpt.state = state(step)
        manager.save()
    manager.sync()
    coord.barrier("saved")
    if RANK == 1:
        shutil.rmtree(os.path.join(DIR, "t", "1"))
    coord.barrier("node 1 lost")
    fresh = sj.PyTreeCheckpoint(state(0), coordinator=coord)
    again = manager_of(fresh)
    again.restore_or_initialize()
    last = again.local.last_restore
    exact = all(np.array_equal(np.asarray(shard.data), (BASE * 3)[shard.index])
                for shard in fresh.state["w"].addressable_shards)
    again.sync()
    coord.barrier("done")
    with open(os.path.join(DIR, f"result-{RANK}.json"), "w") as f:
        json.dump({"backend": coord.backend, "tier_step": last.step, "received": last.bytes_received,
                   "sent": last.bytes_sent, "exact": exact, "step": int(fresh.state["step"])}, f)


if __name__ == "__main__":
    main()
