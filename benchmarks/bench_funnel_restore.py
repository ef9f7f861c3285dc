"""Funnelled restores: every client reading its own pieces vs the io client reading for all.

One ``torchrun --standalone --nproc-per-node N`` launch (gloo). The clients save a
``DTensorCheckpoint`` of 64 float32 tensors of ``(rows, 1024)`` (``--size`` bytes in all) laid
out ``["x", unsharded]`` on ``create_distributed_mesh([("x", N)])``, then restore it into
existing (warmed) components, alternating, ``--repeats`` times each:

* ``direct``: ``DTensorCheckpoint.read(prefix)``: every client reads its own rows;
* ``funnelled``: ``read(prefix, CheckpointOptions(io_device=<task 0>))``: client 0 reads every
  byte and sends each client its rows over gloo (in-flight budget ``--budget``);
* the same two onto the transposed layout ``[unsharded, "x"]`` (a resharded restore: each
  client needs a column band of every stored row block).

Times run from a barrier to the slowest client's return (page cache warm: the files were just
written). Medians; throughput = total bytes / time.

    .venv/bin/python benchmarks/bench_funnel_restore.py                     # 4 clients, 256 MiB
    .venv/bin/python benchmarks/bench_funnel_restore.py --size 32MiB --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import common as C  # noqa: E402

TENSORS, COLS = 64, 1024


def _bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)


def worker(size: int, repeats: int, budget: int, folder: str) -> None:
    import numpy as np

    from shardckpt import CheckpointOptions
    from shardckpt import dtensor as dt
    from shardckpt.distributed import get_coordinator

    coord = get_coordinator()
    n, rank = coord.size, coord.rank
    mesh = dt.create_distributed_mesh([("x", n)])
    rows = max(n, size // (TENSORS * COLS * 4) // n * n)

    def layouts(spec: List[str]) -> Dict[str, Any]:
        return {f"w{i:03d}": dt.DVariable.from_global(
            np.full((rows, COLS), i, np.float32) + np.arange(rows, dtype=np.float32)[:, None],
            dt.Layout(spec, mesh)) for i in range(TENSORS)}

    prefix = os.path.join(folder, "ck")
    dt.DTensorCheckpoint(mesh, **layouts(["x", "unsharded"])).write(prefix)
    io = CheckpointOptions(io_device="/job:worker/replica:0/task:0/device:CPU:0", funnel_inflight_bytes=budget)
    times: Dict[str, List[float]] = {}
    for spec, tag in ((["x", "unsharded"], ""), (["unsharded", "x"], "_resharded")):
        targets = layouts(spec)
        for v in targets.values():
            for c in v.value().components.values():
                c.fill(-1)
        for r in range(repeats):
            order = [("direct", None), ("funnelled", io)] if r % 2 == 0 else [("funnelled", io), ("direct", None)]
            for name, options in order:
                coord.barrier("start")
                t0 = time.perf_counter()
                dt.DTensorCheckpoint(mesh, **targets).read(prefix, options=options).expect_partial()
                coord.barrier("end")
                times.setdefault(name + tag, []).append(time.perf_counter() - t0)
        for i, v in enumerate(targets.values()):  # values checked after timing
            for device, comp in v.value().components.items():
                box = v.value().box(device)
                want = np.full(comp.shape, i, np.float32) + np.arange(*box[0], dtype=np.float32)[:, None]
                assert np.array_equal(comp, want), (rank, i, device)
    if rank == 0:
        total = TENSORS * rows * COLS * 4
        print("RESULT " + json.dumps({"clients": n, "bytes": total, "budget": budget,
                                      "median_s": {k: statistics.median(v) for k, v in times.items()},
                                      "runs_s": times}), flush=True)
    coord.barrier("done")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--size", default="256MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", default="64MiB")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = C.parse_args(p, clients="2", size="1MiB", repeats="1", budget="64KiB")
    if args.worker:
        worker(_bytes(args.size), args.repeats, _bytes(args.budget), args.folder)
        return
    folder = tempfile.mkdtemp(dir=args.dir, prefix="funnel-")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={args.clients}", os.path.abspath(__file__),
                               "--worker", "--folder", folder, "--size", args.size, "--repeats", str(args.repeats),
                               "--budget", args.budget], capture_output=True, text=True, env=env, timeout=3600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"benchmark failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][7:])
    mb = r["bytes"] / 1e6
    print(f"{r['clients']} clients, {mb:.0f} MB, budget {C.fmt_size(r['budget'])} (medians of {args.repeats})")
    print(f"{'restore':<22} {'s':>7} {'MB/s':>7} {'vs direct':>9}")
    for tag in ("", "_resharded"):
        base = r["median_s"]["direct" + tag]
        for name in ("direct", "funnelled"):
            t = r["median_s"][name + tag]
            print(f"{name + tag:<22} {t:>7.3f} {mb / t:>7.0f} {base / t:>9.2f}")
    C.write_results("funnel-restore", dict(r, repeats=args.repeats))


if __name__ == "__main__":
    main()
