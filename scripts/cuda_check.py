"""Checks of ``shardckpt.torch``'s CUDA path, for a machine with a GPU (CI has none: this is not a test).

::

    python scripts/cuda_check.py            # exits 0 when every check holds, 1 otherwise

In a one-rank world (``cpu:gloo,cuda:nccl``), with DTensors on a CUDA mesh and plain CUDA
tensors of several dtypes (float32, bfloat16, float16, float8, int64, bool):

* ``HostStager.stage`` puts the staged copy on the host, page-locked, and adds no GPU memory
  (a DTensor rebuilt with ``from_local`` would go back to the mesh's device);
* ``dcp.save`` / ``dcp.async_save`` (THREAD and PROCESS checkpointers) write checkpoints that
  ``dcp.load`` brings back bit for bit into DTensors, into plain CUDA tensors, and with a
  cast (stored bfloat16 into a float32 CUDA tensor);
* ``release_staging_buffers()`` returns the page-locked staging memory to the system.

The figures (throughput, blocking times against DCP) are ``benchmarks/bench_torch_cuda.py``'s.
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402

from shardckpt.torch import TFBundleReader, TFBundleWriter, release_staging_buffers  # noqa: E402

FAILED: List[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def _state(mesh: Any, seed: int) -> Dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": distribute_tensor(torch.randn(4099, 4096, generator=g, device="cuda"), mesh, [Shard(0)]),
        "r": distribute_tensor(torch.randn(333, 77, generator=g, device="cuda").bfloat16(), mesh, [Replicate()]),
        "h": torch.randn(1000, 513, generator=g, device="cuda").half(),
        "f8": torch.randn(64, 48, generator=g, device="cuda").to(torch.float8_e4m3fn),
        "i": torch.randint(-2**40, 2**40, (777,), generator=g, device="cuda"),
        "m": torch.rand(31, 5, generator=g, device="cuda") > 0.5,
        "step": seed,
    }


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _bytes(t: Any) -> torch.Tensor:
    return _full(t).contiguous().view(-1).view(torch.uint8)


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a if isinstance(a[k], torch.Tensor))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    from shardckpt.torch._staging import HostStager

    mesh = init_device_mesh("cuda", (1,))
    root = Path(tempfile.mkdtemp(prefix="shardckpt-cuda-check-"))
    try:
        sd = _state(mesh, 1)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        staged, _ = HostStager().stage(sd)
        local = staged["w"].to_local()
        check("staged DTensor lives on the host, pinned, no GPU memory added",
              local.device.type == "cpu" and local.is_pinned() and torch.cuda.memory_allocated() == before,
              f"({local.device}, pinned {local.is_pinned()}, +{torch.cuda.memory_allocated() - before} B)")
        del staged, local
        saves = [("sync", None), ("async PROCESS", AsyncCheckpointerType.PROCESS),
                 ("async PROCESS again", AsyncCheckpointerType.PROCESS), ("async THREAD", AsyncCheckpointerType.THREAD)]
        for i, (name, kind) in enumerate(saves):
            sd = _state(mesh, i)
            prefix = str(root / f"ck{i}")
            if kind is None:
                dcp.save(sd, storage_writer=TFBundleWriter(prefix))
            else:
                future: Any = dcp.async_save(sd, storage_writer=TFBundleWriter(prefix), async_checkpointer_type=kind)
                future.result()
            back = _state(mesh, 99)
            dcp.load(back, storage_reader=TFBundleReader(prefix))
            check(f"{name}: loads back bit for bit into DTensors and CUDA tensors", _same(sd, back))
            plain = {"w": torch.zeros(4099, 4096, device="cuda"), "r": torch.zeros(333, 77, device="cuda")}
            dcp.load(plain, storage_reader=TFBundleReader(prefix))
            check(f"{name}: into plain CUDA tensors, bfloat16 cast to float32",
                  torch.equal(plain["w"], _full(sd["w"])) and torch.equal(plain["r"], _full(sd["r"]).float()))
        gc.collect()
        rss = _rss()
        release_staging_buffers()
        gc.collect()
        freed = rss - _rss()
        check("release_staging_buffers returns the staging memory", freed > 4099 * 4096 * 4 * 0.9,
              f"({freed >> 20} MiB)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    print("every check holds" if not FAILED else f"{len(FAILED)} failed: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
