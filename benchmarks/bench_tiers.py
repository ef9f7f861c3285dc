"""Tiered checkpoints: saves to node-local tiers with replicas, restores from them, recovery of a lost node.

One ``torchrun --standalone --nproc-per-node 4`` launch (gloo), the clients as two simulated
nodes (``SHARDCKPT_NODE = rank // 2``). The state: 64 float32 tensors of ``(rows, 1024)``
(``--size`` bytes in all) laid out ``["x", unsharded]`` on ``create_distributed_mesh([("x", 4)])``
(each client holds a quarter), in a ``Checkpoint`` managed by
``CheckpointManager(<dir>/persistent, local=LocalTier(<tier>/{node}, replicas=1, keep=1))``; the
tier folder is ``--tier`` (default ``/dev/shm``, a RAM disk), the persistent one ``--dir``.
Phases, each repeat alternating their order, each timed from a barrier to the end of the
slowest client's call:

* ``memcpy``: each client copies its components into preallocated arrays (the host copy);
* ``tier save``: ``manager.save()`` to the tiers only (each node's bundle written, sent to
  the other node, committed), synchronous;
* ``async tier save (blocking)``: the same with ``CheckpointOptions(enable_async=True)``: the
  time the call blocks (the host copy); ``sync()`` after it, untimed;
* ``persistent save``: ``manager.save()`` of a save that also persists (what a persistent
  save costs; every ``persist_every``-th save pays it): it returns once the persistent
  checkpoint is committed; its copy into the tiers runs behind it, timed apart until it is
  committed (``manager.sync()``: "persistent save: tier copy behind it");
* ``save without a tier``: today's ``CheckpointManager`` (no ``local=``) saving the same state
  into a folder of its own;
* ``tier restore``: ``restore_or_initialize()`` from the tiers (nothing lost);
* ``cold persistent restore``: ``Checkpoint.restore`` of the persistent checkpoint after its
  files were dropped from the page cache (``common.uncache``: ``POSIX_FADV_DONTNEED``; not the
  whole page cache: freeing gigabytes at once makes this VM hand them back to the host for
  seconds on its own cores, which slowed the next phases, a recovery right after one by half;
  ``--no-cold`` or a smoke run: warm);
* ``recovery``: node 1's tier removed, then ``restore_or_initialize()``: node 1's clients restore
  from node 0's replica over gloo; the bytes read from the persistent folder are counted (0).
  Node 1's tier is repopulated behind it, timed apart until committed (``sync()``: "recovery:
  tier repopulated behind it"; a revision that repopulates first shows ~0 there);
* ``another layout``: ``restore_or_initialize()`` of a state laid out ``[unsharded, "x"]`` (each
  client a quarter of the columns: pieces both nodes saved): each client's read of its own node's
  bundle fails at planning, then it reads a merged view of both bundles its node holds (its own and
  the replica; tiers/merged.py); 0 bytes between nodes or from the persistent folder. Every client
  reads each row block whole and cuts its columns out, as any restore onto this layout does:
  ``another layout, cold persistent`` is the same restore from the persistent checkpoint after its
  files were dropped from the page cache.

* the floors, what the hardware allows these restores at best, on the same bytes (each client's
  share, in a file of its own on the tier's RAM disk), with nothing of shardckpt but its CRC32C:
  ``floor: read + CRC``: each client reads its share (``preadv`` of 16 MiB chunks into a buffer in
  use), each chunk's CRC right behind its read (what a tier restore must do at least);
  ``floor: between nodes + CRC``: node 0's clients send their share (mapped pages, 16 MiB messages,
  ``send_many``) to node 1's, which CRC each message as it lands; ``floor: node 0's read + CRC``:
  node 0's clients alone read theirs (what a recovery adds on a machine where the transfer and the
  holders' reads share two cores). The ratios to them say how far a restore is from the machine's
  limit; ``cold persistent restore / floor: read + CRC`` is the most that "cold / tier restore" can
  reach on this machine.

A first round runs every phase untimed (what a process pays once: pools, buffers, connections).
Before each phase the page cache's dirty pages are written back (``os.sync()``, untimed), so
that no phase pays for an earlier one's write-back, and each client primes the free memory the
phase will allocate (``common.prime_free_memory``: touched and freed, untimed): before a save,
``--prime`` (2) times its share of the state (its node's bundle and the replica it receives; the
same before the ``memcpy`` the asynchronous save is compared with); before
a cold persistent restore, one share (the page cache of what it reads), ``--prime`` allowing;
before the restores from the tiers and the floors, nothing (they read into arrays made before the
phase, from pages already in memory); not before the tier copy behind a persistent save, which is
already running. This VM hands memory freed for ~2 s back to the host and a write's page cache
then costs ~2.3 s/GiB to allocate (0.2 s/GiB from memory freed a moment ago), so that without it
a phase's time depended on what ran before it (a save right after a tier save's retention freed
2 GiB ran at 0.5 s, the same save at another position up to 1.6 s). Priming a phase that
allocates nothing only slows it: with two shares primed before every phase, the tier restore
took 0.225 s and the recovery 0.478 s (medians of 6), against 0.190 s and 0.367 s with none,
while the cold persistent restore took 0.567 s and 0.576 s. Every restore's values are checked
after timing. Medians; the ratios are what to read.

    .venv/bin/python benchmarks/bench_tiers.py                 # 1 GiB, 3 repeats
    .venv/bin/python benchmarks/bench_tiers.py --smoke
    .venv/bin/python benchmarks/bench_tiers.py --src /tmp/base/src      # another revision (before/after)
"""

from __future__ import annotations

import argparse
import gc
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

TENSORS, COLS, CLIENTS = 64, 1024, 4


def floor_phases(coord: Any, path: str, buffer: Any, chunk: int = 16 << 20) -> List[Any]:
    """The floor phases (module docstring), as ``(name, fn)``: ``path`` holds this client's share,
    ``buffer`` (as large) receives it; clients ``2k`` and ``2k + 1`` are node ``k``."""
    import mmap

    from shardckpt.format import crc

    rank, size = coord.rank, len(buffer)
    view = memoryview(buffer)
    chunks = [(at, min(chunk, size - at)) for at in range(0, size, chunk)]

    def read_and_crc() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for at, length in chunks:
                got = 0
                while got < length:
                    got += os.preadv(fd, [view[at + got:at + length]], at + got)
                crc.value(view[at:at + length])
        finally:
            os.close(fd)

    def between_nodes() -> None:
        if rank < 2:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as pages:
                mapped = memoryview(pages)
                coord.send_many([mapped[at:at + length] for at, length in chunks], rank + 2, tag=5)
                mapped.release()
        elif rank < 4:
            pool = crc.shared_executor()
            checks: List[Any] = []
            coord.recv_many(rank - 2, [view[at:at + length] for at, length in chunks], tag=5,
                            landed=lambda i: checks.append(pool.submit(crc.value, view[chunks[i][0]:
                                                                                      sum(chunks[i])])))
            for check in checks:
                check.result()

    def node0_read() -> None:
        if rank < 2:
            read_and_crc()

    return [("floor: read + CRC", read_and_crc), ("floor: between nodes + CRC", between_nodes),
            ("floor: node 0's read + CRC", node0_read)]


def worker(size: int, repeats: int, folder: str, tier_root: str, cold: bool, prime: float) -> None:
    import numpy as np

    import shardckpt
    from shardckpt import dtensor as dt
    from shardckpt.distributed import get_coordinator
    from shardckpt.storage.local import LocalFileSystem

    coord = get_coordinator()
    n, rank = coord.size, coord.rank
    mesh = dt.create_distributed_mesh([("x", n)])
    rows = max(n, size // (TENSORS * COLS * 4) // n * n)
    persistent = os.path.join(folder, "persistent")
    read_persistent = [0]
    pread = LocalFileSystem.pread_into

    def counting(self, fd, buf, offset, path=""):
        if str(path).startswith(persistent):
            read_persistent[0] += memoryview(buf).nbytes
        return pread(self, fd, buf, offset, path)

    LocalFileSystem.pread_into = counting  # type: ignore[method-assign]

    def variables(generation: int, spec: Any = ("x", "unsharded")) -> Dict[str, Any]:
        return {f"w{i:03d}": dt.DVariable.from_global(
            np.full((rows, COLS), i + generation, np.float32) + np.arange(rows, dtype=np.float32)[:, None],
            dt.Layout(list(spec), mesh)) for i in range(TENSORS)}

    def components(vs: Dict[str, Any]) -> List[Any]:
        return [c for v in vs.values() for c in v.value().components.values()]

    def manager_of(vs: Dict[str, Any]) -> Any:
        tier = shardckpt.LocalTier(os.path.join(tier_root, "{node}"), replicas=1, keep=1)
        return shardckpt.CheckpointManager(shardckpt.Checkpoint(**vs), persistent, max_to_keep=1, local=tier,
                                           persist_every=2)

    state = variables(1)
    manager = manager_of(state)
    plain = shardckpt.CheckpointManager(shardckpt.Checkpoint(**state), os.path.join(folder, "plain"), max_to_keep=1)
    times: Dict[str, List[float]] = {}
    wrong: List[str] = []
    counts: Dict[str, int] = {}

    def timed(name: str, fn: Any, shares: float = 0.0) -> Any:
        gc.collect()  # earlier phases' models (reference cycles) freed now, not by a collection in this one
        if rank == 0:
            os.sync()  # no earlier save's write-back left to slow this phase's fsyncs
        # memory untouched for seconds goes back to the host here (common.warm): the state, the
        # memcpy targets and the tiered manager's host-copy buffers (reused from save to save) are
        # touched right before every phase, as a training loop saving each step keeps them
        C.warm(sources + copies + [b for b in manager._tiered._buffers.values() if b.dtype != object])
        if shares:  # the memory the phase's writes and page cache take (common.prime_free_memory)
            C.prime_free_memory(int(min(shares, prime) * share))
        coord.barrier("start " + name)
        t0 = time.perf_counter()
        out = fn()
        mine = time.perf_counter() - t0
        # the slowest client's own call (what the call blocked it for): a barrier right after an async
        # call would also time the barrier itself competing with the saves just started behind it
        slowest = max(coord.all_gather(mine))
        if recording[0]:
            times.setdefault(name, []).append(slowest)
        return out

    def check(name: str, vs: Dict[str, Any], generation: int) -> None:
        for i, v in enumerate(vs.values()):
            for device, comp in v.value().components.items():
                box = v.value().box(device)
                want = np.full(comp.shape, i + generation, np.float32) + np.arange(*box[0], dtype=np.float32)[:, None]
                if not np.array_equal(comp, want):
                    wrong.append(f"{name}: rank {rank} w{i:03d}")
                    return

    sources = components(state)
    share = TENSORS * rows * COLS * 4 // n
    floor_file = os.path.join(tier_root, f"floor-{rank}")  # this client's share, on the tier's RAM disk
    with open(floor_file, "wb") as f:
        f.write(np.random.default_rng(rank).integers(0, 256, share, np.uint8).data)
    floor_buffer = np.ones(share, np.uint8)
    floors = floor_phases(coord, floor_file, floor_buffer)
    copies = [np.empty_like(c) for c in sources]
    C.warm(copies)
    saved = 0
    recording = [False]
    for r in range(-1, repeats):  # round -1: every phase once, untimed (first-use costs are not a phase's)
        recording[0] = r >= 0
        timed("memcpy", lambda: [np.copyto(d, s) for d, s in zip(copies, sources)], prime)
        # save numbers alternate: odd ones go to the tiers only, even ones also persist (persist_every=2)
        kinds = ["tier save", "async tier save (blocking)", "persistent save", "save without a tier"]
        for name in kinds[r % 4:] + kinds[:r % 4]:
            if name == "save without a tier":  # today's manager, into a folder of its own
                timed(name, plain.save, prime)
                continue
            if ((saved + 1) % 2 == 0) != (name == "persistent save"):
                manager.save()  # brings the numbering to this phase's kind, untimed
                manager.sync()  # with what runs behind it (a persisted step's tier copy)
                saved += 1
            if name.startswith("async"):
                timed(name, lambda: manager.save(options=shardckpt.CheckpointOptions(enable_async=True)), prime)
                manager.sync()
            else:
                timed(name, manager.save, prime)
                if name == "persistent save":  # its copy into the tiers runs behind it: until committed
                    timed("persistent save: tier copy behind it", manager.sync)
            saved += 1
        if saved % 2 == 1:
            manager.save()  # the tiers' newest step is then also the persistent one
            manager.sync()
            saved += 1
        latest = manager.latest_checkpoint
        phases = ["tier restore", "cold persistent restore", "recovery", "another layout",
                  "another layout, cold persistent"]
        for name in phases[r % 5:] + phases[:r % 5]:
            target = fresh = None  # the previous phase's model freed before this one's is made
            gc.collect()
            target = variables(-1, ("unsharded", "x") if name.startswith("another") else ("x", "unsharded"))
            for c in components(target):
                c.fill(-7)
            if name.startswith("cold persistent restore") or name.endswith("cold persistent"):
                coord.barrier("drop")
                if rank == 0 and cold:
                    C.uncache(persistent)
                timed(name, lambda target=target, latest=latest: shardckpt.Checkpoint(**target).restore(latest),
                      1.0)
            else:
                if name == "recovery":
                    coord.barrier("wipe")
                    if rank == 2:
                        shutil.rmtree(os.path.join(tier_root, "1"))
                    coord.barrier("wiped")
                before = read_persistent[0]
                fresh = manager_of(target)
                timed(name, fresh.restore_or_initialize)
                if name == "recovery":  # the lost node's tier is repopulated behind the restore: until committed
                    timed("recovery: tier repopulated behind it", fresh.sync)
                counts[name + " bytes from persistent"] = read_persistent[0] - before
                counts[name + " bytes between nodes"] = fresh.local.last_restore.bytes_received
                if fresh.local.last_restore.step is None:
                    wrong.append(f"{name}: not restored from the tiers ({fresh.local.last_restore.reason})")
            check(name, target, 1)
        for name, fn in floors:
            C.warm([floor_buffer])
            timed(name, fn)
    os.remove(floor_file)
    gathered = coord.all_gather({"wrong": wrong, "counts": counts})
    if rank == 0:
        total_counts: Dict[str, int] = {}
        for g in gathered:
            for k, v in g["counts"].items():
                total_counts[k] = total_counts.get(k, 0) + int(v)
        print("RESULT " + json.dumps({"clients": n, "bytes": TENSORS * rows * COLS * 4, "cold": cold,
                                      "median_s": {k: statistics.median(v) for k, v in times.items()},
                                      "runs_s": times, "counts": total_counts,
                                      "wrong": [w for g in gathered for w in g["wrong"]]}), flush=True)
    coord.barrier("done")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="scratch folder (the persistent directory)")
    p.add_argument("--tier", default="/dev/shm", help="where the simulated nodes' tier folders go")
    p.add_argument("--no-cold", action="store_true",
                   help="do not drop the persistent files' page cache before persistent restores")
    p.add_argument("--prime", type=float, default=2.0,
                   help="free memory each client primes before each phase, in multiples of its share of the state")
    p.add_argument("--src", default=os.path.join(REPO, "src"),
                   help="the shardckpt source tree the clients import (another revision's src: before/after)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--tier-root", help=argparse.SUPPRESS)
    args = C.parse_args(p, size="4MiB", repeats="1", no_cold=True)
    if args.worker:
        os.environ["SHARDCKPT_NODE"] = str(int(os.environ.get("RANK", "0")) // 2)
        worker(C.parse_size(args.size), args.repeats, args.folder, args.tier_root, not args.no_cold, args.prime)
        return
    folder = tempfile.mkdtemp(dir=args.dir, prefix="tiers-")
    tier_root = tempfile.mkdtemp(dir=args.tier, prefix="tiers-")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.abspath(args.src), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={CLIENTS}", os.path.abspath(__file__),
                               "--worker", "--folder", folder, "--tier-root", tier_root, "--size", args.size,
                               "--repeats", str(args.repeats), "--prime", str(args.prime)]
                              + (["--no-cold"] if args.no_cold else []),
                              capture_output=True, text=True, env=env, timeout=3600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(tier_root, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"benchmark failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][7:])
    med = r["median_s"]
    load = os.getloadavg()
    print(f"src {args.src}: {r['clients']} clients as 2 nodes, {C.fmt_size(r['bytes'])}, cold={r['cold']}, "
          f"prime={args.prime}, medians of "
          f"{args.repeats}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'phase':<40} {'s':>8}")
    for name, t in med.items():
        print(f"{name:<40} {t:>8.3f}")
    print(f"{'ratio':<80} {'value':>8}")
    ratios = {"async tier save blocking / memcpy": med["async tier save (blocking)"] / med["memcpy"],
              "tier save (sync) / memcpy": med["tier save"] / med["memcpy"],
              "persistent save / tier save": med["persistent save"] / med["tier save"],
              "persistent save (tiered manager) / save without a tier": med["persistent save"]
              / med["save without a tier"],
              "cold persistent restore / tier restore": med["cold persistent restore"] / med["tier restore"],
              "cold persistent restore / recovery (1 node wiped)": med["cold persistent restore"] / med["recovery"],
              "another layout: cold persistent / from the tiers": med["another layout, cold persistent"]
              / med["another layout"],
              "tier restore / floor: read + CRC": med["tier restore"] / med["floor: read + CRC"],
              "recovery / floor: between nodes + CRC, then node 0's read + CRC": med["recovery"]
              / (med["floor: between nodes + CRC"] + med["floor: node 0's read + CRC"]),
              "cold persistent restore / floor: read + CRC (the most cold / tier restore can be)":
              med["cold persistent restore"] / med["floor: read + CRC"],
              "cold persistent restore / the recovery floor (the most cold / recovery can be)":
              med["cold persistent restore"] / (med["floor: between nodes + CRC"] + med["floor: node 0's read + CRC"])}
    for name, value in ratios.items():
        print(f"{name:<80} {value:>8.2f}")
    for name, value in r["counts"].items():
        print(f"{name:<80} {value:>8}")
    C.write_results("tiers", dict(r, repeats=args.repeats, prime=args.prime, ratios=ratios, load=load))
    failed = [k for k, v in r["counts"].items() if k.endswith("bytes from persistent") and v]
    C.finish(wrong=r["wrong"], failed=[f"{k}: {r['counts'][k]} bytes" for k in failed])


if __name__ == "__main__":
    main()
