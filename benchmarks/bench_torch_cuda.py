"""Checkpoints of a state dict on a GPU: shardckpt's DCP backend against DCP's ``FileSystemWriter``.

One process, one GPU, a one-rank torch.distributed world (``cpu:gloo,cuda:nccl``), the
state an FSDP2 job holds on one rank: every tensor a ``DTensor`` ``Shard(0)`` on a CUDA
mesh — bf16 parameters of a transformer-like model and AdamW's two fp32 moments (the
shapes are not powers of two, as a real model's are not). One run, the same process,
the same bytes, medians over ``--repeats``::

    python benchmarks/bench_torch_cuda.py --size 2GiB --repeats 3

Systems: ``shardckpt`` (``TFBundleWriter`` / ``TFBundleReader``, a new writer per save, as
the one-line swap reads), ``dcp`` (``FileSystemWriter``, a new writer per save: each
staging allocates) and ``dcp-cached`` (one ``FileSystemWriter(cache_staged_state_dict=True)``
kept across saves, DCP's way to reuse pinned staging; async saves only).

For each system, each round: ``dcp.save`` (throughput, after ``os.sync()``); ``dcp.async_save``
twice: the time until the call returns (the first allocates its staging, the next reuses
what the first kept, where the system keeps it), the GPU memory the staging added (a
staged copy must live on the host), the training steps run while the background write
goes on against the same steps idle, and the host memory kept after the save (resident
set growth); then the kept staging is freed (``release_staging_buffers()``, the writer
dropped, torch's pinned-memory cache emptied) so the next round's "first" is a first
again; ``dcp.load`` into the DTensors on the GPU (files in the page cache; every value
compared, bit for bit). References in the same process: copying the state to host
memory pinned ahead (the floor of a staging) and pageable (``.to("cpu")``), copying it
back from pinned memory, and writing its bytes to one file with ``fsync`` (the disk).

Nothing here is needed by the library or its tests: it measures the CUDA path of
``shardckpt.torch`` where a GPU is lent. ``--device cpu`` runs the same steps on the
CPU (a smoke run: the GPU rows then measure nothing of interest).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from common import cache_files, fmt_size, parse_args, parse_size, status_bytes, write_results  # noqa: E402

SYSTEMS = ("shardckpt", "dcp", "dcp-cached")
VOCAB = 50257


def _shapes(nbytes: int, hidden: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """A transformer's parameter shapes whose bf16 values plus two fp32 moments come near ``nbytes``."""
    per_param = 2 + 4 + 4
    layer = [("qkv", (3 * hidden, hidden)), ("proj", (hidden, hidden)), ("up", (4 * hidden, hidden)),
             ("down", (hidden, 4 * hidden)), ("norm1", (hidden,)), ("norm2", (hidden,))]
    layer_params = sum(_numel(s) for _, s in layer)
    layers = max(1, round((nbytes / per_param - VOCAB * hidden) / layer_params))
    shapes: List[Tuple[str, Tuple[int, ...]]] = [("embed", (VOCAB, hidden))]
    for i in range(layers):
        shapes += [(f"layers.{i}.{name}", shape) for name, shape in layer]
    return shapes


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _state(shapes: List[Tuple[str, Tuple[int, ...]]], device: str, mesh: Any) -> Dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator(device=device).manual_seed(0)
    model, optim = {}, {}
    for name, shape in shapes:
        def dt(dtype: torch.dtype, shape: Tuple[int, ...] = shape) -> Any:
            value = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
            return distribute_tensor(value, mesh, [Shard(0)])
        model[name] = dt(torch.bfloat16)
        optim[name] = {"exp_avg": dt(torch.float32), "exp_avg_sq": dt(torch.float32), "step": torch.tensor(7.0)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}]},
            "step": 7}


def _tensors(value: Any) -> List[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return [value.to_local()]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _gpu_bytes(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _rss() -> int:
    return status_bytes("VmRSS")


def _put(rec: Dict[str, List[float]], key: str, value: float) -> None:
    rec.setdefault(key, []).append(value)


def _timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class Trainer:
    """A stand-in training step: a few bf16 matrix products on the GPU, launched from Python."""

    def __init__(self, device: str) -> None:
        n = 8192 if device == "cuda" else 256
        self.device = device
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        self.b = torch.randn_like(self.a)

    def step(self) -> None:
        c = self.a
        for _ in range(4):
            c = torch.mm(c, self.b) * 1e-3
        _sync(self.device)

    def idle_step_time(self, steps: int = 20) -> float:
        self.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t0) / steps

    def steps_while(self, future: Any) -> Tuple[float, int]:
        """Mean step time while ``future`` runs, and how many steps ran."""
        count, t0 = 0, time.perf_counter()
        while not future.done():
            self.step()
            count += 1
        return ((time.perf_counter() - t0) / count if count else float("nan")), count


def _writer(system: str, path: Path, cached: Dict[str, Any]) -> Any:
    from shardckpt.torch import TFBundleWriter

    if system == "shardckpt":
        return TFBundleWriter(str(path))
    if system == "dcp":
        return dcp.FileSystemWriter(str(path))
    writer = cached.get("writer")
    if writer is None:
        writer = cached["writer"] = dcp.FileSystemWriter(str(path), cache_staged_state_dict=True)
    writer.reset(str(path))  # the same writer (its staging cache) for another checkpoint
    return writer


def _reader(system: str, path: Path) -> Any:
    from shardckpt.torch import TFBundleReader

    return TFBundleReader(str(path)) if system == "shardckpt" else dcp.FileSystemReader(str(path))


def _release(system: str, cached: Dict[str, Any], device: str) -> None:
    if system == "shardckpt":
        from shardckpt.torch import release_staging_buffers

        release_staging_buffers()
    cached.clear()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch._C._host_emptyCache()  # torch's pinned-memory cache keeps what DCP's staging freed


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8),
                           y.view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8))
               for x, y in zip(_tensors(a), _tensors(b)))


def _zeroed(state: Dict[str, Any]) -> None:
    for t in _tensors(state):
        t.zero_()


def run_system(system: str, state: Dict[str, Any], target: Dict[str, Any], root: Path, device: str,
               trainer: Trainer, nbytes: int, rec: Dict[str, List[float]]) -> None:
    cached: Dict[str, Any] = {}
    folder = root / system
    if system != "dcp-cached":
        _sync(device)
        os.sync()
        path = folder / "sync"
        seconds, _ = _timed(lambda: dcp.save(state, storage_writer=_writer(system, path, cached)))
        _put(rec, "save MiB/s", nbytes / seconds / 2**20)
        cache_files(folder)
        _zeroed(target)
        _sync(device)
        def load() -> None:
            dcp.load(target, storage_reader=_reader(system, path))
            _sync(device)

        seconds, _ = _timed(load)
        _put(rec, "load MiB/s", nbytes / seconds / 2**20)
        _put(rec, "load bit-exact", float(_same(state, target)))
        shutil.rmtree(folder)
    idle = trainer.idle_step_time()
    for which in ("first", "next"):
        gc.collect()
        _sync(device)
        os.sync()
        path = folder / f"async-{which}"
        rss, gpu = _rss(), _gpu_bytes(device)
        start = time.perf_counter()
        future: Any = dcp.async_save(state, storage_writer=_writer(system, path, cached))
        blocking = time.perf_counter() - start
        _put(rec, f"async_save blocking ms ({which})", blocking * 1e3)
        _put(rec, f"GPU memory added by staging MiB ({which})", (_gpu_bytes(device) - gpu) / 2**20)
        during, steps = trainer.steps_while(future)
        future.result()
        _put(rec, f"async save total ms ({which})", (time.perf_counter() - start) * 1e3)
        _put(rec, f"train step while writing / idle ({which})", during / idle)
        _put(rec, f"train steps while writing ({which})", float(steps))
        gc.collect()
        _put(rec, f"host memory kept after save, % of state ({which})", 100.0 * (_rss() - rss) / nbytes)
    _zeroed(target)
    dcp.load(target, storage_reader=_reader(system, folder / "async-next"))
    _sync(device)
    _put(rec, "async checkpoint bit-exact", float(_same(state, target)))
    _release(system, cached, device)
    shutil.rmtree(folder, ignore_errors=True)


def references(state: Dict[str, Any], root: Path, device: str, nbytes: int, rec: Dict[str, List[float]]) -> None:
    tensors = _tensors(state)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda") for t in tensors]

    def to_pinned() -> None:
        for buf, t in zip(pinned, tensors):
            buf.copy_(t, non_blocking=True)
        _sync(device)

    to_pinned()
    seconds, _ = _timed(to_pinned)
    _put(rec, "ref: to host, pinned ahead MiB/s", nbytes / seconds / 2**20)
    seconds, _ = _timed(lambda: [t.to("cpu") for t in tensors])
    _put(rec, "ref: to host, .to('cpu') MiB/s", nbytes / seconds / 2**20)

    def from_pinned() -> None:
        for buf, t in zip(pinned, tensors):
            t.copy_(buf, non_blocking=True)
        _sync(device)

    seconds, _ = _timed(from_pinned)
    _put(rec, "ref: to GPU from pinned MiB/s", nbytes / seconds / 2**20)
    os.sync()
    path = root / "raw.bin"

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            for buf in pinned:
                f.write(buf.view(-1).view(torch.uint8).numpy().data if buf.numel() else b"")
            os.fsync(f.fileno())

    seconds, _ = _timed(write)
    _put(rec, "ref: raw write+fsync MiB/s", nbytes / seconds / 2**20)
    path.unlink()
    pinned.clear()
    gc.collect()
    if device == "cuda":
        torch._C._host_emptyCache()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2GiB", help="bytes of state (parameters + two moments)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the raw figures here")
    # smoke: the CPU path (the steps, not the figures), one layer of width 16 beside the embedding (~8 MB)
    args = parse_args(parser, size="1MiB", hidden="16", repeats="1", device="cpu")
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for a smoke run")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (1,))
    shapes = _shapes(parse_size(args.size), args.hidden)
    state = _state(shapes, device, mesh)
    target = _state(shapes, device, mesh)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    trainer = Trainer(device)
    root = Path(tempfile.mkdtemp(prefix="bench-torch-cuda-", dir=args.dir))
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "state": fmt_size(nbytes), "tensors": len(_tensors(state)), "cpus": os.cpu_count()}
    print(json.dumps(info), flush=True)
    records: Dict[str, Dict[str, List[float]]] = {s: {} for s in SYSTEMS + ("reference",)}
    try:
        for rnd in range(args.repeats):
            systems = SYSTEMS if device == "cuda" else SYSTEMS[:2]  # DCP's cache pins: CUDA only
            for system in systems if rnd % 2 == 0 else systems[::-1]:
                run_system(system, state, target, root, device, trainer, nbytes, records[system])
            references(state, root, device, nbytes, records["reference"])
            print(f"round {rnd + 1}/{args.repeats} done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    _table(records)
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "records": records}, indent=1))
    write_results("torch-cuda", {"info": info, "records": records})
    exact = [v for rec in records.values() for k, vs in rec.items() if "bit-exact" in k for v in vs]
    if not exact or min(exact) < 1:
        sys.exit("a checkpoint did not load back bit for bit")


def _table(records: Dict[str, Dict[str, List[float]]]) -> None:
    rows = sorted({k for rec in records.values() for k in rec}, key=_row_order)
    systems = [s for s in SYSTEMS + ("reference",) if records[s]]
    print("| | " + " | ".join(systems) + " | shardckpt / dcp |")
    print("|---|" + "---:|" * (len(systems) + 1))
    for row in rows:
        cells = []
        for s in systems:
            values = records[s].get(row)
            cells.append(f"{statistics.median(values):.3g}" if values else "")
        ours, theirs = records["shardckpt"].get(row), records["dcp"].get(row)
        ratio = (f"{statistics.median(ours) / statistics.median(theirs):.2f}"
                 if ours and theirs and statistics.median(theirs) else "")
        print(f"| {row} | " + " | ".join(cells) + f" | {ratio} |")


def _row_order(row: str) -> Tuple[int, str]:
    order = ("save", "load", "async_save blocking", "GPU memory", "train step", "train steps", "host memory",
             "async save total", "async checkpoint", "ref")
    for i, prefix in enumerate(order):
        if row.startswith(prefix):
            return i, row
    return len(order), row


if __name__ == "__main__":
    main()
