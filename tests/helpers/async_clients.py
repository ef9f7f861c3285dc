"""Helper of tests/test_async.py: one client of a multi-client *asynchronous* DTensor checkpoint.

Started either by the test through :mod:`multiprocessing` (``run_local``, with the stdlib
``LocalProcessCoordinator``) or by a launcher::

    torchrun --nproc-per-node 4 async_clients.py OUT_DIR CKPT_DIR PHASES
    mpiexec -n 4 python async_clients.py OUT_DIR CKPT_DIR PHASES

(then the coordinator is ``get_coordinator()``'s: torch or MPI). Four clients hold a
small model of DVariables on a 2x4 mesh (the ``shardckpt demo`` model) and train it with
gradient steps; every step ends with a training-like collective on the *main*
coordinator (``all_gather`` of a local checksum, a ``barrier``, and under torch/MPI an
``all_reduce`` on the default group / ``COMM_WORLD``), while asynchronous saves run in
the background on the coordinator's clone. Phases (comma-separated ``PHASES``):

* ``train``: 12 steps, an async ``DTensorCheckpoint.save`` every 3 steps (ckpt-1..4), the
  components changed right after each save returns; background writes slowed down so
  that the collectives of the next steps overlap the save.
* ``fail``: rank 2's background writes fail with ``ENOSPC`` for one save (ckpt-5): every
  client must get ``AsyncSaveError`` at ``sync()``, roll the counter back and keep
  ckpt-4 the latest; the next save (ckpt-5 again) succeeds everywhere.
* ``funnel``: an async save with ``io_device`` = client 0 (the others send it their values).
* ``funnel-budget``: the same with ``async_staging_bytes`` smaller than a client's state.

After each phase every client writes ``OUT_DIR/rank<R>-<phase>.json``: what it saw (paths,
counters, errors, overlaps). The test checks them and reads the checkpoints itself.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Dict, List

import numpy as np

SLOW_WRITE = 0.01  # seconds per background write call
STEPS = 12
EVERY = 3


def _write_json(out_dir: str, rank: int, phase: str, data: Dict[str, Any]) -> None:
    path = os.path.join(out_dir, f"rank{rank}-{phase}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, default=str)
    os.replace(path + ".tmp", path)


class _Faults:
    """Serves local paths, for the life of the process, through a wrapper that slows and/or fails
    background writes."""

    def __init__(self) -> None:
        from shardckpt.storage.local import local_fs
        from shardckpt.storage.registry import mounted
        from shardckpt.storage.wrappers import FileSystemWrapper

        self.slow = 0.0
        self.fail = False
        self.calls = 0
        faults = self

        class Faulty(FileSystemWrapper):
            def before(self, op: str, path: str) -> None:
                if op == "write_all" and threading.current_thread() is not threading.main_thread():
                    faults.calls += 1
                    if faults.fail:
                        raise OSError(errno.ENOSPC, "No space left on device (injected)")
                    if faults.slow:
                        time.sleep(faults.slow)

        self.mount = mounted(Faulty(local_fs))  # kept referenced: for the life of the process
        self.mount.__enter__()


def _user_collective(coordinator: Any) -> Any:
    """The training loop's own collective on the default group (torch / MPI), if any."""
    if coordinator.backend == "torch":
        import torch
        import torch.distributed as dist

        def reduce(x: float) -> float:
            t = torch.tensor([x], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t.item())
        return reduce
    if coordinator.backend == "mpi":
        from mpi4py import MPI

        return lambda x: float(MPI.COMM_WORLD.allreduce(x))
    return None


def run(coordinator: Any, out_dir: str, ckpt_dir: str, phases: List[str]) -> None:
    import shardckpt
    from shardckpt import dtensor
    from shardckpt.checkpoint.state import latest_checkpoint
    from shardckpt.cli.demo_clients import WEIGHTS, initial, step, target
    from shardckpt.saving.async_save import AsyncSaveError

    rank, size = coordinator.rank, coordinator.size
    faults = _Faults()
    user_reduce = _user_collective(coordinator)
    mesh = dtensor.create_distributed_mesh([("x", 2), ("y", 4)], client_id=rank, num_clients=size)
    model = shardckpt.Module()
    goals = {}
    for name, (_, first, _) in WEIGHTS.items():
        layout = dtensor.Layout(first, mesh)
        setattr(model, name.replace("/", "_"), dtensor.DVariable.from_global(initial(name), layout, name=name))
        goals[name] = dtensor.from_global(target(name), layout)
    step_counter = shardckpt.Variable(np.int64(0), name="step")
    ckpt = dtensor.DTensorCheckpoint(mesh, model=model, step=step_counter, coordinator=coordinator)
    prefix = os.path.join(ckpt_dir, "ckpt")

    def saver() -> Any:
        return ckpt.__dict__.get("_shardckpt_saver")

    def pending() -> bool:
        s = saver()
        return bool(s is not None and s.pending)

    def train_step(record: Dict[str, Any]) -> None:
        for name in WEIGHTS:
            variable = getattr(model, name.replace("/", "_"))
            for device, component in variable.value().components.items():
                step(component, goals[name].components[device])
        step_counter.assign_add(1)
        # the training loop's collectives, on the main coordinator, while a save may run on the clone
        busy = pending()
        checksum = float(sum(float(c.sum(dtype=np.float64)) for name in WEIGHTS
                             for c in getattr(model, name.replace("/", "_")).value().components.values()))
        gathered = coordinator.all_gather({"rank": rank, "step": int(step_counter.numpy()), "sum": checksum})
        assert [g["rank"] for g in gathered] == list(range(size)), gathered
        assert {g["step"] for g in gathered} == {int(step_counter.numpy())}, gathered
        coordinator.barrier(f"train step {int(step_counter.numpy())}")
        if user_reduce is not None:
            assert user_reduce(1.0) == float(size)
        record["overlapped_collectives"] += int(busy)
        time.sleep(0.005)

    def save(options: Any, record: Dict[str, Any]) -> str:
        started = time.perf_counter()
        path = ckpt.save(prefix, options=options)
        record["saves"].append({"path": os.path.basename(path), "step": int(step_counter.numpy()),
                                "counter": int(ckpt.save_counter.numpy()),
                                "pending_after_return": pending(),
                                "blocked_s": time.perf_counter() - started})
        return path

    for phase in phases:
        record: Dict[str, Any] = {"rank": rank, "phase": phase, "saves": [], "overlapped_collectives": 0,
                                  "backend": coordinator.backend}
        try:
            if phase == "train":
                faults.slow = SLOW_WRITE
                options = shardckpt.CheckpointOptions(enable_async=True)
                for _ in range(STEPS):
                    train_step(record)
                    if int(step_counter.numpy()) % EVERY == 0:
                        save(options, record)
                ckpt.sync()
                faults.slow = 0.0
            elif phase == "fail":
                options = shardckpt.CheckpointOptions(enable_async=True)
                before = int(ckpt.save_counter.numpy())
                faults.fail = rank == 2
                calls = faults.calls
                train_step(record)
                save(options, record)
                train_step(record)
                try:
                    ckpt.sync()
                    record["sync_error"] = None
                except AsyncSaveError as exc:
                    record["sync_error"] = {"type": type(exc).__name__, "cause": type(exc.__cause__).__name__,
                                            "message": str(exc)}
                record["failing_writes"] = faults.calls - calls if rank == 2 else None
                faults.fail = False
                record["counter_after_failure"] = int(ckpt.save_counter.numpy())
                record["counter_before"] = before
                coordinator.barrier("after the failure")  # everyone has looked before anyone saves again
                record["latest_after_failure"] = os.path.basename(latest_checkpoint(ckpt_dir) or "")
                save(options, record)
                train_step(record)
                ckpt.sync()
            elif phase in ("funnel", "funnel-budget"):
                extra = {"async_staging_bytes": 64 << 10} if phase == "funnel-budget" else {}
                options = shardckpt.CheckpointOptions(enable_async=True, io_device="/job:localhost/task:0", **extra)
                train_step(record)
                save(options, record)
                train_step(record)
                ckpt.sync()
            else:
                raise ValueError(f"unknown phase {phase!r}")
            record["ok"] = True
        except BaseException as exc:  # recorded for the test
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        coordinator.barrier(f"end of {phase}")
        record["latest"] = os.path.basename(latest_checkpoint(ckpt_dir) or "")
        record["final_counter"] = int(ckpt.save_counter.numpy())
        record["final_step"] = int(step_counter.numpy())
        _write_json(out_dir, rank, phase, record)
        if not record["ok"]:
            break


def run_local(group: Any, rank: int, out_dir: str, ckpt_dir: str, phases: List[str]) -> None:
    """Entry of a ``multiprocessing`` client."""
    from shardckpt.distributed.local import LocalProcessCoordinator

    run(LocalProcessCoordinator(group, rank, timeout=30.0), out_dir, ckpt_dir, phases)


def main(argv: List[str]) -> int:
    from shardckpt.distributed import get_coordinator

    out_dir, ckpt_dir, phases = argv[0], argv[1], argv[2].split(",")
    coordinator = get_coordinator()
    run(coordinator, out_dir, ckpt_dir, phases)
    coordinator.barrier("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
