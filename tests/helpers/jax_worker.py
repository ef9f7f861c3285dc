"""One process of a multi-process JAX job on CPU (tests/test_jax_multiprocess.py).

``python jax_worker.py MODE RANK SIZE PORT DIR`` joins the job with
``jax.distributed.initialize`` on loopback (2 CPU devices per process) and:

* ``save``: saves the state below (global mesh (2, 4) over 4 processes, or whatever
  SIZE gives) at ``DIR/ck`` through ``shardckpt.jax.save``, then again funnelled to
  process 0 (``DIR/ck_funnel``) and asynchronously (``DIR/ck_async``);
* ``restore``: restores ``DIR/ck`` onto a mesh of SIZE*2 devices with other specs,
  checks every addressable shard against the global values, and counts the bytes
  this process read (``LocalFileSystem.pread_into``) against what its shards need;
* ``coord``: exercises :class:`~shardckpt.distributed.jax_backend.JaxCoordinator` directly:
  barrier, all_gather, broadcast, send/recv, then a barrier the last rank reaches late,
  one rank 0 reaches late, and a barrier of another name on rank 1 (each must fail
  alike on every rank naming the right ranks, and leave the coordinator usable);
* ``hang`` / ``die``: all processes save ``ckpt-1`` through a ``CheckpointManager``,
  then the last rank sleeps past the others' timeout (``hang``) or exits at once
  (``die``) instead of saving ``ckpt-2``; the others report the error they got;
* ``replicated``: a replicated leaf ``params/extra`` (``P()``, written by process 0 alone)
  that not every process holds, through a ``CheckpointManager`` over a ``PyTreeCheckpoint``
  in ``DIR/mgr`` (cases ``only0``, ``only1``: only that process holds it; ``renamed``:
  process 1 names it ``params/extra2``), after a ``good`` save where everyone holds it; each
  outcome, and what the state file names as latest afterwards, go to the result.
* ``tiered`` (2 processes, each a node of its own: ``jax.process_index()``): six saves of the
  state (values times the step; the third asynchronous) through a ``CheckpointManager`` over a
  ``PyTreeCheckpoint`` with ``local=LocalTier(DIR/tier/{node}, replicas=1, keep=2)`` and
  ``persist_every=5``, then restores onto zeroed targets: ``intact`` (nothing lost), ``lost``
  (process 1 removes node 1's tier first), ``resharded`` (the restore mode's specs on a
  one-axis mesh), ``both_lost`` (both tiers removed); each phase's step, bytes between nodes,
  save counter, whether every addressable shard holds the step's values, and node 1's tier
  afterwards go to the result.

Each process writes ``DIR/result-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

MODE, RANK, SIZE, PORT, DIR = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=SIZE, process_id=RANK,
                           initialization_timeout=60)

import shardckpt  # noqa: E402
import shardckpt.jax as sj  # noqa: E402
from shardckpt.distributed.coordinator import CoordinationError  # noqa: E402
from shardckpt.storage.local import LocalFileSystem  # noqa: E402

# rows of column-sharded pieces are at least a page, so region reads are not coalesced with their neighbours
SHAPES = {"params/w": (512, 384), "params/b": (4224,), "params/r": (64, 4096), "opt/mu": (384, 512)}  # 3 and 4 divide


def global_values() -> dict:
    rng = np.random.default_rng(42)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def build(specs: dict, mesh_shape, names) -> dict:
    mesh = jax.make_mesh(mesh_shape, names)
    values = global_values()
    out: dict = {"params": {}, "opt": {}, "step": 5, "name": "run"}
    for name, spec in specs.items():
        value = values[name]
        group, leaf = name.split("/")
        out[group][leaf] = jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                                        lambda index, v=value: v[index])
    return out


SAVE_SPECS = {"params/w": P("x", "y"), "params/b": P("y"), "params/r": P(), "opt/mu": P("y", "x")}


def save_state() -> dict:
    n = len(jax.devices())
    return build(SAVE_SPECS, (2, n // 2), ("x", "y"))


def write(result: dict) -> None:
    with open(os.path.join(DIR, f"result-{RANK}.json"), "w") as f:
        json.dump(result, f)


def tiered() -> dict:
    import shutil

    from shardckpt.jax import default_coordinator

    coord = default_coordinator()
    values = global_values()
    restore_specs = {"params/w": P("d", None), "params/b": P(), "params/r": P(None, "d"), "opt/mu": P("d", None)}

    def state_at(step: int, specs: dict = SAVE_SPECS, one_axis: bool = False) -> dict:
        n = len(jax.devices())
        mesh = jax.make_mesh((n,), ("d",)) if one_axis else jax.make_mesh((2, n // 2), ("x", "y"))
        out: dict = {"params": {}, "opt": {}, "step": step, "name": f"run{step}"}
        for name, spec in specs.items():
            group, leaf = name.split("/")
            value = values[name] * step
            out[group][leaf] = jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                                            lambda index, v=value: v[index])
        return out

    def manager_of(ckpt):
        tier = shardckpt.LocalTier(os.path.join(DIR, "tier", "{node}"), replicas=1, keep=2)
        return shardckpt.CheckpointManager(ckpt, os.path.join(DIR, "persistent"), max_to_keep=2, local=tier,
                                           persist_every=5)

    ckpt = sj.PyTreeCheckpoint(state_at(1))
    manager = manager_of(ckpt)
    for step in range(1, 7):
        ckpt.state = state_at(step)
        asynchronous = shardckpt.CheckpointOptions(enable_async=True) if step == 3 else None
        manager.save(options=asynchronous)
    manager.sync()

    def restore(specs: dict = SAVE_SPECS, one_axis: bool = False) -> dict:
        ckpt = sj.PyTreeCheckpoint(jax.tree_util.tree_map(lambda a: a * 0 if hasattr(a, "sharding") else a,
                                                          state_at(1, specs, one_axis)))
        fresh = manager_of(ckpt)
        fresh.restore_or_initialize()
        last = fresh.local.last_restore
        step = int(ckpt.state["step"])
        exact = ckpt.state["name"] == f"run{step}"
        for name in specs:
            group, leaf = name.split("/")
            array = ckpt.state[group][leaf]
            for shard in array.addressable_shards:
                exact = exact and bool(np.array_equal(np.asarray(shard.data), (values[name] * step)[shard.index]))
        fresh.sync()
        coord.barrier("synced")
        node1 = os.path.join(DIR, "tier", "1")
        return {"step": step, "tier_step": last.step, "received": last.bytes_received, "sent": last.bytes_sent,
                "counter": int(ckpt.save_counter.array), "exact": exact,
                "node1": sorted(os.listdir(node1)) if os.path.isdir(node1) else []}

    phases = {"intact": restore()}
    coord.barrier("before loss")
    if RANK == 1:
        shutil.rmtree(os.path.join(DIR, "tier", "1"))
    coord.barrier("node 1 lost")
    phases["lost"] = restore()
    phases["resharded"] = restore(restore_specs, one_axis=True)
    coord.barrier("before both lost")
    shutil.rmtree(os.path.join(DIR, "tier", str(RANK)))
    coord.barrier("both lost")
    phases["both_lost"] = restore()
    return phases


def main() -> None:
    result: dict = {"rank": RANK, "devices": len(jax.devices()), "local": len(jax.local_devices())}
    if MODE == "save":
        state = save_state()
        sj.save(os.path.join(DIR, "ck"), state, timeout=60)
        # funnelled to process 0 (send_bytes / recv_bytes over the store), and in the background (a clone)
        sj.save(os.path.join(DIR, "ck_funnel"), state, options=shardckpt.CheckpointOptions(io_device="/task:0"),
                timeout=60)
        sj.save(os.path.join(DIR, "ck_async"), state, options=shardckpt.CheckpointOptions(enable_async=True),
                timeout=60)
        sj.wait_until_finished()
        result["ok"] = True
    elif MODE == "restore":
        counter = {"bytes": 0}
        original = LocalFileSystem.pread_into

        def counting(self, fd, buf, offset, path=""):
            counter["bytes"] += memoryview(buf).nbytes
            return original(self, fd, buf, offset, path)

        LocalFileSystem.pread_into = counting  # type: ignore[method-assign]
        mesh = jax.make_mesh((len(jax.devices()),), ("d",))
        specs = {"params/w": P("d", None), "params/b": P(), "params/r": P(None, "d"), "opt/mu": P("d", None)}
        target: dict = {"params": {}, "opt": {}, "step": 0, "name": ""}
        for name, spec in specs.items():
            group, leaf = name.split("/")
            target[group][leaf] = jax.ShapeDtypeStruct(SHAPES[name], np.float32, sharding=NamedSharding(mesh, spec))
        got = sj.restore(os.path.join(DIR, "ck"), target)
        values = global_values()
        need = 0
        for name in specs:
            group, leaf = name.split("/")
            array = got[group][leaf]
            assert array.sharding == target[group][leaf].sharding, name
            seen = set()
            for shard in array.addressable_shards:
                assert np.array_equal(np.asarray(shard.data), values[name][shard.index]), (name, shard.index)
                key = tuple((s.start, s.stop) for s in shard.index)
                if key not in seen:
                    seen.add(key)
                    need += shard.data.size * 4
        result.update(ok=True, step=got["step"], name=got["name"], bytes_read=counter["bytes"], bytes_needed=need,
                      bytes_total=sum(int(np.prod(s)) * 4 for s in SHAPES.values()))
    elif MODE == "coord":
        from shardckpt.distributed.jax_backend import JaxCoordinator

        c = JaxCoordinator(timeout=30)
        c.barrier("start")
        result["gathered"] = c.all_gather({"rank": RANK, "text": "é" * RANK})
        result["broadcast"] = c.broadcast({"from": "root"} if RANK == 1 else None, root=1)
        result["gather"] = c.gather({"rank": RANK, "text": "é" * RANK}, root=2)
        if RANK == 1:
            c.send_bytes(memoryview(bytes(range(200)) * 3), dst=0, tag=7)
        if RANK == 0:
            result["received"] = bytes(c.recv_bytes(1, 600, tag=7)) == bytes(range(200)) * 3
        outcomes = []
        for case, late in (("late last", SIZE - 1), ("late root", 0), ("other name", None)):
            if RANK == late:
                time.sleep(3.5)
            name = "elsewhere" if case == "other name" and RANK == 1 else case
            try:
                c.barrier(name, timeout=1.5)
                outcomes.append({"case": case, "ok": True})
            except CoordinationError as e:
                outcomes.append({"case": case, "ok": False, "missing": list(e.missing),
                                 "elsewhere": {str(k): v for k, v in e.elsewhere.items()}, "error": str(e)})
            c.barrier(f"after {case}", timeout=30)  # still usable
        result.update(ok=True, outcomes=outcomes)
    elif MODE in ("hang", "die"):
        state = save_state()
        ckpt = sj.PyTreeCheckpoint(state)
        manager = shardckpt.CheckpointManager(ckpt, DIR, max_to_keep=3)
        manager.save(options=shardckpt.CheckpointOptions(timeout=30))
        if RANK == SIZE - 1:
            if MODE == "die":
                os._exit(3)
            time.sleep(15)
            result["ok"] = True
        else:
            started = time.monotonic()
            try:
                manager.save(options=shardckpt.CheckpointOptions(timeout=4))
                result["ok"] = True
            except CoordinationError as e:
                result.update(ok=False, error=str(e), missing=list(e.missing),
                              seconds=time.monotonic() - started)
            result["latest"] = shardckpt.latest_checkpoint(DIR)
    elif MODE == "tiered":
        result.update(ok=True, phases=tiered())
    elif MODE == "replicated":
        extra = np.arange(12, dtype=np.float32) / 4

        def state_for(case: str) -> dict:
            state = save_state()
            mesh = state["params"]["w"].sharding.mesh
            leaf = jax.make_array_from_callback(extra.shape, NamedSharding(mesh, P()), lambda index: extra[index])
            if case == "good" or (case == "only0" and RANK == 0) or (case == "only1" and RANK == 1):
                state["params"]["extra"] = leaf
            elif case == "renamed":
                state["params"]["extra2" if RANK == 1 else "extra"] = leaf
            return state

        outcomes = {}
        for case in ("good", "only0", "only1", "renamed"):
            manager = shardckpt.CheckpointManager(sj.PyTreeCheckpoint(state_for(case)), os.path.join(DIR, "mgr"),
                                                  max_to_keep=5, checkpoint_name=case)
            try:
                manager.save(options=shardckpt.CheckpointOptions(timeout=60))
                outcomes[case] = {"ok": True}
            except Exception as e:  # judged by the test
                outcomes[case] = {"ok": False, "type": type(e).__name__, "message": str(e)}
        result.update(ok=True, outcomes=outcomes, latest=shardckpt.latest_checkpoint(os.path.join(DIR, "mgr")))
    write(result)


if __name__ == "__main__":
    main()
