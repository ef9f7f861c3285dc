"""Before/after: the same benchmark workers run against two revisions of the library, in one run.

For each case, the *current* tree's benchmark worker (``bench_bundle``, ``bench_sharded``,
``bench_async``) runs in a fresh process with ``PYTHONPATH`` pointing at the base
revision's ``src`` or at this tree's ``src``, alternating (base, new, base, new, ...);
medians per revision and the ratio new/base are printed (a ratio > 1 of a time is a
slowdown). The base revision is checked out into a temporary ``git worktree``.

    .venv/bin/python benchmarks/compare_revisions.py --base 6415933 --size 256MiB --repeats 5
    .venv/bin/python benchmarks/compare_revisions.py --base-src /tmp/base/src   # an unpacked tree instead
    .venv/bin/python benchmarks/compare_revisions.py --smoke   # every case, 1 MiB, once, this tree against itself

A worker that reports values read back wrong (``ok`` / ``values_ok`` false) makes the run exit non-zero.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import common as C  # noqa: E402

# (label, script, worker arguments (with {size} and {dir}), metrics: suffixes of the flattened result keys to
# show (empty: every numeric figure); a worker named "setup_*" first when the case reads a checkpoint)
CASES: List[Tuple[str, str, List[str], Dict[str, str]]] = [
    ("save_v2 + fsync, 64 tensors", "bench_bundle.py",
     ["--worker", "shardckpt_save_fsync", "--state", "uniform", "--size", "{size}", "--dir", "{dir}", "--no-cold"],
     {".seconds": "time"}),
    ("save_v2 + fsync, 485 tensors", "bench_bundle.py",
     ["--worker", "shardckpt_save_fsync", "--state", "transformer", "--size", "{size}", "--dir", "{dir}",
      "--no-cold"], {".seconds": "time"}),
    ("restore into arrays, 485 tensors", "bench_bundle.py",
     ["--worker", "shardckpt_restore_into", "--state", "transformer", "--size", "{size}", "--dir", "{dir}",
      "--no-cold"], {".seconds": "time"}),
    ("Checkpoint.read, 485 tensors", "bench_bundle.py",
     ["--worker", "shardckpt_checkpoint_read", "--state", "transformer", "--size", "{size}", "--dir", "{dir}",
      "--no-cold"], {".seconds": "time"}),
    ("raw readinto, 485 tensors (the floor)", "bench_bundle.py",
     ["--worker", "raw_read", "--state", "transformer", "--size", "{size}", "--dir", "{dir}",
      "--no-cold"], {".seconds": "time"}),
    ("Checkpoint.write + fsync, 485 tensors", "bench_bundle.py",
     ["--worker", "shardckpt_write_fsync", "--state", "transformer", "--size", "{size}", "--dir", "{dir}",
      "--no-cold"], {".seconds": "time"}),
    ("two parallel raw write+fsync streams, 485 tensors (the floor)", "bench_bundle.py",
     ["--worker", "raw_write_fsync_parallel", "--state", "transformer", "--size", "{size}", "--dir", "{dir}",
      "--no-cold"], {".seconds": "time"}),
    ("sharded save, 2 shards + fsync", "bench_sharded.py",
     ["--worker", "shardckpt", "--size", "{size}", "--shards", "2", "--fsync", "1", "--dir", "{dir}",
      "--state", "uniform"], {"seconds": "time"}),
    ("sharded save, 4 shards + fsync", "bench_sharded.py",
     ["--worker", "shardckpt", "--size", "{size}", "--shards", "4", "--fsync", "1", "--dir", "{dir}",
      "--state", "uniform"], {"seconds": "time"}),
    ("async Checkpoint.save", "bench_async.py",
     ["--worker", "shardckpt_async", "--size", "{size}", "--dir", "{dir}"], {}),
]


# bench_bundle workers that read a checkpoint -> the worker that writes it first (untimed)
SETUPS = {"shardckpt_restore": "setup_shardckpt", "shardckpt_restore_into": "setup_shardckpt",
          "shardckpt_checkpoint_read": "setup_checkpoint", "raw_read": "setup_raw"}


def _spawn(script: str, args: List[str], src: str) -> Dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, src]), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args], capture_output=True, text=True,
                          env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return C.parse_result(proc.stdout)


def run(script: str, args: List[str], src: str, work: str) -> Dict:
    """One measurement in a fresh process (after the case's setup worker, when it reads a checkpoint)."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    if script == "bench_bundle.py" and args[1] in SETUPS:
        setup = ["--worker", SETUPS[args[1]]] + args[2:]
        _spawn(script, setup, src)
    os.sync()
    try:
        return _spawn(script, args, src)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def numeric(result: Dict, prefix: str = "") -> Dict[str, float]:
    """Every numeric figure of a worker's result, nested keys joined with dots."""
    out: Dict[str, float] = {}
    for k, v in result.items():
        if isinstance(v, dict):
            out.update(numeric(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def wrong_values(result: Dict, prefix: str = "") -> List[str]:
    """The value checks (``ok`` / ``values_ok``) of a worker's result that failed, nested keys joined with dots."""
    out: List[str] = []
    for k, v in result.items():
        if isinstance(v, dict):
            out += wrong_values(v, f"{prefix}{k}.")
        elif k in ("ok", "values_ok") and v is False:
            out.append(f"{prefix}{k}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="git revision to compare against (checked out into a temporary worktree)")
    p.add_argument("--base-src", help="or: the base revision's src folder, already on disk")
    p.add_argument("--size", default="256MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--cases", default="", help="comma list of case numbers (default: all)")
    args = C.parse_args(p, size="1MiB", repeats=1, base_src=os.path.join(REPO, "src"))
    if bool(args.base) == bool(args.base_src) and not (args.smoke and args.base):
        p.error("give one of --base REV and --base-src DIR")
    base_tree = ""
    if args.base:
        base_tree = tempfile.mkdtemp(prefix="shardckpt-base-")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", base_tree, args.base], check=True)
    base_src = os.path.join(base_tree, "src") if args.base else os.path.abspath(args.base_src)
    chosen = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    wrong: List[str] = []
    try:
        print(f"base {args.base or base_src} vs working tree, size {args.size}, {args.repeats} repeats each, "
              "alternating")
        for label, script, template, metrics in chosen:
            results: Dict[str, List[Dict[str, float]]] = {"base": [], "new": []}
            for _ in range(args.repeats):
                for which, src in (("base", base_src), ("new", os.path.join(REPO, "src"))):
                    work = os.path.join(args.dir, f"compare-{os.getpid()}")
                    argv = [a.format(size=args.size, dir=work) for a in template]
                    result = run(script, argv, src, work)
                    wrong += [f"{label}, {which}: {w}" for w in wrong_values(result)]
                    results[which].append(numeric(result))
            keys = sorted(set(results["base"][0]) & set(results["new"][0]))
            if metrics:
                keys = [k for k in keys if any(k.endswith(m) for m in metrics)]
            print(f"\n{label}")
            for key in keys:
                b = C.median([r[key] for r in results["base"] if key in r])
                n = C.median([r[key] for r in results["new"] if key in r])
                ratio = n / b if b else float("nan")
                print(f"  {key:28s} base {b:10.4f}  new {n:10.4f}  new/base {ratio:6.3f}")
    finally:
        if base_tree:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_tree], check=False)
    C.finish(wrong=wrong)


if __name__ == "__main__":
    main()
