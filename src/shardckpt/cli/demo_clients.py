"""The client processes of ``shardckpt demo``: a small model sharded over a mesh, trained and checkpointed.

The model minimises ``0.5 * ||W - T||^2`` for a few weight matrices ``W`` (targets
``T`` fixed by a seed) by gradient descent, each client updating only its own
components: ``W <- W - lr * (W - T)``. Elementwise float32 arithmetic makes every
step reproducible bit for bit, so the parent can check the restored values
exactly by replaying the steps on full arrays.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..storage.base import FileSystem
from ..storage.registry import get_fs

LR = np.float32(0.25)
# name -> (global shape, layout on the first mesh (x=2, y=4), layout on the second mesh (a=4))
WEIGHTS: Dict[str, Tuple[Tuple[int, ...], List[str], List[str]]] = {
    "embedding": ((1024, 256), ["y", "unsharded"], ["unsharded", "a"]),
    "dense1/kernel": ((256, 512), ["x", "y"], ["a", "unsharded"]),
    "dense1/bias": ((512,), ["y"], ["unsharded"]),
    "dense2/kernel": ((512, 128), ["x", "unsharded"], ["unsharded", "unsharded"]),
}


def initial(name: str) -> np.ndarray:
    shape = WEIGHTS[name][0]
    seed = sum(name.encode())
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def target(name: str) -> np.ndarray:
    shape = WEIGHTS[name][0]
    seed = 1000 + sum(name.encode())
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def step(value: np.ndarray, goal: np.ndarray) -> None:
    """One gradient step on 0.5*||W-T||^2, in place."""
    value -= LR * (value - goal)


def expected(name: str, steps: int) -> np.ndarray:
    value = initial(name)
    goal = target(name)
    for _ in range(steps):
        step(value, goal)
    return value


def _build(mesh: Any, which: int) -> Tuple[Any, Dict[str, Any], Any]:
    import shardckpt
    from shardckpt import dtensor

    model = shardckpt.Module()
    goals = {}
    for name, (shape, first, second) in WEIGHTS.items():
        layout = dtensor.Layout(first if which == 0 else second, mesh)
        start = initial(name) if which == 0 else np.zeros(shape, np.float32)
        variable = dtensor.DVariable.from_global(start, layout, name=name)
        setattr(model, name.replace("/", "_"), variable)
        goals[name] = dtensor.from_global(target(name), layout)
    step_counter = shardckpt.Variable(np.int64(0), name="step")
    return model, goals, step_counter


def run_client(group: Any, rank: int, phase: Dict[str, Any], out_dir: str) -> None:
    """One client of one phase: restore (if asked), train, checkpoint every few steps; report timings."""
    from shardckpt import dtensor
    from shardckpt.checkpoint.state import latest_checkpoint
    from shardckpt.distributed.local import LocalProcessCoordinator
    from shardckpt.distributed.select import set_coordinator

    coordinator = LocalProcessCoordinator(group, rank, timeout=120.0)
    set_coordinator(coordinator)
    mesh = dtensor.create_distributed_mesh(phase["mesh"], client_id=rank, num_clients=group.size)
    model, goals, step_counter = _build(mesh, phase["which"])
    ckpt = dtensor.DTensorCheckpoint(mesh, model=model, step=step_counter, coordinator=coordinator)
    events: List[Dict[str, Any]] = []
    directory = phase["directory"]
    fs = get_fs(directory)
    if phase["resume"]:
        path = latest_checkpoint(directory)
        started = time.perf_counter()
        ckpt.restore(path).assert_consumed()
        events.append({"event": "restore", "path": fs.basename(path or ""), "step": int(step_counter.numpy()),
                       "seconds": time.perf_counter() - started})
    for _ in range(phase["steps"]):
        for name in WEIGHTS:
            variable = getattr(model, name.replace("/", "_"))
            goal = goals[name]
            for device, component in variable.value().components.items():
                step(component, goal.components[device])
        step_counter.assign_add(1)
        if int(step_counter.numpy()) % phase["every"] == 0:
            started = time.perf_counter()
            path = ckpt.save(fs.join(directory, "ckpt"))
            events.append({"event": "save", "path": fs.basename(path), "step": int(step_counter.numpy()),
                           "seconds": time.perf_counter() - started})
    local_bytes = sum(c.nbytes for name in WEIGHTS
                      for c in getattr(model, name.replace("/", "_")).value().components.values())
    report = {"rank": rank, "events": events, "devices": mesh.local_device_ids(), "local_bytes": local_bytes}
    reports = get_fs(out_dir)
    reports.write_atomic(_report_path(reports, out_dir, phase, rank), json.dumps(report).encode("utf-8"))


def _report_path(fs: FileSystem, out_dir: str, phase: Dict[str, Any], rank: int) -> str:
    return fs.join(out_dir, f"client-{phase['name']}-{rank}.json")


def launch(size: int, phase: Dict[str, Any], out_dir: str, timeout: float = 300.0) -> List[Dict[str, Any]]:
    """Start ``size`` client processes for ``phase`` and wait for them; return their reports."""
    import multiprocessing

    from shardckpt.distributed.local import local_group

    ctx = multiprocessing.get_context("spawn")
    group = local_group(size, ctx)
    procs = [ctx.Process(target=run_client, args=(group, r, phase, out_dir), name=f"client-{r}") for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    failed = [p.name for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        raise RuntimeError(f"demo clients failed: {failed}")
    fs = get_fs(out_dir)
    return [json.loads(fs.read_bytes(_report_path(fs, out_dir, phase, r))) for r in range(size)]


def names() -> Sequence[str]:
    return list(WEIGHTS)
