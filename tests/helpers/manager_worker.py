"""One client of tests/test_manager_multiclient.py, started by torchrun or mpiexec (4 clients).

    manager_worker.py MODE OUTDIR DATADIR

Every client builds the same model, as TensorFlow's DTensor tutorial does: a ``shardckpt.Module``
holding the DVariables of :data:`dtensor_worker.VARS` on ``create_distributed_mesh([("x", 2), ("y", 4)])``
(two devices a client) and a plain ``Variable``, saved through ``shardckpt.Checkpoint(root=model)``
and a ``CheckpointManager(max_to_keep=2)``. No coordinator is passed anywhere: the process-wide
one (torchrun's or mpiexec's) is used.

``MODE``:

* ``saves``: three saves of generations 1, 2, 3 into ``DATADIR/<kind>`` for each kind of
  :data:`KINDS`: ``sync`` (``Checkpoint(root=model)``), ``async`` (the same with
  ``CheckpointOptions(enable_async=True)``, each save followed by ``manager.sync()``) and
  ``legacy`` (``dtensor.DTensorCheckpoint(mesh, root=model)``). After each save every client
  records its manager's view (``latest_checkpoint``, ``checkpoints``, the returned path's number,
  ``save_counter``); then ``ckpt-3`` is restored onto a zeroed model and compared, and the same
  manager's ``restore_or_initialize`` records whether it restored or initialized.
  Last, ``disagree``: client :data:`ODD`'s model lacks ``on_xy``; its manager's save must fail on
  every client, commit nothing, and leave every manager without a checkpoint.
* ``resume``: a fresh job: for ``sync`` and ``async``, a new manager over a zeroed model runs
  ``restore_or_initialize`` (recording whether ``init_fn`` ran and what was restored), then saves
  once more (generation 4), which is then restored funnelled through client 1
  (``CheckpointOptions(io_device=...task:1...)``); for an empty folder ``DATADIR/empty``, ``restore_or_initialize``.

Each client counts its reads of ``checkpoint`` state files (``LocalFileSystem.read_bytes``,
``isfile``, ``exists`` of a file named ``checkpoint``) per phase. Results go to ``OUTDIR/rank<R>.json``.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dtensor_worker as W  # noqa: E402  (tests/helpers)

KINDS = ("sync", "async", "legacy")
SAVES = 3
ODD = 3  # the client whose model lacks a variable in the ``disagree`` phase
STATE_READS: Dict[str, int] = {}


def count_state_reads() -> None:
    """Count this process's filesystem calls on files named ``checkpoint``, under the current phase."""
    from shardckpt.storage.local import LocalFileSystem

    for method in ("read_bytes", "isfile", "exists"):
        original = getattr(LocalFileSystem, method)

        def wrapper(self, path, *args, __original=original, **kwargs):
            if os.path.basename(str(path)) == "checkpoint":
                STATE_READS[W._phase[0]] = STATE_READS.get(W._phase[0], 0) + 1
                W.result["state_reads"] = dict(STATE_READS)
            return __original(self, path, *args, **kwargs)

        setattr(LocalFileSystem, method, wrapper)


def build_model(mesh, generation: int, leave_out: str = ""):
    """The model: a Module with one DVariable per layout of W.VARS (but ``leave_out``) and a plain Variable."""
    import shardckpt

    model = shardckpt.Module()
    variables = W.dvariables(mesh, generation) if generation else W.zero_dvariables(
        mesh, {name: spec for name, (spec, _, _) in W.VARS.items()})
    for name, var in variables.items():
        if name != leave_out:
            setattr(model, name, var)
    model.plain = shardckpt.Variable(W.value(W.PLAIN, generation) if generation
                                     else np.zeros((3, 4), np.float32))
    return model, variables


def checkpoint_of(kind: str, mesh, model):
    import shardckpt
    from shardckpt import dtensor as dt

    if kind == "legacy":
        return dt.DTensorCheckpoint(mesh, root=model)
    return shardckpt.Checkpoint(root=model)


def view(manager, path) -> Dict[str, Any]:
    """What this client's manager says after a save."""
    return {"latest": manager.latest_checkpoint, "checkpoints": manager.checkpoints,
            "number": None if path is None else int(str(path).rsplit("-", 1)[1]),
            "save_counter": int(manager.checkpoint.save_counter.numpy())}


def check_values(model, variables, generation: int) -> Dict[str, Any]:
    return {"mismatches": {name: W.mismatches(var, W.value(name, generation)) for name, var in variables.items()},
            "plain_ok": bool(np.array_equal(model.plain.numpy(), W.value(W.PLAIN, generation)))}


def saves_of(kind: str, mesh, data: str) -> None:
    """Three saves of ``kind`` into ``DATADIR/<kind>``, each client's view after each, then a restore of the last."""
    import shardckpt

    directory = os.path.join(data, kind)
    model, variables = build_model(mesh, 1)
    ckpt = checkpoint_of(kind, mesh, model)
    options = shardckpt.CheckpointOptions(enable_async=True) if kind == "async" else None
    manager = W.phase(f"{kind}/construct",
                      lambda: shardckpt.CheckpointManager(ckpt, directory, max_to_keep=2))["value"]

    def save():
        path = manager.save(options=options)
        if kind == "async":
            W.set_generation(variables, model.plain, W.CLOBBER_GEN)  # after the return: not in the checkpoint
            manager.sync()
        return view(manager, path)

    for generation in range(1, SAVES + 1):
        W.set_generation(variables, model.plain, generation)
        W.phase(f"{kind}/save{generation}", save)
    target, target_vars = build_model(mesh, 0)

    def restore():
        checkpoint_of(kind, mesh, target).restore(manager.latest_checkpoint).assert_consumed()
        return check_values(target, target_vars, SAVES)

    W.phase(f"{kind}/restore", restore)
    init = []
    manager._init_fn = lambda: init.append(True)  # the same process, as the report: no mix
    W.phase(f"{kind}/restore_or_initialize", lambda: {"returned": manager.restore_or_initialize(),
                                                      "initialized": bool(init)})


def resume_of(kind: str, mesh, data: str) -> None:
    """A fresh job's manager over ``DATADIR/<kind>``: ``restore_or_initialize``, then one more save."""
    import shardckpt

    directory = os.path.join(data, kind)
    model, variables = build_model(mesh, 0)
    ckpt = shardckpt.Checkpoint(root=model)
    initialized = []
    manager = W.phase(f"{kind}/construct", lambda: shardckpt.CheckpointManager(
        ckpt, directory, max_to_keep=2, init_fn=lambda: initialized.append(True)))["value"]

    def restore_or_initialize():
        got = manager.restore_or_initialize()
        out = dict(view(manager, None), returned=got, initialized=bool(initialized))
        if got is not None:
            out.update(check_values(model, variables, SAVES))
        return out

    W.phase(f"{kind}/restore_or_initialize", restore_or_initialize)

    def save_again():
        W.set_generation(variables, model.plain, SAVES + 1)
        return view(manager, manager.save())

    W.phase(f"{kind}/save_again", save_again)
    if kind == "empty":
        return
    funnelled, funnelled_vars = build_model(mesh, 0)

    def restore_funnelled():  # only client 1 reads; the others receive their pieces
        shardckpt.Checkpoint(root=funnelled).restore(
            manager.latest_checkpoint, options=shardckpt.CheckpointOptions(io_device=W.IO_DEVICE)).assert_consumed()
        return check_values(funnelled, funnelled_vars, SAVES + 1)

    W.phase(f"{kind}/restore_funnelled", restore_funnelled)


def disagreeing_save(mesh, data: str) -> None:
    """Client :data:`ODD` leaves ``on_xy`` (whose pieces it writes) out of its model: the save fails on
    every client, nothing is committed, and every client's manager still knows no checkpoint."""
    import shardckpt

    model, _ = build_model(mesh, 1, leave_out="on_xy" if W.result["rank"] == ODD else "")
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(root=model), os.path.join(data, "disagree"),
                                          max_to_keep=2)
    W.phase("disagree/save", manager.save)
    W.phase("disagree/after", lambda: view(manager, None))


def run_saves(data: str) -> None:
    from shardckpt import dtensor as dt

    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
    for kind in KINDS:
        saves_of(kind, mesh, data)
    disagreeing_save(mesh, data)


def run_resume(data: str) -> None:
    from shardckpt import dtensor as dt

    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
    for kind in ("sync", "async", "empty"):
        resume_of(kind, mesh, data)


def main() -> None:
    mode, W.OUT, data = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(W.OUT, exist_ok=True)
    from shardckpt.distributed import set_coordinator

    coord = W.make_coordinator(W.LONG)
    set_coordinator(coord)
    W.result.update(rank=coord.rank, size=coord.size, backend=coord.backend, pid=os.getpid())
    W.flush()
    count_state_reads()
    {"saves": run_saves, "resume": run_resume}[mode](data)
    W.result["done"] = True
    W.flush()
    coord.close()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        W.result["fatal"] = traceback.format_exc()
        W.flush()
        raise
