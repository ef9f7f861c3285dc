"""shardckpt's DCP storage backend (``shardckpt.torch``) against DCP's ``FileSystemWriter`` / ``FileSystemReader``.

One run, the same processes, the same bytes, medians over ``--repeats``::

    .venv/bin/python benchmarks/bench_torch.py --size 256MiB --repeats 3

* launch 1 (``torchrun``, 4 ranks, a 1-D CPU mesh, every tensor ``Shard(0)``): for each system,
  ``repeats`` times, ``dcp.save`` (throughput; each save starts after ``os.sync()``, with
  nothing of the previous steps left to write back), ``dcp.load`` (the checkpoint's files
  read into the page cache first, untimed) onto the same layout into
  existing tensors (throughput, peak extra host memory, bytes read from the device),
  ``dcp.async_save`` twice (the time until the call returns: the first allocates its
  staging, the second reuses what the first kept, where a system keeps it), then the
  kept staging is freed (``release_staging_buffers()``), so that the next save and load
  run beside no staging, as DCP's do; after the loop the system's files are dropped from
  the page cache before the other system runs (each starts with the same free memory);
  then the disk's own figure, ``repeats`` times: each rank writes its local bytes to one
  file with plain 16 MiB writes and fsyncs it (the coordinator also fsyncs the folder),
  timed like a save (row "save throughput / raw write+fsync": how close each system's
  durable save comes to the disk);
* launch 2 (2 ranks, every tensor ``Shard(1)``): the resharded load 4 -> 2 of both
  checkpoints (throughput, bytes read by the processes' read calls (``/proc/self/io``
  ``rchar``, plus what shardckpt's reader read through io_uring, ``ring_bytes``, which
  ``rchar`` does not see) against the bytes the ranks need, peak extra host memory), and
  of shardckpt's with ``TFBundleReader(map_reads=False)`` (read calls only, no memory maps;
  shardckpt's bytes read also count the bytes it copied out of memory maps, ``mapped_bytes``);
* this process: planning a rank's read items for an 80x80-chunk tensor (its chunk an
  eighth of the rows; and 80x80 local chunks) with ``read_items_for_chunks`` against
  DCP's ``create_read_items_for_chunk_list``.

Files are read from the page cache (no cache drop without root). Peak extra memory is
the largest resident set during the load (the kernel's high-water mark ``VmHWM``, reset
before each load; sampled every millisecond by a thread only where that reset is
refused), minus the resident set before it, the largest over the ranks. The table goes to stdout; the raw figures to
``--json`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common as C  # noqa: E402
from common import cache_files, fmt_size, parse_size, reset_peak_rss, status_bytes  # noqa: E402

SYSTEMS = ("shardckpt", "dcp")
RESHARD_SYSTEMS = ("shardckpt", "shardckpt+calls", "dcp")  # +calls: TFBundleReader(map_reads=False)
TENSORS = 16


# -- worker side (under torchrun) --------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _io(field: str = "rchar") -> int:
    """A counter of ``/proc/self/io``: ``rchar`` (bytes through read calls), ``read_bytes`` (from the device)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _rchar() -> int:
    return _io("rchar")


class _PeakRSS:
    """The largest resident set while the block runs, less the resident set before it (``extra``).

    Linux: the kernel's own high-water mark (``VmHWM``, reset by writing 5 to
    ``/proc/self/clear_refs``): exact, and nothing runs beside the load. Where that reset
    is refused, a thread samples the resident set every millisecond instead (it takes CPU
    from the load it measures: on 2 cores shared by 4 ranks about 10 % of a 1 GiB load).
    """

    def __enter__(self) -> "_PeakRSS":
        self.base = _rss()
        self.exact = reset_peak_rss()
        self.peak = self.base
        if not self.exact:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *_: Any) -> None:
        if self.exact:
            self.peak = max(self.base, status_bytes("VmHWM"))
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _state(size: int, shard_dim: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    cols = 4096  # a hidden size; half a row (the 4 -> 2 reads) is 8 KiB
    rows = max(24, size // (TENSORS * cols * 4) // 24 * 24)  # divisible by 2, 3, 4
    sd = {}
    for i in range(TENSORS):
        shape = [rows, cols]
        local = list(shape)
        local[shard_dim] //= world
        g = torch.Generator().manual_seed(i * 16 + rank)
        t = torch.randn(local, generator=g)
        sd[f"layers.{i}.weight"] = DTensor.from_local(t, mesh, [Shard(shard_dim)], run_check=False,
                                                      shape=torch.Size(shape), stride=(cols, 1))
    sd["step"] = 7
    return sd


def _zeros_like(sd: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    out: Dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                        run_check=False, shape=v.shape, stride=v.stride())
        else:
            out[k] = 0
    return out


def _writer(system: str, path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    from shardckpt.torch import TFBundleWriter

    return TFBundleWriter(path / "ck") if system == "shardckpt" else FileSystemWriter(str(path))


def _reader(system: str, path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    from shardckpt.torch import TFBundleReader

    if system.startswith("shardckpt"):
        return TFBundleReader(path / "ck", map_reads=False if system == "shardckpt+calls" else None)
    return FileSystemReader(str(path))


def _planner(system: str) -> Any:
    from shardckpt.torch import TFBundleLoadPlanner

    return TFBundleLoadPlanner() if system.startswith("shardckpt") else None


def _release_staging(system: str) -> None:
    """Free the host buffers ``system``'s async saves keep for the next one (shardckpt's stager)."""
    import gc

    if system == "shardckpt":
        from shardckpt.torch import release_staging_buffers

        release_staging_buffers()
    gc.collect()


def _raw_write(sd: Dict[str, Any], path: Path, coordinator: bool) -> None:
    """What the disk allows a durable save: this rank's local bytes written to one file (16 MiB
    writes straight from the tensors' memory), fsynced; the coordinator fsyncs the folder."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for value in sd.values():
            if hasattr(value, "to_local"):
                view = memoryview(value.to_local().numpy()).cast("B")
                for at in range(0, len(view), 16 << 20):
                    chunk = view[at:at + (16 << 20)]
                    while len(chunk):
                        chunk = chunk[os.write(fd, chunk):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if coordinator:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def _gather(value: float) -> List[float]:
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _check_resharded(sd: Dict[str, Any], target: Dict[str, Any], rank: int, system: str) -> None:
    """The values loaded onto 2 ranks (``Shard(1)``) are the 4-rank save's."""
    import torch

    for i in range(TENSORS):
        got = target[f"layers.{i}.weight"].to_local()
        rows, cols = sd[f"layers.{i}.weight"].shape
        full = torch.cat([torch.randn((rows // 4, cols), generator=torch.Generator().manual_seed(i * 16 + r))
                          for r in range(4)])
        assert torch.equal(got, full[:, rank * cols // 2:(rank + 1) * cols // 2]), (system, i)


def _check_same(sd: Dict[str, Any], target: Dict[str, Any], system: str) -> None:
    """The values loaded onto the saved layout are the saved ones (this rank's part, bit for bit)."""
    import torch

    for key, value in sd.items():
        got = target[key]
        if hasattr(value, "to_local"):
            assert torch.equal(got.to_local(), value.to_local()), (system, key)
        else:
            assert got == value, (system, key, got)


def worker(phase: str, folder: Path, size: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: Dict[str, Any] = {}
    if phase == "four":
        sd = _state(size, 0)
        nbytes = sum(v.numel() * 4 for v in sd.values() if hasattr(v, "numel"))
        result["bytes"] = nbytes
        pg = dist.new_group(backend="gloo")
        for system in SYSTEMS:  # warm-up, untimed: the coordinator's gloo group, the code paths
            warm = folder / system / "warm"
            if rank == 0:
                warm.mkdir(parents=True)
            dist.barrier()
            dcp.save({"x": torch.ones(4), "n": 1}, storage_writer=_writer(system, warm))
        for system in SYSTEMS:
            saves, loads, blocks, again, peaks, disk = [], [], [], [], [], []
            for rep in range(repeats):
                path = folder / system / f"rep{rep}"
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    path.mkdir(parents=True)
                    os.sync()  # every timed save starts with nothing left to write back
                saves.append(_timed(lambda system=system, path=path: dcp.save(
                    sd, storage_writer=_writer(system, path))))
                target = _zeros_like(sd)
                if rank == 0:
                    cache_files(path)  # the method: both systems' files are read from the page cache
                dist.barrier()
                before = _io("read_bytes")
                with _PeakRSS() as mem:
                    loads.append(_timed(lambda system=system, path=path, target=target: dcp.load(
                        target, storage_reader=_reader(system, path), planner=_planner(system))))
                peaks.append(max(_gather(mem.extra)))
                disk.append(sum(_gather(_io("read_bytes") - before)))
                _check_same(sd, target, system)
                for kept, apath in ((False, folder / system / f"async{rep}"), (True, folder / system / f"again{rep}")):
                    if rank == 0:
                        shutil.rmtree(apath, ignore_errors=True)
                        apath.mkdir(parents=True)
                    dist.barrier()
                    started = time.perf_counter()
                    future = dcp.async_save(sd, storage_writer=_writer(system, apath), process_group=pg)
                    (again if kept else blocks).append(max(_gather(time.perf_counter() - started)))
                    future.result()
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(apath)
                _release_staging(system)  # the next save and load run without kept staging (as DCP's do)
                if rank == 0 and rep < repeats - 1:
                    shutil.rmtree(path)
            _release_staging(system)  # the next system starts with the memory this one started with ...
            if rank == 0:
                os.replace(folder / system / f"rep{repeats - 1}", folder / system / "final")
                C.uncache(folder / system)  # ... and the page cache (launch 2 reads the files in again, untimed)
            dist.barrier()
            result[system] = {"save_s": saves, "load_s": loads, "async_block_s": blocks, "async_again_s": again,
                              "load_peak_extra": peaks, "load_device_bytes": disk}
        raw = []  # the disk's own figure: each rank writes its bytes to one file with plain writes, fsyncs
        for rep in range(repeats):
            path = folder / "raw" / f"rep{rep}"
            if rank == 0:
                path.mkdir(parents=True)
                os.sync()
            dist.barrier()
            raw.append(_timed(lambda path=path: _raw_write(sd, path / f"rank{rank}.bin", rank == 0)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
        result["raw"] = {"save_s": raw}
    else:  # "two": resharded load 4 -> 2, other placements
        sd = _state(size, 1)
        nbytes = sum(v.numel() * 4 for v in sd.values() if hasattr(v, "numel"))
        result["bytes"] = nbytes
        figures: Dict[str, Dict[str, List[float]]] = {s: {"load_s": [], "bytes_read": [], "load_peak_extra": []}
                                                      for s in RESHARD_SYSTEMS}
        systems = RESHARD_SYSTEMS
        for rep in range(repeats + 1):  # round 0 warms up (untimed); the systems take turns going first
            for system in systems[rep % len(systems):] + systems[:rep % len(systems)]:
                target = _zeros_like(sd)
                reader = _reader(system, folder / system.split("+")[0] / "final")
                before = _rchar()
                with _PeakRSS() as mem:
                    seconds = _timed(lambda system=system, target=target, reader=reader: dcp.load(
                        target, storage_reader=reader, planner=_planner(system)))
                read = sum(_gather(_rchar() - before + getattr(reader, "mapped_bytes", 0)
                                   + getattr(reader, "ring_bytes", 0)))
                peak = max(_gather(mem.extra))
                _check_resharded(sd, target, rank, system)
                if rep:
                    figures[system]["load_s"].append(seconds)
                    figures[system]["bytes_read"].append(read)
                    figures[system]["load_peak_extra"].append(peak)
        result.update(figures)
    if rank == 0:
        print("BENCH-RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# -- driver side -----------------------------------------------------------------------------------------
def _launch(phase: str, nproc: int, folder: Path, size: int, repeats: int) -> Dict[str, Any]:
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")]))
    cmd = [str(torchrun), "--standalone", f"--nproc-per-node={nproc}", __file__, "--worker", phase,
           "--dir", str(folder), "--size", str(size), "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in done.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            return json.loads(line[len("BENCH-RESULT "):])  # type: ignore[no-any-return]
    raise SystemExit(f"{phase} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")


def _planning(repeats: int) -> Dict[str, Dict[str, float]]:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    sys.path.insert(0, str(HERE.parent / "src"))
    from shardckpt.torch import read_items_for_chunks

    size, n = 6400, 80
    step = size // n
    chunks = [ChunkStorageMetadata(offsets=torch.Size([i * step, j * step]), sizes=torch.Size([step, step]))
              for i in range(n) for j in range(n)]
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([size, size]),
                               chunks=chunks)
    cases = {
        "one chunk (an eighth of the rows)": [ChunkStorageMetadata(offsets=torch.Size([840, 0]),
                                                                   sizes=torch.Size([800, size]))],
        "80x80 chunks, shifted": [ChunkStorageMetadata(offsets=torch.Size([i * 80 + 40 * (i > 0), j * 80]),
                                                       sizes=torch.Size([80 - 40 * (i > 0) + 40 * (i < 79), 80]))
                                  for i in range(80) for j in range(80)],
    }
    out = {}
    for name, local in cases.items():
        figures = {}
        for system, fn in (("shardckpt", read_items_for_chunks), ("dcp", create_read_items_for_chunk_list)):
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                fn("w", md, local)
                times.append(time.perf_counter() - started)
            figures[system] = statistics.median(times)
        out[name] = figures
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB", help="bytes of state (default 256MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardckpt-bench-torch")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    # smoke: 24 rows per tensor (the least: divisible by 2, 3 and 4; 6 MiB)
    args = C.parse_args(ap, size="6MiB", repeats=1)
    size = parse_size(args.size)
    folder = Path(args.dir)
    if args.worker:
        worker(args.worker, folder, size, args.repeats)
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        four = _launch("four", 4, folder, size, args.repeats)
        two = _launch("two", 2, folder, size, args.repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    planning = _planning(1 if args.smoke else max(3, args.repeats))
    nbytes = four["bytes"]
    med = statistics.median
    rows = []

    def row(what: str, ours: float, theirs: float, unit: str, better: str) -> None:
        ratio = (ours / theirs if better == "higher" else theirs / ours) if ours and theirs else float("nan")
        rows.append((what, ours, theirs, unit, ratio))

    s, d = four["shardckpt"], four["dcp"]
    row("save throughput (4 ranks)", nbytes / med(s["save_s"]) / 2**20, nbytes / med(d["save_s"]) / 2**20, "MiB/s",
        "higher")
    raw = nbytes / med(four["raw"]["save_s"]) / 2**20
    row(f"save throughput / raw write+fsync of the same bytes ({raw:.0f} MiB/s)",
        nbytes / med(s["save_s"]) / 2**20 / raw, nbytes / med(d["save_s"]) / 2**20 / raw, "x", "higher")
    row("load throughput (4 -> 4)", nbytes / med(s["load_s"]) / 2**20, nbytes / med(d["load_s"]) / 2**20, "MiB/s",
        "higher")
    row("bytes from the device / state, load 4 -> 4 (0: page cache)", med(s["load_device_bytes"]) / nbytes,
        med(d["load_device_bytes"]) / nbytes, "x", "lower")
    s2, d2 = two["shardckpt"], two["dcp"]
    row("resharded load (4 -> 2, Shard(0) -> Shard(1))", nbytes / med(s2["load_s"]) / 2**20,
        nbytes / med(d2["load_s"]) / 2**20, "MiB/s", "higher")
    row("bytes read / bytes needed (4 -> 2)", med(s2["bytes_read"]) / nbytes, med(d2["bytes_read"]) / nbytes, "x",
        "lower")
    m2 = two["shardckpt+calls"]
    row("resharded load (4 -> 2), map_reads=False (read calls)", nbytes / med(m2["load_s"]) / 2**20,
        nbytes / med(d2["load_s"]) / 2**20, "MiB/s", "higher")
    row("bytes read / needed, map_reads=False", med(m2["bytes_read"]) / nbytes,
        med(d2["bytes_read"]) / nbytes, "x", "lower")
    row("async_save blocking time (first: buffers allocated)", med(s["async_block_s"]) * 1e3,
        med(d["async_block_s"]) * 1e3, "ms", "lower")
    row("async_save blocking time (next: buffers kept)", med(s["async_again_s"]) * 1e3,
        med(d["async_again_s"]) * 1e3, "ms", "lower")
    row("peak extra host memory, load 4 -> 4 (per rank, % of state)", 100 * med(s["load_peak_extra"]) / nbytes,
        100 * med(d["load_peak_extra"]) / nbytes, "%", "lower")
    row("peak extra host memory, load 4 -> 2 (per rank, % of state)", 100 * med(s2["load_peak_extra"]) / nbytes,
        100 * med(d2["load_peak_extra"]) / nbytes, "%", "lower")
    row("peak extra host memory, load 4 -> 2, map_reads=False (%)", 100 * med(m2["load_peak_extra"]) / nbytes,
        100 * med(d2["load_peak_extra"]) / nbytes, "%", "lower")
    for name, figures in planning.items():
        row(f"planning, 80x80 stored chunks, {name}", figures["shardckpt"] * 1e3, figures["dcp"] * 1e3, "ms",
            "lower")
    print(f"state: {fmt_size(nbytes)} in {TENSORS} float32 tensors, medians of {args.repeats}; "
          "ratio > 1: shardckpt better")
    print(f"{'':62} {'shardckpt':>11} {'DCP':>11}        ratio")
    for what, ours, theirs, unit, ratio in rows:
        print(f"{what:62} {ours:11.3f} {theirs:11.3f} {unit:6} {ratio:6.2f}x")
    result = {"size": nbytes, "repeats": args.repeats, "rows": rows, "four": four, "two": two, "planning": planning}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    C.write_results("torch", result)


if __name__ == "__main__":
    main()
