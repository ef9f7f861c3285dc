"""Benchmark asynchronous saves: how long ``Checkpoint.save(enable_async)`` blocks, and what it costs.

For each state size (uniform float32 states, 64 tensors), every system runs in a fresh
process of its own, interleaved across repeats, medians reported:

* ``numpy_copy``     -- ``np.copyto`` of every tensor into preallocated, warmed buffers: the floor
                        of any snapshot (what the blocking part of an async save must copy).
* ``shardckpt_sync`` -- ``Checkpoint.save(prefix)`` (synchronous; durable: fsync, commit).
* ``shardckpt_async``-- ``Checkpoint.save(prefix, options=CheckpointOptions(enable_async=True))``:
                        the time the call blocks, and the time until ``sync()`` returns (committed).
* ``tf_async``       -- ``tf.train.Checkpoint(...).write(p, options=tf.train.CheckpointOptions(
                        enable_async=True))`` under $SHARDCKPT_TF_PYTHON: call return, and ``sync()``.
* ``dcp_async``      -- ``torch.distributed.checkpoint.async_save(state_dict, checkpoint_id=p)`` of
                        ``torch.from_numpy`` tensors (single process, no process group): call return,
                        and ``future.result()``.

The first call of a process allocates (staging buffers, TF's CPU copies, thread pools) and is
reported separately; the figures compared are those of the **second** call. A third call
measures how much an in-place update of the whole state right after the call returns is
slowed down (``update after`` vs the same update alone): a system that defers its copy
(copy-on-write, or copying in the background) pays it there.

    .venv/bin/python benchmarks/bench_async.py                           # 1 GiB and 4 GiB, 3 repeats
    .venv/bin/python benchmarks/bench_async.py --sizes 64MiB --repeats 1 # a quick look (~1 min)
    .venv/bin/python benchmarks/bench_async.py --smoke                   # smoke run (what the suite runs)

Results: a table and ratios on stdout, everything in ``benchmarks/results/async-<time>.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import common as C
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SYSTEMS = {"numpy_copy": "py", "shardckpt_sync": "py", "shardckpt_async": "py", "tf_async": "tf",
           "dcp_async": "py"}


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


# =====================================================================================
# Workers: each builds the state, runs call 1 (first), call 2 (timed), call 3 (update after)
# =====================================================================================
def _remove(pattern: str) -> None:
    for path in glob.glob(pattern):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def _settle() -> None:
    """Write back dirty pages of earlier calls, so they do not compete with the timed call."""
    os.sync()
    time.sleep(0.2)


def _phase(fn: Callable[[], Any], prime: int, warm: List[np.ndarray]) -> Dict[str, Any]:
    C.prime_free_memory(prime)
    C.warm(warm)
    probe = C.Probe().start()
    out = fn()
    return {**probe.sample(), "out": out}


class Timed:
    """A call that returns early (``call``) and a wait for its commit (``wait``), timed as one phase."""

    def __init__(self, call: Callable[[], Any], wait: Callable[[Any], None]) -> None:
        self.call, self.wait = call, wait

    def __call__(self) -> Dict[str, float]:
        t0 = time.perf_counter()
        handle = self.call()
        t1 = time.perf_counter()
        self.wait(handle)
        t2 = time.perf_counter()
        return {"block_s": t1 - t0, "commit_s": t2 - t0}


def _update_delta(update: Callable[[], None], timed: Timed) -> Dict[str, float]:
    """An in-place update of the whole state alone, then right after an async call returns."""
    update()  # first-call costs (kernel dispatch, thread pools) are not the point
    t0 = time.perf_counter()
    update()
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    handle = timed.call()
    t1 = time.perf_counter()
    update()
    after = time.perf_counter() - t1
    timed.wait(handle)
    return {"update_alone_s": alone, "update_after_s": after, "block3_s": t1 - t0}


def run_worker(args: argparse.Namespace) -> None:
    spec = C.state_spec("uniform", C.parse_size(args.size))
    nbytes = C.spec_bytes(spec)
    work = os.path.join(args.dir, "w")
    os.makedirs(work, exist_ok=True)
    result: Dict[str, Any] = {"system": args.worker, "bytes": nbytes, "tensors": len(spec)}
    fn = globals()[f"w_{args.worker}"]
    result.update(fn(spec, nbytes, work))
    shutil.rmtree(work, ignore_errors=True)
    C.emit(result)


def w_numpy_copy(spec: C.Spec, nbytes: int, work: str) -> Dict[str, Any]:
    arrays = C.make_state(spec)
    dst = [np.empty_like(a) for a in arrays]
    C.warm(dst)
    C.warm(dst)

    def copy() -> None:
        for s, d in zip(arrays, dst):
            np.copyto(d, s)

    copy()  # first call (also warms the code path)
    second = _phase(copy, 0, arrays + dst)
    assert all(np.array_equal(d, a) for d, a in zip(dst, arrays)), "numpy_copy copied wrong values"
    return {"block_s": second["seconds"], "commit_s": second["seconds"], "peak_extra": second["peak_extra"],
            "cpu_s": second["cpu_s"]}


def _shardckpt_state(spec: C.Spec) -> Any:
    import shardckpt

    model = shardckpt.Module()
    variables = []
    for i, (_, shape) in enumerate(spec):  # one tensor at a time: peak = state + one tensor
        variables.append(shardckpt.Variable(C.fill_tensor(i, np.empty(shape, C.DTYPE))))
    model.tensors = variables
    return model, variables


def _shardckpt_check(prefix: str, spec: C.Spec) -> bool:
    import shardckpt

    with shardckpt.load_checkpoint(prefix) as reader:  # every tensor, one at a time
        return all(C.verify(spec, [reader.get_tensor(f"model/tensors/{i}/.ATTRIBUTES/VARIABLE_VALUE")], indices=[i])
                   for i in range(len(spec)))


def w_shardckpt_sync(spec: C.Spec, nbytes: int, work: str) -> Dict[str, Any]:
    import shardckpt

    model, variables = _shardckpt_state(spec)
    arrays = [v.array for v in variables]
    ckpt = shardckpt.Checkpoint(model=model)
    prefix = os.path.join(work, "ckpt")
    first = _phase(lambda: ckpt.save(prefix), nbytes, arrays)  # rehearsal: first-call costs
    _remove(prefix + "-1.*")  # its page-cache pages are recycled, as with max_to_keep
    _settle()
    second = _phase(lambda: ckpt.save(prefix), nbytes, arrays)
    ok = _shardckpt_check(second["out"], spec)
    return {"block_s": second["seconds"], "commit_s": second["seconds"], "peak_extra": second["peak_extra"],
            "cpu_s": second["cpu_s"], "first_block_s": first["seconds"], "first_commit_s": first["seconds"],
            "first_peak_extra": first["peak_extra"], "values_ok": ok}


def w_shardckpt_async(spec: C.Spec, nbytes: int, work: str) -> Dict[str, Any]:
    import shardckpt

    model, variables = _shardckpt_state(spec)
    arrays = [v.array for v in variables]
    ckpt = shardckpt.Checkpoint(model=model)
    prefix = os.path.join(work, "ckpt")
    options = shardckpt.CheckpointOptions(enable_async=True)
    timed = Timed(lambda: ckpt.save(prefix, options=options), lambda _: ckpt.sync())
    first = _phase(timed, 2 * nbytes, arrays)  # staging buffers + page cache
    pool = ckpt.__dict__["_shardckpt_saver"].pool
    staging = [b for b in pool._buffers.values() if b.dtype != object]
    _remove(prefix + "-1.*")
    _settle()
    second = _phase(timed, nbytes, arrays + staging)  # staging buffers warmed, as numpy_copy's
    ok = _shardckpt_check(prefix + "-2", spec)
    _remove(prefix + "-2.*")
    _settle()

    def update() -> None:
        for a in arrays:
            np.add(a, 0, out=a)

    C.prime_free_memory(nbytes)
    C.warm(arrays + staging)
    third = _update_delta(update, timed)
    return {**{k: second["out"][k] for k in ("block_s", "commit_s")}, "peak_extra": second["peak_extra"],
            "cpu_s": second["cpu_s"], "first_block_s": first["out"]["block_s"],
            "first_commit_s": first["out"]["commit_s"], "first_peak_extra": first["peak_extra"],
            "staging_bytes": pool.nbytes, "values_ok": ok, **third}


def w_tf_async(spec: C.Spec, nbytes: int, work: str) -> Dict[str, Any]:
    import tensorflow as tf

    variables = []
    for i, (_, shape) in enumerate(spec):
        variables.append(tf.Variable(C.fill_tensor(i, np.empty(shape, C.DTYPE))))
    zeros = [tf.zeros_like(v) for v in variables]

    def update() -> None:
        for v, z in zip(variables, zeros):
            v.assign_add(z)

    ckpt = tf.train.Checkpoint(tensors=variables)
    options = tf.train.CheckpointOptions(enable_async=True)
    counter = iter(range(1, 100))
    timed = Timed(lambda: ckpt.write(os.path.join(work, f"ckpt-{next(counter)}"), options=options),
                  lambda _: ckpt.sync())

    def warm_and(fn: Callable[[], Any], prime: int) -> Dict[str, Any]:
        C.prime_free_memory(prime)
        update()  # touches every page of the state
        probe = C.Probe().start()
        out = fn()
        return {**probe.sample(), "out": out}

    first = warm_and(timed, 2 * nbytes)
    _remove(os.path.join(work, "ckpt-1*"))
    _settle()
    second = warm_and(timed, nbytes)
    reader = tf.train.load_checkpoint(os.path.join(work, "ckpt-2"))
    ok = all(C.verify(spec, [reader.get_tensor(f"tensors/{i}/.ATTRIBUTES/VARIABLE_VALUE")], indices=[i])
             for i in range(len(spec)))
    _remove(os.path.join(work, "ckpt-2*"))
    _settle()
    C.prime_free_memory(nbytes)
    third = _update_delta(update, timed)
    return {**{k: second["out"][k] for k in ("block_s", "commit_s")}, "peak_extra": second["peak_extra"],
            "cpu_s": second["cpu_s"], "first_block_s": first["out"]["block_s"],
            "first_commit_s": first["out"]["commit_s"], "first_peak_extra": first["peak_extra"],
            "values_ok": ok, "tf_version": tf.__version__, **third}


def w_dcp_async(spec: C.Spec, nbytes: int, work: str) -> Dict[str, Any]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    arrays = C.make_state(spec)
    state = {f"tensor_{i:03d}": torch.from_numpy(a) for i, a in enumerate(arrays)}
    counter = iter(range(1, 100))
    timed = Timed(lambda: dcp.async_save(state, checkpoint_id=os.path.join(work, f"dcp-{next(counter)}")),
                  lambda future: future.result())
    first = _phase(timed, 2 * nbytes, arrays)
    _remove(os.path.join(work, "dcp-1"))
    _settle()
    second = _phase(timed, 2 * nbytes, arrays)  # DCP's default stager copies into fresh memory each call
    loaded = {f"tensor_{i:03d}": torch.empty(shape, dtype=torch.float32) for i, (_, shape) in enumerate(spec)}
    dcp.load(loaded, checkpoint_id=os.path.join(work, "dcp-2"))
    ok = C.verify(spec, [t.numpy() for t in loaded.values()])
    del loaded
    _remove(os.path.join(work, "dcp-2"))
    _settle()

    def update() -> None:
        for t in state.values():
            t.add_(0)

    C.prime_free_memory(2 * nbytes)
    C.warm(arrays)
    third = _update_delta(update, timed)
    return {**{k: second["out"][k] for k in ("block_s", "commit_s")}, "peak_extra": second["peak_extra"],
            "cpu_s": second["cpu_s"], "first_block_s": first["out"]["block_s"],
            "first_commit_s": first["out"]["commit_s"], "first_peak_extra": first["peak_extra"],
            "values_ok": ok, "torch_version": torch.__version__, **third}


# =====================================================================================
# Driver
# =====================================================================================
def spawn(args: argparse.Namespace, system: str, size: str, tf: Optional[str]) -> Dict[str, Any]:
    work = os.path.join(args.dir, f"async-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    python = tf if SYSTEMS[system] == "tf" else sys.executable
    cmd = [python, os.path.abspath(__file__), "--worker", system, "--size", size, "--dir", work]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if SYSTEMS[system] == "tf":
        env.pop("PYTHONPATH", None)  # the TF side sees only this folder
    else:
        env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.join(REPO, "src")])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {system} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return C.parse_result(proc.stdout)


def _med(runs: List[Dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in runs if r.get(key) is not None]
    return C.median(values) if values else None


def summarize(runs: List[Dict[str, Any]], sizes: List[str]) -> Dict[str, Any]:
    rows, ratios = [], []
    for size in sizes:
        sel = {s: [r for r in runs if r["size"] == size and r["system"] == s] for s in SYSTEMS}
        med: Dict[str, Dict[str, Optional[float]]] = {}
        for system, rs in sel.items():
            if not rs:
                continue
            m = {k: _med(rs, k) for k in ("block_s", "commit_s", "first_block_s", "first_commit_s", "peak_extra",
                                          "first_peak_extra", "staging_bytes", "update_alone_s", "update_after_s")}
            med[system] = m
            nbytes = rs[0]["bytes"]
            rows.append({"size": size, "system": system, "bytes": nbytes, "runs": len(rs),
                         "values_ok": all(r.get("values_ok", True) for r in rs), **m})

        def ratio(label: str, a: str, ka: str, b: str, kb: str, target: Optional[str],
                  med: Dict[str, Dict[str, Optional[float]]] = med, size: str = size) -> None:
            va, vb = med.get(a, {}).get(ka), med.get(b, {}).get(kb)
            if va and vb:
                ratios.append({"size": size, "label": label, "value": va / vb, "target": target})

        ratio("(a) async save blocks / numpy copy", "shardckpt_async", "block_s", "numpy_copy", "block_s", "<= 1.2")
        ratio("(b) async save blocks / sync save", "shardckpt_async", "block_s", "shardckpt_sync", "commit_s", None)
        ratio("(c) async save to commit / sync save", "shardckpt_async", "commit_s", "shardckpt_sync", "commit_s",
              "<= 1.1")
        ratio("(d) async save blocks / TF async write returns", "shardckpt_async", "block_s", "tf_async", "block_s",
              "< 1")
        ratio("(d) async save blocks / DCP async_save returns", "shardckpt_async", "block_s", "dcp_async", "block_s",
              "< 1")
        ratio("    async save to commit / TF async to sync()", "shardckpt_async", "commit_s", "tf_async", "commit_s",
              None)
        ratio("    async save to commit / DCP async to result()", "shardckpt_async", "commit_s", "dcp_async",
              "commit_s", None)
    return {"rows": rows, "ratios": ratios}


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _pct(x: Optional[float], total: int) -> str:
    return "-" if x is None else f"{100 * x / total:.0f}%"


def print_report(summary: Dict[str, Any]) -> None:
    head = (f"{'size':>6} {'system':<16} {'blocks ms':>9} {'commit ms':>9} {'1st blk ms':>10} {'1st cmt ms':>10} "
            f"{'peak+':>6} {'1st peak+':>9} {'held':>6} {'upd alone':>9} {'upd after':>9} {'ok':>3}")
    print(head)
    for r in summary["rows"]:
        n = r["bytes"]
        print(f"{r['size']:>6} {r['system']:<16} {_ms(r['block_s']):>9} {_ms(r['commit_s']):>9} "
              f"{_ms(r['first_block_s']):>10} {_ms(r['first_commit_s']):>10} {_pct(r['peak_extra'], n):>6} "
              f"{_pct(r['first_peak_extra'], n):>9} {_pct(r['staging_bytes'], n):>6} "
              f"{_ms(r['update_alone_s']):>9} {_ms(r['update_after_s']):>9} {'yes' if r['values_ok'] else 'NO':>3}")
    print()
    for q in summary["ratios"]:
        target = f"  (target {q['target']})" if q["target"] else ""
        verdict = ""
        if q["target"]:
            op, bound = q["target"].split()
            met = q["value"] <= float(bound) if op == "<=" else q["value"] < float(bound)
            verdict = "  met" if met else "  NOT met"
        print(f"{q['size']:>6}  {q['label']:<50} {q['value']:7.3f}{target}{verdict}")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=list(SYSTEMS))
    p.add_argument("--size", default="1GiB", help="(worker) state size")
    p.add_argument("--sizes", default="1GiB,4GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dir", default="/tmp/shardckpt-bench", help="scratch folder (put it on the disk you care about)")
    p.add_argument("--tf-python", help="TensorFlow interpreter (default $SHARDCKPT_TF_PYTHON or .venv-tf)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--name", default="async", help="results file stem")
    args = C.parse_args(p, argv, sizes="2MiB", repeats=1, timeout=300)
    if args.worker:
        run_worker(args)
        return
    tf = C.tf_python(args.tf_python, REPO, required=args.smoke)
    systems = [s for s in args.systems.split(",") if s]
    if tf is None and "tf_async" in systems:
        log("TensorFlow interpreter not found (set SHARDCKPT_TF_PYTHON): skipping tf_async")
        systems.remove("tf_async")
    sizes = args.sizes.split(",")
    runs: List[Dict[str, Any]] = []
    failures: List[Dict[str, Any]] = []
    for size in sizes:
        for rep in range(args.repeats):
            for system in systems:
                try:
                    r = spawn(args, system, size, tf)
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                    log(f"  [{rep + 1}] {size} {system}: FAILED\n{exc}")
                    failures.append({"size": size, "system": system, "repeat": rep, "error": str(exc)})
                    continue
                r.update(size=size, repeat=rep)
                runs.append(r)
                log(f"  [{rep + 1}] {size:>6} {system:<16} blocks {r['block_s'] * 1e3:8.1f} ms, commit "
                    f"{r['commit_s'] * 1e3:8.1f} ms, peak extra {C.fmt_size(r['peak_extra'] or 0)}")
    summary = summarize(runs, sizes)
    print_report(summary)
    out = C.results_path(args.name)
    meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "sizes": sizes, "repeats": args.repeats,
            "dir": args.dir, "python": sys.executable, "tf_python": tf, "cpus": os.cpu_count(),
            "platform": platform.platform(), "numpy": np.__version__}
    with open(out, "w") as f:
        json.dump({"meta": meta, **summary, "runs": runs, "failures": failures}, f, indent=1)
    print(f"\nresults: {out}")
    C.finish(wrong=[f"[{r['repeat'] + 1}] {r['size']} {r['system']}" for r in runs if not r.get("values_ok", True)],
             failed=[f"[{f['repeat'] + 1}] {f['size']} {f['system']}" for f in failures])


if __name__ == "__main__":
    main()
