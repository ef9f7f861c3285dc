"""Benchmark parallel shard writing: shardckpt's sharded save against a raw parallel write.

For each state size and shard count, shardckpt saves the state with a callback that
splits it into N shards of equal bytes (written by N threads, fsynced, merged and
committed), and the raw baseline writes the same bytes from N threads into N files
(and fsyncs them). Ratios > 1 mean shardckpt is faster.

    .venv/bin/python benchmarks/bench_sharded.py                        # 1 GiB and 4 GiB, 1/2/4 shards
    .venv/bin/python benchmarks/bench_sharded.py --sizes 64MiB --repeats 1   # a quick look
    .venv/bin/python benchmarks/bench_sharded.py --smoke                     # smoke run (what the suite runs)

Each measurement runs in a fresh process; systems are interleaved; medians reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import common as C
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# -- workers ------------------------------------------------------------------------------
def _groups(arrays: List[np.ndarray], n: int) -> List[List[int]]:
    """Tensor indices split into ``n`` groups of about equal bytes (greedy, largest first)."""
    groups: List[List[int]] = [[] for _ in range(n)]
    sizes = [0] * n
    for i in sorted(range(len(arrays)), key=lambda i: -arrays[i].nbytes):
        g = sizes.index(min(sizes))
        groups[g].append(i)
        sizes[g] += arrays[i].nbytes
    return [sorted(g) for g in groups if g]


def w_raw(path: str, arrays: List[np.ndarray], shards: int, fsync: bool) -> None:
    def write(index: int, members: List[int]) -> None:
        fd = os.open(f"{path}.raw-{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in members:
                view = C.byte_view(arrays[i])
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:done + (1 << 30)])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if fsync:
            dfd = os.open(os.path.dirname(path), os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)

    groups = _groups(arrays, shards)
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        list(pool.map(lambda ig: write(*ig), enumerate(groups)))


def w_shardckpt(path: str, arrays: List[np.ndarray], names: List[str], shards: int, fsync: bool) -> None:
    import shardckpt

    class EqualShards(shardckpt.ShardingCallback):
        @property
        def description(self) -> str:
            return f"{shards} shards of equal bytes"

        def __call__(self, tensors):
            return [{tensors[i].checkpoint_key: {"": tensors[i].tensor} for i in group}
                    for group in _groups([t.tensor for t in tensors], shards)]

    shardckpt.save_tensors(path, dict(zip(names, arrays)),
                           shardckpt.CheckpointOptions(sharding_callback=EqualShards()),
                           fsync=fsync, max_workers=shards)


def run_worker(args: argparse.Namespace) -> None:
    spec = C.state_spec(args.state, C.parse_size(args.size))
    names = [n for n, _ in spec]
    arrays = C.make_state(spec)
    path = os.path.join(args.dir, "bench", "ck")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fsync = bool(args.fsync)
    # warm-up: one small save so imports, thread pools and the directory exist
    if args.worker == "shardckpt":
        w_shardckpt(path + "_warmup", [np.zeros(16, np.float32)], ["w"], 1, False)
    nbytes = C.spec_bytes(spec)
    C.prime_free_memory(nbytes)  # the page cache the writes will fill
    C.warm(arrays)
    probe = C.Probe().start()
    if args.worker == "raw":
        w_raw(path, arrays, args.shards, fsync)
    else:
        w_shardckpt(path, arrays, names, args.shards, fsync)
    result = probe.sample()
    if args.worker == "shardckpt":  # what the save wrote, checked after timing
        import shardckpt

        result["ok"] = C.verify(spec, shardckpt.restore_tensors(path, names))
    result.update(worker=args.worker, shards=args.shards, fsync=fsync, bytes=nbytes, state=args.state,
                  gbps=nbytes / 1e9 / result["seconds"])
    C.emit(result)


# -- driver -------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, worker: str, size: str, shards: int, fsync: bool) -> Dict:
    folder = os.path.join(args.dir, "bench")
    shutil.rmtree(folder, ignore_errors=True)
    os.sync()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--size", size, "--shards", str(shards),
           "--fsync", str(int(fsync)), "--dir", args.dir, "--state", args.state]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.join(REPO, "src")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {worker} failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(folder, ignore_errors=True)
    return C.parse_result(proc.stdout)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["raw", "shardckpt"])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--sizes", default="1GiB,4GiB")
    p.add_argument("--shard-counts", default="1,2,4")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--fsync", type=int, default=1)
    p.add_argument("--no-fsync-too", action="store_true", help="also measure without fsync")
    p.add_argument("--state", default="uniform", choices=["uniform", "transformer"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/shardckpt-bench")
    args = C.parse_args(p, argv, sizes="4MiB", shard_counts="1,4", no_fsync_too=True, repeats=1)
    if args.worker:
        run_worker(args)
        return
    fsyncs = [True, False] if args.no_fsync_too else [True]
    runs: List[Dict] = []
    for size in args.sizes.split(","):
        for fsync in fsyncs:
            for shards in [int(s) for s in args.shard_counts.split(",")]:
                for rep in range(args.repeats):
                    for worker in ("raw", "shardckpt"):
                        r = spawn(args, worker, size, shards, fsync)
                        r["size"] = size
                        runs.append(r)
                        print(f"  {size} fsync={int(fsync)} shards={shards} {worker:9s} rep {rep}: "
                              f"{r['gbps']:.2f} GB/s, peak extra {C.fmt_size(r['peak_extra'] or 0)}"
                              + ("" if r.get("ok", True) else "  WRONG VALUES"), flush=True)
    rows = []
    print(f"\n{'size':>6} {'fsync':>5} {'shards':>6} {'raw GB/s':>9} {'shardckpt GB/s':>14} {'ratio':>6} "
          f"{'peak extra':>11} {'% of state':>10}")
    for size in args.sizes.split(","):
        for fsync in fsyncs:
            for shards in [int(s) for s in args.shard_counts.split(",")]:
                sel = [r for r in runs if r["size"] == size and r["fsync"] == fsync and r["shards"] == shards]
                raw = C.median([r["gbps"] for r in sel if r["worker"] == "raw"])
                ours = [r for r in sel if r["worker"] == "shardckpt"]
                sc = C.median([r["gbps"] for r in ours])
                peak = C.median([r["peak_extra"] or 0 for r in ours])
                frac = peak / ours[0]["bytes"]
                rows.append(dict(size=size, fsync=fsync, shards=shards, raw_gbps=raw, shardckpt_gbps=sc,
                                 ratio=sc / raw, peak_extra=peak, peak_fraction=frac))
                print(f"{size:>6} {int(fsync):>5} {shards:>6} {raw:>9.2f} {sc:>14.2f} {sc / raw:>6.2f} "
                      f"{C.fmt_size(peak):>11} {100 * frac:>9.1f}%")
    print()
    C.write_results("sharded", {"rows": rows, "runs": runs, "argv": sys.argv})
    C.finish(wrong=[f"{r['size']} fsync={int(r['fsync'])} shards={r['shards']} {r['worker']} save"
                    for r in runs if not r.get("ok", True)])


if __name__ == "__main__":
    main()
