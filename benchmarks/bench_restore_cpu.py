"""Where a checksummed restore's CPU goes, in one process: planning per tensor, and wall and CPU
seconds of ``restore_tensors`` into existing arrays against a raw ``readinto`` of the same bytes.

On a shared machine the wall-clock ratio of ``bench_bundle.py`` depends on how many cores are
free; CPU seconds do not. A restore can use two cores; with one free its wall time is its CPU
time, so the ratio it can reach there is raw CPU / restore CPU. Three figures, all from page
cache (the files are written first and read once before timing):

* planning: CPU time of the calling thread per tensor while ``ReadSession.read_many`` plans the
  whole-tensor reads of the state (index lookup, checks, read objects, hand-over to the pump),
  with a reader that has no helper threads (``ChecksumContext(0)``), so nothing else runs on
  that thread until planning ends; then the reads and checks (``finish``), for the record;
* raw: ``readinto`` of the same bytes from one flat file into the same warmed arrays;
* restore: ``restore_tensors`` of every tensor into those arrays, every CRC32C checked.

Raw and restore alternate ``--repeats`` times; medians are printed with the load average::

    .venv/bin/python benchmarks/bench_restore_cpu.py --state transformer --size 1GiB
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Callable, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def _timed(fn: Callable[[], object]) -> Tuple[float, float]:
    """Wall seconds and process CPU seconds (all threads) of ``fn()``."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", default="transformer", help="uniform (64 tensors) or transformer (485)")
    ap.add_argument("--size", type=C.parse_size, default=C.GIB)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=os.path.join("/tmp", "shardckpt-bench-cpu"))
    args = C.parse_args(ap, size="4MiB", repeats=1)

    import shardckpt
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.format.crc import ChecksumContext
    from shardckpt.storage.registry import get_fs

    spec = C.state_spec(args.state, args.size)
    names = [name for name, _ in spec]
    os.makedirs(args.dir, exist_ok=True)
    prefix = os.path.join(args.dir, f"{args.state}-{args.size}")
    raw_path = prefix + ".raw"
    arrays = C.make_state(spec)
    shardckpt.save_tensors(prefix, dict(zip(names, arrays)))
    with open(raw_path, "wb") as f:
        for a in arrays:
            f.write(C.byte_view(a))
    del arrays
    dest = C.alloc(spec)
    C.warm(dest)

    def raw() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            for a in dest:
                buf = C.byte_view(a)
                done = 0
                while done < len(buf):
                    done += f.readinto(buf[done:])

    def restore() -> None:
        shardckpt.restore_tensors(prefix, [shardckpt.RestoreRequest(n, out=a) for n, a in zip(names, dest)])

    no_helpers = ChecksumContext(0)
    plan: List[float] = []
    check: List[float] = []
    for _ in range(args.repeats):
        with BundleReader(prefix, fs=get_fs(prefix), context=no_helpers) as reader:
            session = reader.session()
            read_many = getattr(session, "read_many", None)  # (older versions: one read_region per tensor)
            t0 = time.thread_time()
            if read_many is not None:
                read_many(names, dest)
            else:
                for name, a in zip(names, dest):
                    session.read_region(name, None, a)
            t1 = time.thread_time()
            session.finish()
            t2 = time.thread_time()
        plan.append(t1 - t0)
        check.append(t2 - t1)

    raw()
    restore()  # first-call costs (thread pools) paid before timing
    raws, restores = [], []
    for _ in range(args.repeats):
        raws.append(_timed(raw))
        restores.append(_timed(restore))
    for a in dest:  # the values checked: one more restore into zeroed arrays (raw reads wrote them too)
        a.fill(0)
    restore()
    ok = C.verify(spec, dest)
    load = open("/proc/loadavg").read().split()[:3]

    def med(runs: List[Tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in runs)

    n = len(names)
    print(f"{args.state}: {n} tensors, {C.fmt_size(C.spec_bytes(spec))}, medians of {args.repeats}; "
          f"load average {' '.join(load)}; values {'ok' if ok else 'WRONG'}")
    print(f"  planning (calling thread CPU)     {statistics.median(plan) / n * 1e6:7.1f} us per tensor "
          f"(reads and checks afterwards on the same thread: {statistics.median(check):.3f} s)")
    print(f"  raw readinto                      {med(raws, 0):7.3f} s wall  {med(raws, 1):7.3f} s CPU")
    print(f"  restore_tensors, checksummed      {med(restores, 0):7.3f} s wall  {med(restores, 1):7.3f} s CPU")
    print(f"  ratio (raw / restore)             {med(raws, 0) / med(restores, 0):7.2f} wall  "
          f"{med(raws, 1) / med(restores, 1):7.2f} CPU (the wall ratio with one free core)")
    C.write_results("restore-cpu", {
        "state": args.state, "tensors": n, "bytes": C.spec_bytes(spec), "repeats": args.repeats, "load": load,
        "values_ok": ok, "plan_s_per_tensor": statistics.median(plan) / n, "check_s": statistics.median(check),
        "raw_s": med(raws, 0), "raw_cpu_s": med(raws, 1), "restore_s": med(restores, 0),
        "restore_cpu_s": med(restores, 1), "runs": {"plan": plan, "check": check, "raw": raws, "restore": restores}})
    for name in os.listdir(args.dir):
        if name.startswith(os.path.basename(prefix) + "."):
            os.remove(os.path.join(args.dir, name))
    C.finish(wrong=[] if ok else [f"restore_tensors into arrays from {prefix}"])


if __name__ == "__main__":
    main()
