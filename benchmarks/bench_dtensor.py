"""Benchmark multi-client DTensor checkpoints: shardckpt against PyTorch DCP, with 1, 2 and 4 clients.

Every measurement is one fresh ``torchrun --standalone --nproc-per-node N`` launch (gloo):

* ``shardckpt`` save: ``DTensorCheckpoint(mesh, **dvariables).write(prefix)`` on
  ``create_distributed_mesh([("x", N)])`` (one device per client), every tensor laid out
  ``["x", unsharded]``: each client writes its rows, one data file per client, fsynced;
  client 0 merges and commits. Restore: ``DTensorCheckpoint(...).read(prefix)`` into the
  existing (warmed) components.
* ``dcp`` save: ``torch.distributed.checkpoint.save`` (``FileSystemWriter``: one file per rank,
  ``sync_files=True``, the default) of a state dict holding each rank's rows of every tensor
  under a key of its own (``w007.rank2``): the same bytes, sharded the same way. Restore:
  ``torch.distributed.checkpoint.load`` into the existing (warmed) tensors.

The state is ``--size`` bytes in total (64 float32 tensors of ``(rows, 1024)``, whatever the
number of clients), so each client holds ``size / N``. Times are from a barrier on the default
group to the slowest client's return; aggregate throughput = total bytes / that time. Saves
are rehearsed: each save launch first saves the whole state once (untimed) and deletes it, as
``bench_bundle.py`` does (``--no-rehearse`` times the very first save). The
restore launch reads what the save launch just wrote (page cache: the files are hot for both
systems). Restored values are checked after timing.

A resharded restore is measured too (shardckpt only: DCP cannot reshard tensors saved under
per-rank keys): 4 clients save with layout ``[x, y]`` on a 2x4 mesh; 2 clients restore the
same mesh shape with the transposed layout ``[y, x]``. Each client counts the bytes it reads
(``LocalFileSystem.pread_into``) against the bytes of its distinct local pieces (target <= 1.1).

    .venv/bin/python benchmarks/bench_dtensor.py                          # 1 GiB, 5 repeats
    .venv/bin/python benchmarks/bench_dtensor.py --size 64MiB --repeats 1 # a quick look
    .venv/bin/python benchmarks/bench_dtensor.py --smoke                  # smoke run (what the suite runs)

Systems alternate (A B, B A, ...) across repeats; medians are reported. Ratios are
shardckpt / DCP throughput: above 1, shardckpt is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import common as C
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
COLS = 1024
COUNT = 64
U = "unsharded"


# -- values -------------------------------------------------------------------------------------------------
def tensor_shape(total: int) -> Tuple[int, int]:
    rows = total // C.DTYPE().itemsize // COUNT // COLS
    rows -= rows % 8  # divisible by every client count and by both dimensions of the 2x4 mesh
    if rows <= 0:
        raise ValueError(f"{C.fmt_size(total)} is too small for {COUNT} tensors of {COLS} columns")
    return rows, COLS


def region(i: int, box) -> np.ndarray:
    """Element ``(r, c)`` of tensor ``i`` is ``(i * 1000003 + r * 1024 + c) mod 16777213`` (exact in float32)."""
    (r0, r1), (c0, c1) = box
    rows = np.arange(r0, r1, dtype=np.int64)[:, None] * COLS
    cols = np.arange(c0, c1, dtype=np.int64)[None, :] + i * 1000003
    out = np.empty((r1 - r0, c1 - c0), dtype=C.DTYPE)
    np.remainder(rows + cols, 16777213, out=out, casting="unsafe")
    return out


# -- worker -----------------------------------------------------------------------------------------------------
def _dist():
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return torch, dist


def _gather_floats(values: List[float]) -> List[List[float]]:
    torch, dist = _dist()
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def run_worker(args: argparse.Namespace) -> None:
    torch, dist = _dist()
    rank, size = dist.get_rank(), dist.get_world_size()
    shape = tensor_shape(C.parse_size(args.size))
    names = [f"w{i:03d}" for i in range(COUNT)]
    path = os.path.join(args.dir, "ck")
    counter = {"bytes": 0}
    reshard = args.op.startswith("reshard")

    if args.worker == "shardckpt":
        from shardckpt import dtensor as dt
        from shardckpt.distributed import set_coordinator
        from shardckpt.distributed.torch_backend import TorchCoordinator
        from shardckpt.storage.local import LocalFileSystem

        coord = TorchCoordinator(timeout=1800)
        set_coordinator(coord)
        if reshard:
            mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
            spec = ["x", "y"] if args.op == "reshard-save" else ["y", "x"]
        else:
            mesh = dt.create_distributed_mesh([("x", size)])
            spec = ["x", U]
        layout = dt.Layout(spec, mesh)
        variables = {}
        for i, name in enumerate(names):
            comps = {d: (region(i, layout.box(d, shape)) if args.op.endswith("save")
                         else np.zeros(layout.local_shape(shape), C.DTYPE)) for d in mesh.local_device_ids()}
            variables[name] = dt.DVariable(dt.DTensor(layout, shape, comps), name=name)
        arrays = [c for v in variables.values() for c in v.value().components.values()]
        ckpt = dt.DTensorCheckpoint(mesh, coordinator=coord, **variables)
        original = LocalFileSystem.pread_into

        def counting(self, fd, buf, offset, p=""):
            counter["bytes"] += memoryview(buf).nbytes
            return original(self, fd, buf, offset, p)

        LocalFileSystem.pread_into = counting

        def op(where: str = path) -> None:
            if args.op.endswith("save"):
                ckpt.write(where)
            else:
                ckpt.read(where).assert_existing_objects_matched()

        def check() -> bool:
            for i, var in enumerate(variables.values()):
                for d, comp in var.value().components.items():
                    if not np.array_equal(comp, region(i, var.value().box(d))):
                        return False
            return True

        local_bytes = sum(c.nbytes for c in arrays)
        distinct = sum(int(np.prod([b - a for a, b in box])) for v in variables.values()
                       for box in v.value().local_pieces()) * C.DTYPE().itemsize
    elif args.worker in ("raw", "raw-hinted"):  # the floor: the same bytes, one file per client, fsynced
        rows = shape[0] // size
        box = ((rank * rows, (rank + 1) * rows), (0, COLS))
        arrays = [region(i, box) if args.op == "save" else np.zeros((rows, COLS), C.DTYPE)
                  for i in range(COUNT)]

        def op(where: str = path) -> None:
            os.makedirs(where, exist_ok=True)
            _write_raw(os.path.join(where, f"rank{rank}"), arrays, hinted=args.worker == "raw-hinted")
            if rank == 0:
                os.makedirs(where, exist_ok=True)
            dist.barrier()  # every file durable before the folder is
            if rank == 0:
                _fsync_dir(where)

        def check() -> bool:
            return True

        local_bytes = distinct = sum(a.nbytes for a in arrays)
    else:
        import torch.distributed.checkpoint as dcp

        rows = shape[0] // size
        box = ((rank * rows, (rank + 1) * rows), (0, COLS))
        state = {f"{name}.rank{rank}": torch.from_numpy(region(i, box) if args.op == "save"
                                                          else np.zeros((rows, COLS), C.DTYPE))
                 for i, name in enumerate(names)}
        arrays = [t.numpy() for t in state.values()]

        def op(where: str = path) -> None:
            if args.op == "save":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(where))
            else:
                dcp.load(state, storage_reader=dcp.FileSystemReader(where))

        def check() -> bool:
            return all(np.array_equal(a, region(i, box)) for i, a in enumerate(arrays))

        local_bytes = distinct = sum(a.nbytes for a in arrays)

    if args.op.endswith("save"):
        os.makedirs(args.dir, exist_ok=True)
        if args.rehearse:  # an untimed save, deleted: first-call costs paid, page-cache pages recycled
            rehearsal = path + "-rehearsal"
            C.warm(arrays)
            op(rehearsal)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(rehearsal, ignore_errors=True)
                for f in os.listdir(args.dir):
                    if f.startswith("ck-rehearsal"):
                        os.remove(os.path.join(args.dir, f))
            dist.barrier()
        C.prime_free_memory(local_bytes)  # the page cache the writes fill
    C.warm(arrays)
    dist.barrier()
    counter["bytes"] = 0
    probe = C.Probe().start()
    op()
    sample = probe.sample()
    ok = bool(check()) if args.op.endswith("restore") else True
    # every rank's elapsed time, and the slowest rank's end relative to the common start
    rows_ = _gather_floats([sample["seconds"], float(sample["peak_extra"] or 0), float(sample["cpu_s"]),
                            float(counter["bytes"]), float(distinct), float(local_bytes), float(ok),
                            float(sample["wchar"] or 0), float(sample["rchar"] or 0)])
    if rank == 0:
        total = C.parse_size(args.size)
        seconds = max(r[0] for r in rows_)
        result = {"worker": args.worker, "op": args.op, "clients": size, "bytes": total,
                  "state_bytes": sum(r[5] for r in rows_), "seconds": seconds,
                  "gbps": sum(r[5] for r in rows_) / 1e9 / seconds,
                  "per_client": [{"seconds": r[0], "peak_extra": r[1], "cpu_s": r[2], "bytes_read": r[3],
                                  "distinct_bytes": r[4], "local_bytes": r[5], "values_ok": bool(r[6]),
                                  "wchar": r[7], "rchar": r[8]} for r in rows_],
                  "values_ok": all(bool(r[6]) for r in rows_)}
        with open(args.result_file, "w") as f:
            json.dump(result, f)
    dist.barrier()
    # No teardown: gloo / DCP threads have been seen to abort the process at interpreter exit
    # ("terminate called without an active exception"); the measurement is complete here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_raw(path: str, arrays: List[np.ndarray], hinted: bool) -> None:
    """Write ``arrays`` back to back into ``path`` and fsync it; ``hinted``: start the device write of
    every 16 MiB written (``sync_file_range``, on a helper thread), as shardckpt's writer does."""
    from shardckpt.storage import writeback

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = hinted_to = 0
        for a in arrays:
            buf = C.byte_view(a)
            done = 0
            while done < len(buf):
                done += os.write(fd, buf[done:])
            offset += len(buf)
            if hinted and offset - hinted_to >= writeback.STEP:
                writeback.start(fd, hinted_to, offset - hinted_to)
                hinted_to = offset
        writeback.drain(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- driver -----------------------------------------------------------------------------------------------------
def launch(args: argparse.Namespace, worker: str, op: str, clients: int) -> Dict[str, Any]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    result_file = os.path.join(args.dir + "-results", f"{worker}-{op}-{clients}.json")
    os.makedirs(os.path.dirname(result_file), exist_ok=True)
    if os.path.exists(result_file):
        os.remove(result_file)
    cmd = [torchrun, "--standalone", f"--nproc-per-node={clients}", os.path.abspath(__file__), "--worker",
           "shardckpt" if worker == "base" else worker,
           "--op", op, "--size", args.size, "--dir", args.dir, "--result-file", result_file,
           "--rehearse" if args.rehearse else "--no-rehearse"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SHARDCKPT_BACKEND")}
    src = os.path.abspath(args.base_src) if worker == "base" else os.path.join(REPO, "src")
    env.update(PYTHONPATH=os.pathsep.join([HERE, src]), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0 or not os.path.exists(result_file):
        raise RuntimeError(f"{worker} {op} on {clients} clients failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(result_file) as f:
        result: Dict[str, Any] = json.load(f)
    result["worker"] = worker
    return result


def measure_pair(args: argparse.Namespace, worker: str, clients: int) -> Tuple[Dict, Optional[Dict]]:
    shutil.rmtree(args.dir, ignore_errors=True)
    os.sync()
    save = launch(args, worker, "save", clients)
    restore = launch(args, worker, "restore", clients) if not (args.save_only or worker.startswith("raw")) else None
    shutil.rmtree(args.dir, ignore_errors=True)
    return save, restore


def measure_reshard(args: argparse.Namespace) -> Tuple[Dict, Dict]:
    shutil.rmtree(args.dir, ignore_errors=True)
    os.sync()
    save = launch(args, "shardckpt", "reshard-save", 4)
    restore = launch(args, "shardckpt", "reshard-restore", 2)
    shutil.rmtree(args.dir, ignore_errors=True)
    return save, restore


def _loadavg() -> Optional[str]:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return None


def git_rev() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    except OSError:
        return None


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["shardckpt", "dcp", "raw", "raw-hinted"])
    p.add_argument("--op", choices=["save", "restore", "reshard-save", "reshard-restore"])
    p.add_argument("--result-file")
    p.add_argument("--size", default="1GiB", help="total bytes of the state (all clients together)")
    p.add_argument("--clients", default="1,2,4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-reshard", action="store_true", help="skip the resharded restore")
    p.add_argument("--save-only", action="store_true", help="time saves only (no restore launches)")
    p.add_argument("--rehearse", action=argparse.BooleanOptionalAction, default=True,
                   help="save once, untimed, and delete it before the timed save (default: on)")
    p.add_argument("--dir", default="/tmp/shardckpt-bench-dtensor")
    p.add_argument("--name", default="dtensor")
    p.add_argument("--raw", action="store_true",
                   help="also time raw saves of the same bytes (one file per client, write + fsync; plain and "
                        "with write-behind hints): the floor")
    p.add_argument("--base-src", metavar="DIR",
                   help="also time shardckpt from another revision's src folder (column 'base'), in the same run")
    # smoke: 8 rows per tensor (the least the 2x4 mesh divides), the pairs on one client, the resharded
    # restore on its 4 and 2
    args = C.parse_args(p, argv, size="2MiB", clients="1", repeats=1)
    if args.worker:
        run_worker(args)
        return
    clients = [int(c) for c in args.clients.split(",")]
    load_start = _loadavg()
    runs: List[Dict] = []
    failures: List[str] = []
    reshards: List[Tuple[Dict, Dict]] = []
    systems = ["shardckpt", "dcp"] + (["base"] if args.base_src else []) + (["raw", "raw-hinted"] if args.raw else [])
    for rep in range(args.repeats):
        for n in clients:
            for worker in (systems if rep % 2 == 0 else systems[::-1]):
                try:
                    save, restore = measure_pair(args, worker, n)
                except Exception as exc:  # noqa: BLE001 - logged, listed, left out of the medians
                    failures.append(f"rep {rep} {worker} x{n}: {exc}")
                    print(f"FAILED: {failures[-1][:2000]}", file=sys.stderr, flush=True)
                    continue
                for r in (save, restore):
                    if r is not None:
                        r["repeat"] = rep
                        runs.append(r)
                flag = "" if restore is None or restore["values_ok"] else "  WRONG VALUES"
                read = "" if restore is None else f", restore {restore['gbps']:.2f} GB/s"
                print(f"  rep {rep} {n} client(s) {worker:9s}: save {save['gbps']:.2f} GB/s{read}{flag}",
                      file=sys.stderr, flush=True)
        if not args.no_reshard:
            try:
                reshards.append(measure_reshard(args))
                s, r = reshards[-1]
                print(f"  rep {rep} reshard 4->2 clients: save {s['gbps']:.2f} GB/s, restore {r['gbps']:.2f} GB/s",
                      file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"rep {rep} reshard: {exc}")
                print(f"FAILED: {failures[-1][:2000]}", file=sys.stderr, flush=True)

    # -- report ----------------------------------------------------------------------------------------------
    total = C.parse_size(args.size)
    rows = []
    print(f"\nstate {C.fmt_size(total)} in total (64 float32 tensors), fsync on; medians of {args.repeats} "
          f"repeat(s); GB = 1e9 bytes; ratio = shardckpt / DCP throughput (> 1: shardckpt faster); "
          f"/x = shardckpt time / x's time; load average {load_start} -> {_loadavg()}\n")
    extra = [w for w in systems[2:]]
    head = (f"{'clients':>7} {'op':>8} {'shardckpt s':>11} {'GB/s':>6} {'DCP s':>7} {'GB/s':>6} {'ratio':>6} "
            f"{'peak+ sc':>9} {'peak+ dcp':>9}" + "".join(f" {w + ' s':>12} {'/' + w:>11}" for w in extra))
    print(head)
    print("-" * len(head))
    for n in clients:
        for op in ("save", "restore"):
            sel = {w: [r for r in runs if r["worker"] == w and r["op"] == op and r["clients"] == n] for w in systems}
            if not sel["shardckpt"] or not sel["dcp"]:
                continue
            present = [w for w in systems if sel[w]]
            sec = {w: C.median([r["seconds"] for r in sel[w]]) for w in present}
            gbps = {w: C.median([r["gbps"] for r in sel[w]]) for w in present}
            peak = {w: C.median([max(c["peak_extra"] for c in r["per_client"]) for r in sel[w]]) for w in present}
            ok = all(r["values_ok"] for w in present for r in sel[w])
            row = {"clients": n, "op": op, "shardckpt_s": sec["shardckpt"], "shardckpt_gbps": gbps["shardckpt"],
                   "dcp_s": sec["dcp"], "dcp_gbps": gbps["dcp"], "ratio": gbps["shardckpt"] / gbps["dcp"],
                   "shardckpt_peak_extra": peak["shardckpt"], "dcp_peak_extra": peak["dcp"], "values_ok": ok,
                   "repeats": len(sel["shardckpt"])}
            for w in extra:  # another system's median, and shardckpt's time over it (< 1: shardckpt faster)
                if w in sec:
                    row[f"{w}_s"] = sec[w]
                    row[f"shardckpt_over_{w}"] = sec["shardckpt"] / sec[w]
            rows.append(row)
            print(f"{n:>7} {op:>8} {sec['shardckpt']:>11.3f} {gbps['shardckpt']:>6.2f} {sec['dcp']:>7.3f} "
                  f"{gbps['dcp']:>6.2f} {row['ratio']:>6.2f} {C.fmt_size(peak['shardckpt']):>9} "
                  f"{C.fmt_size(peak['dcp']):>9}"
                  + "".join(f" {sec[w]:>12.3f} {sec['shardckpt'] / sec[w]:>11.3f}" if w in sec else f" {'':>24}"
                            for w in extra)
                  + ("" if ok else "  WRONG VALUES"))
            if "base" in sec:
                print(f"{'':>16} base (--base-src) / DCP throughput: {gbps['base'] / gbps['dcp']:.2f}")
    reshard_summary = None
    if reshards:
        restores = [r for _, r in reshards]
        per_client = []
        for c in range(2):
            ratios = [r["per_client"][c]["bytes_read"] / r["per_client"][c]["distinct_bytes"] for r in restores]
            per_client.append({"client": c, "bytes_read": C.median([r["per_client"][c]["bytes_read"]
                                                                      for r in restores]),
                               "distinct_bytes": restores[0]["per_client"][c]["distinct_bytes"],
                               "read_ratio": C.median(ratios), "max_read_ratio": max(ratios)})
        reshard_summary = {"save_gbps": C.median([s["gbps"] for s, _ in reshards]),
                           "restore_gbps": C.median([r["gbps"] for r in restores]),
                           "restore_s": C.median([r["seconds"] for r in restores]),
                           "values_ok": all(r["values_ok"] for r in restores), "per_client": per_client}
        print(f"\nresharded restore (shardckpt): saved by 4 clients as [x, y] on 2x4 "
              f"({reshard_summary['save_gbps']:.2f} GB/s), restored by 2 clients as [y, x]: "
              f"{reshard_summary['restore_s']:.3f} s, {reshard_summary['restore_gbps']:.2f} GB/s"
              + ("" if reshard_summary["values_ok"] else "  WRONG VALUES"))
        print(f"{'client':>6} {'read':>10} {'distinct local pieces':>22} {'read / pieces':>14} (target <= 1.10)")
        for c in per_client:
            print(f"{c['client']:>6} {C.fmt_size(c['bytes_read']):>10} {C.fmt_size(c['distinct_bytes']):>22} "
                  f"{c['read_ratio']:>14.3f}")
    if failures:
        print(f"\n{len(failures)} measurement(s) failed (see the results file)")
    out = C.results_path(args.name)
    with open(out, "w") as f:
        json.dump({"rows": rows, "reshard": reshard_summary, "runs": runs,
                   "reshard_runs": [{"save": s, "restore": r} for s, r in reshards], "failures": failures,
                   "argv": sys.argv, "size": args.size, "repeats": args.repeats, "git": git_rev(),
                   "loadavg": [load_start, _loadavg()],
                   "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "python": platform.python_version()}}, f, indent=1)
    shutil.rmtree(args.dir + "-results", ignore_errors=True)
    print(f"\nresults: {out}")
    C.finish(wrong=[f"rep {r['repeat']} {r['worker']} {r['op']} x{r['clients']}" for r in runs if not r["values_ok"]]
             + [f"reshard {r['op']} x{r['clients']}" for pair in reshards for r in pair if not r["values_ok"]],
             failed=failures)


if __name__ == "__main__":
    main()
