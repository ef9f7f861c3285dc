"""Benchmark incremental saves: time and bytes written when 1%, 10% or 100% of a state changed.

A uniform float32 state (default 256 MiB in 256 tensors) is saved once in full (incrementally:
hashes recorded); then a fraction of its tensors changes (every element of them) and
the state is saved again, each way into a place of its own:

* ``full``         -- ``save_tensors(p, arrays)``: a plain full save (the baseline of every ratio);
* ``vfull``        -- a ``CheckpointManager`` (not incremental) saving the same state as
                      ``shardckpt.Variable``s: the full save of the object-graph front door;
* ``variables``    -- ``CheckpointManager(..., incremental=True)`` of ``Variable``s changed
                      through the API (``assign_add``), default options: what a user of the
                      manager does. Unchanged variables are known by their version stamps (they
                      never handed out their live buffer), so no byte of them is read;
* ``hashed``       -- the same manager and options, but every variable's ``.array`` was taken
                      (as code that writes into it directly does): every variable is hashed
                      (xxh3-128, on the checksum helpers) to find the unchanged ones;
* ``incremental``  -- ``save_tensors(p, arrays, CheckpointOptions(incremental=True), previous=p0)``:
                      plain arrays have no versions, so they are always hashed;
* ``dcp``          -- ``torch.distributed.checkpoint.save`` of the same state (reference).

Unchanged tensors' data files are hard-linked from the previous checkpoint in every
incremental variant. Times are wall seconds (median and best of the repeats) and CPU
seconds (all threads; less sensitive to a shared disk). Every save is durable (fsync,
commit; the managers also write their state file and apply ``max_to_keep=2``); before each
one ``os.sync()`` settles earlier writes, the systems take turns going first, and the page
cache of the plain saves' files is dropped once measured (it slowed later writes down here;
DCP's files are deleted). Reported per fraction over ``--repeats``: seconds, bytes written (``/proc/self/io``
``wchar``: every byte through ``write``; links write none), both as ratios to the full
save. Then the full and the incremental checkpoint are restored in turns (``--restore-rounds``
each; every tensor, through ``restore_tensors`` as ``Checkpoint.restore`` does), from a cold
page cache (dropped first where allowed) and then warm: medians of the times and of the
per-round ratios, and each checkpoint's number of data files.

    .venv/bin/python benchmarks/bench_incremental.py                       # 256 MiB, 3 repeats
    .venv/bin/python benchmarks/bench_incremental.py --size 1GiB --repeats 3 --no-dcp

Results: a table on stdout, everything in ``benchmarks/results/incremental-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import common as C
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "src"))

import shardckpt  # noqa: E402
from shardckpt import CheckpointOptions  # noqa: E402


def _measure(fn: Callable[[], Any]) -> Dict[str, float]:
    os.sync()  # no writeback of an earlier save runs into this one
    time.sleep(0.5)
    probe = C.Probe().start()
    fn()
    out = probe.sample()
    return {"seconds": out["seconds"], "cpu_s": out["cpu_s"], "wchar": float(out["wchar"] or 0)}


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def _restore_seconds(prefix: str, names: List[str], out: List[np.ndarray]) -> Tuple[float, float]:
    """Seconds to restore every tensor into ``out`` (``restore_tensors``: the path ``Checkpoint.restore``
    takes) from a cold page cache (dropped first, where allowed), then again warm."""
    requests = [shardckpt.RestoreRequest(name, out=dest) for name, dest in zip(names, out)]
    times = []
    for cold in (True, False):
        if cold:
            C.drop_page_cache()
        t0 = time.perf_counter()
        shardckpt.restore_tensors(prefix, requests)
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def _restores(folder: str, names: List[str], state: List[np.ndarray], rounds: int) -> Dict[str, Any]:
    """The full and the incremental checkpoint restored in turns (which goes first alternates), ``rounds``
    times each, cold then warm; every restore checked. Per-round ratios and each one's data files."""
    out = [np.empty_like(a) for a in state]
    res: Dict[str, Any] = {k: [] for k in ("restore_full_s", "restore_full_warm_s", "restore_incremental_s",
                                           "restore_incremental_warm_s")}
    for n in range(rounds):
        for name, base in (("full", "full"), ("incremental", "inc"))[::1 if n % 2 == 0 else -1]:
            for a in out:
                a.fill(0)
            cold, warm = _restore_seconds(os.path.join(folder, base), names, out)
            assert all(np.array_equal(a, b) for a, b in zip(out, state)), f"the {name} checkpoint restored wrong"
            res[f"restore_{name}_s"].append(cold)
            res[f"restore_{name}_warm_s"].append(warm)
    for name, base in (("full", "full"), ("incremental", "inc")):
        res[f"{name}_files"] = sum(1 for e in os.listdir(folder) if e.startswith(base + ".data-"))
    return res


def _manager(folder: str, name: str, state: List[np.ndarray], incremental: bool,
             hand_out: bool = False) -> Tuple[Any, List[Any]]:
    """A manager of the state as Variables (copies) in ``folder/name``; ``hand_out``: take every ``.array``."""
    model = shardckpt.Module()
    model.v = [shardckpt.Variable(a) for a in state]  # copies
    if hand_out:
        for v in model.v:
            _ = v.array  # as code writing into the live buffer does: these variables are hashed
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), os.path.join(folder, name),
                                          max_to_keep=2, incremental=incremental)
    return manager, list(model.v)


def run_fraction(work: str, fraction: float, state: List[np.ndarray], names: List[str],
                 with_dcp: bool, rotate: int = 0, restore_rounds: int = 3) -> Dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="inc-", dir=work)
    try:
        values = dict(zip(names, state))
        base = os.path.join(folder, "p0")
        shardckpt.save_tensors(base, values, CheckpointOptions(incremental=True))
        managed = {"vfull": _manager(folder, "vfull", state, False),
                   "variables": _manager(folder, "variables", state, True),
                   "hashed": _manager(folder, "hashed", state, True, hand_out=True)}
        for name in ("variables", "hashed"):
            managed[name][0].save()  # their previous checkpoint
        count = max(1, round(fraction * len(state)))
        step = len(state) / count
        changed = sorted({int(i * step) for i in range(count)})
        for i in changed:
            state[i] += 1.0
            for _, variables in managed.values():
                variables[i].assign_add(np.float32(1.0))
        res: Dict[str, Any] = {"fraction": fraction, "changed_tensors": len(changed),
                               "changed_bytes": sum(state[i].nbytes for i in changed)}
        saves: Dict[str, Callable[[], Any]] = {
            "full": lambda: shardckpt.save_tensors(os.path.join(folder, "full"), values),
            "incremental": lambda: shardckpt.save_tensors(os.path.join(folder, "inc"), values,
                                                          CheckpointOptions(incremental=True), previous=base)}
        for name, (manager, _) in managed.items():
            saves[name] = manager.save
        if with_dcp:
            import torch
            import torch.distributed.checkpoint as dcp

            tstate = {n: torch.from_numpy(a) for n, a in values.items()}
            saves["dcp"] = lambda: dcp.save(tstate, checkpoint_id=os.path.join(folder, "dcp"))
        order = list(saves)
        order = order[rotate % len(order):] + order[:rotate % len(order)]  # no system always goes first
        for name in order:
            res[name] = _measure(saves[name])
            if name == "dcp":  # deleted at once: its page cache does not slow the next save down
                shutil.rmtree(os.path.join(folder, "dcp"))
            elif name in ("full", "incremental"):  # kept for the restores; their page cache dropped
                C.drop_page_cache()
        res.update(_restores(folder, names, state, restore_rounds))
        for name in ("variables", "hashed"):  # the managers' latest checkpoints hold the new state
            latest = managed[name][0].latest_checkpoint
            with shardckpt.load_checkpoint(latest) as reader:
                keys = sorted(k for k in reader.get_variable_to_shape_map() if k.startswith("model/v/"))
                assert len(keys) == len(state), (name, len(keys))
                for i in changed[:3] + [j for j in (0, len(state) - 1) if j not in changed]:
                    got = reader.get_tensor(f"model/v/{i}/.ATTRIBUTES/VARIABLE_VALUE")
                    assert np.array_equal(got, state[i]), f"the {name} checkpoint holds wrong values ({i})"
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--tensors", type=int, default=256)
    ap.add_argument("--fractions", default="0.01,0.1,1.0")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--restore-rounds", type=int, default=3,
                    help="per repeat, the full and the incremental checkpoint are each restored this often")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    args = ap.parse_args()
    nbytes = C.parse_size(args.size)
    spec = C.state_spec("uniform", nbytes, args.tensors)
    names = [n for n, _ in spec]
    fractions = [float(f) for f in args.fractions.split(",")]
    work = tempfile.mkdtemp(prefix="bench-incremental-", dir=args.dir)
    load_before = _loadavg()
    runs: Dict[float, List[Dict[str, Any]]] = {f: [] for f in fractions}
    try:
        for repeat in range(args.repeats):
            for f in fractions:
                state = C.make_state(spec)
                runs[f].append(run_fraction(work, f, state, names, not args.no_dcp, rotate=repeat,
                                            restore_rounds=args.restore_rounds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    systems = ["full", "vfull", "variables", "hashed", "incremental"] + ([] if args.no_dcp else ["dcp"])
    load_after = _loadavg()
    print(f"state: {C.fmt_size(C.spec_bytes(spec))} in {len(spec)} float32 tensors; medians of {args.repeats}; "
          f"load average {load_before} before, {load_after} after")
    print(f"{'changed':>8} {'system':>12} {'median s':>9} {'x full':>7} {'best s':>7} {'x full':>7} "
          f"{'cpu s':>6} {'x full':>7} {'written':>11} {'x full':>7}")
    for f in fractions:
        med = {s: {k: C.median([r[s][k] for r in runs[f]]) for k in ("seconds", "cpu_s", "wchar")} for s in systems}
        best = {s: min(r[s]["seconds"] for r in runs[f]) for s in systems}
        full = med["full"]
        for s in systems:
            row = {"fraction": f, "system": s, **med[s], "best_seconds": best[s],
                   "time_ratio": med[s]["seconds"] / full["seconds"], "best_ratio": best[s] / best["full"],
                   "cpu_ratio": med[s]["cpu_s"] / full["cpu_s"],
                   "bytes_ratio": med[s]["wchar"] / full["wchar"] if full["wchar"] else None}
            rows.append(row)
            print(f"{f:>8.0%} {s:>12} {row['seconds']:>9.3f} {row['time_ratio']:>7.3f} {best[s]:>7.3f} "
                  f"{row['best_ratio']:>7.3f} {row['cpu_s']:>6.2f} {row['cpu_ratio']:>7.3f} "
                  f"{C.fmt_size(row['wchar']):>11} {row['bytes_ratio'] or 0:>7.4f}")
        for kind, suffix in (("cold", ""), ("warm", "_warm")):
            full_s = [t for r in runs[f] for t in r[f"restore_full{suffix}_s"]]
            inc_s = [t for r in runs[f] for t in r[f"restore_incremental{suffix}_s"]]
            rf, ri = C.median(full_s), C.median(inc_s)
            ratio = C.median([b / a for a, b in zip(full_s, inc_s)])
            print(f"{f:>8.0%} {'restore ' + kind:>12} full {rf:.3f} s, incremental {ri:.3f} s ({ri / rf:.2f}x; "
                  f"median of per-round ratios {ratio:.2f}x); data files: full {runs[f][0]['full_files']}, "
                  f"incremental {runs[f][0]['incremental_files']}")
        vfull = med["vfull"]["seconds"]
        print(f"{f:>8.0%} {'managers':>12} variables / vfull {med['variables']['seconds'] / vfull:.3f}x, "
              f"hashed / vfull {med['hashed']['seconds'] / vfull:.3f}x (median seconds)")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"incremental-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as fh:
        json.dump({"size": C.spec_bytes(spec), "tensors": len(spec), "repeats": args.repeats,
                   "machine": platform.platform(), "cpus": os.cpu_count(), "rows": rows,
                   "loadavg_before": load_before, "loadavg_after": load_after,
                   "runs": {str(f): runs[f] for f in fractions}}, fh, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
