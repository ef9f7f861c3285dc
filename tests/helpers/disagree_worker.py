"""One client of tests/test_disagreement.py, started by torchrun or mpiexec with 4 clients.

    disagree_worker.py OUTDIR DATADIR

On ``create_distributed_mesh([("x", 2), ("y", 4)])`` every client calls
``dtensor.sharded_save`` of one (8, 16) variable per phase, each at its own prefix
``DATADIR/<phase>``. In the phases after ``agree`` client 2 disagrees:

* ``rename``: client 2 names the variable ``w2``;
* ``layout``: client 2 lays it out as ``["y", "x"]`` instead of ``["x", "y"]``;
* ``mesh``: client 2 builds its mesh as ``[("x", 4), ("y", 2)]``;
* ``dtype``: client 2 saves float64;
* ``shape``: client 2 saves a (8, 32) variable (same layout, another global shape);
* ``root_shape``: client 0 (the io client) does, the others save (8, 16);
* ``skip``: client 2 skips the save to ``skip_a``; the others' save to ``skip_a`` meets
  client 2's save to ``skip_b``;
* ``resync``: everyone (client 2 for the second time) saves to ``skip_b``: this works.

Then a replicated variable ``b`` (``Layout(["unsharded"])``, written by client 0 alone)
that not every client has, through three front doors. ``<door>`` is ``rep`` for
``dtensor.sharded_save`` (at ``DATADIR/rep_<case>``), ``ck`` for ``DTensorCheckpoint.save``
(``DATADIR/ck/<case>-1``, state file in ``DATADIR/ck``) and ``mgr`` for a
``CheckpointManager`` over a ``DTensorCheckpoint`` (``DATADIR/mgr/<case>-1``):

* ``<door>_agree`` (``ck_good``, ``mgr_good`` for the two with a state file): every client
  holds ``w``, ``b`` and a plain ``step``: this commits;
* ``<door>_only0``: only client 0 holds ``b``;
* ``<door>_only1``: only client 1 holds ``b`` (nobody writes it: its writer device is client 0's);
* ``<door>_renamed``: client 1 names it ``b2``, the others ``b``.

After the failed ``ck``/``mgr`` saves each client records what its state file names as
latest (``ck_latest``, ``mgr_latest``, and the manager's own ``mgr_manager_latest``) and
whether the good checkpoint restores exactly into fresh variables (``ck_restored``,
``mgr_restored``: every local component compared).

Each phase's outcome goes to ``OUTDIR/rank<R>.json``; the test judges it and the files.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from functools import partial
from typing import Any, Callable, Dict

import numpy as np

SHAPE = (8, 16)


def main() -> None:
    out, data = sys.argv[1], sys.argv[2]
    result: Dict[str, Any] = {"phases": {}}
    rank = -1
    try:
        from shardckpt import CheckpointOptions
        from shardckpt import dtensor as dt
        from shardckpt.distributed import get_coordinator

        coordinator = get_coordinator()
        rank = result["rank"] = coordinator.rank
        mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
        other_mesh = dt.create_distributed_mesh([("x", 4), ("y", 2)])
        value = np.arange(np.prod(SHAPE), dtype=np.float64).reshape(SHAPE)
        options = CheckpointOptions(timeout=30)

        def save(prefix: str, name: str = "w", layout=("x", "y"), on=None, dtype: Any = np.float32,
                 wide: bool = False) -> None:
            m = on or mesh
            array = np.hstack([value, value]) if wide else value
            v = dt.from_global(array.astype(dtype), dt.Layout(list(layout), m))
            dt.sharded_save(m, os.path.join(data, prefix), [name], [""], [v], options)

        def phase(name: str, fn: Callable[[], None]) -> None:
            try:
                fn()
                result["phases"][name] = {"ok": True}
            except Exception as e:  # judged by the test
                result["phases"][name] = {"ok": False, "type": type(e).__name__, "message": str(e),
                                          "traceback": traceback.format_exc()}

        odd = rank == 2
        phase("agree", lambda: save("agree"))
        phase("rename", lambda: save("rename", name="w2" if odd else "w"))
        phase("layout", lambda: save("layout", layout=("y", "x") if odd else ("x", "y")))
        phase("mesh", lambda: save("mesh", on=other_mesh if odd else mesh))
        phase("dtype", lambda: save("dtype", dtype=np.float64 if odd else np.float32))
        phase("shape", lambda: save("shape", wide=odd))
        phase("root_shape", lambda: save("root_shape", wide=rank == 0))
        phase("skip", lambda: save("skip_b" if odd else "skip_a"))
        phase("resync", lambda: save("skip_b"))
        replicated_phases(dt, mesh, value, options, rank, data, phase, result)
        result["done"] = True
    except Exception:
        result["fatal"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{max(rank, 0) if rank >= 0 else os.getpid()}.json"), "w") as f:
        json.dump(result, f)


REPLICATED_CASES = ("only0", "only1", "renamed")


def replicated_phases(dt: Any, mesh: Any, value: np.ndarray, options: Any, rank: int, data: str,
                      phase: Callable[[str, Callable[[], None]], None], result: Dict[str, Any]) -> None:
    """The phases of a replicated variable that not every client has (see the module docstring)."""
    import shardckpt

    w_value = value.astype(np.float32)
    b_value = np.array([1.5, -2.0, 3.25, 4.0], np.float32)
    w_layout, b_layout = dt.Layout(["x", "y"], mesh), dt.Layout(["unsharded"], mesh)

    def held(case: str) -> Dict[str, Any]:
        """What this client holds in ``case``: name -> DVariable (and the plain step)."""
        out: Dict[str, Any] = {"w": dt.DVariable(dt.from_global(w_value, w_layout))}
        b = dt.DVariable(dt.from_global(b_value, b_layout))
        if case in ("agree", "good") or (case == "only0" and rank == 0) or (case == "only1" and rank == 1):
            out["b"] = b
        elif case == "renamed":
            out["b2" if rank == 1 else "b"] = b
        out["step"] = np.array(7, np.int64)
        return out

    def sharded(case: str) -> None:
        values = held(case)
        names = sorted(values)
        dt.sharded_save(mesh, os.path.join(data, f"rep_{case}"), names, [""] * len(names),
                        [values[n] for n in names], options)

    ck_dir, mgr_dir = os.path.join(data, "ck"), os.path.join(data, "mgr")

    def checkpoint(case: str) -> None:
        dt.DTensorCheckpoint(mesh, **held(case)).save(os.path.join(ck_dir, case), options)

    def managed(case: str) -> None:
        manager = shardckpt.CheckpointManager(dt.DTensorCheckpoint(mesh, **held(case)), mgr_dir, max_to_keep=5,
                                              checkpoint_name=case)
        try:
            manager.save(options=options)
        finally:
            result["mgr_manager_latest"] = manager.latest_checkpoint

    def restored(directory: str) -> bool:
        """Whether the good checkpoint restores exactly into fresh (zeroed) variables, on this client."""
        fresh = {"w": dt.DVariable(dt.from_global(np.zeros_like(w_value), w_layout)),
                 "b": dt.DVariable(dt.from_global(np.zeros_like(b_value), b_layout))}
        dt.DTensorCheckpoint(mesh, **fresh).restore(os.path.join(directory, "good-1")).expect_partial()
        want = {"w": dt.from_global(w_value, w_layout), "b": dt.from_global(b_value, b_layout)}
        return all(np.array_equal(got, expected) for name in fresh
                   for got, expected in zip(dt.unpack(fresh[name]), dt.unpack(want[name])))

    phase("rep_agree", partial(sharded, "agree"))
    for case in REPLICATED_CASES:
        phase(f"rep_{case}", partial(sharded, case))
    for door, run, directory in (("ck", checkpoint, ck_dir), ("mgr", managed, mgr_dir)):
        phase(f"{door}_good", partial(run, "good"))
        for case in REPLICATED_CASES:
            phase(f"{door}_{case}", partial(run, case))
        result[f"{door}_latest"] = shardckpt.latest_checkpoint(directory)
        try:
            result[f"{door}_restored"] = restored(directory)
        except Exception:  # judged by the test
            result[f"{door}_restored"] = traceback.format_exc()


if __name__ == "__main__":
    main()
