"""One client of the funnelled-restore test (tests/test_funnel_restore.py), under torchrun or mpiexec.

Usage: ``funnel_restore_worker.py OUTDIR DATADIR`` on 4 clients. Client 0 is the io client.

1. Every client saves (each its own pieces, no funnelling): a ``DTensorCheckpoint`` of the
   variables of ``dtensor_worker.VARS`` on a 2x4 mesh plus a plain variable, and a
   ``sharded_save`` bundle of the same; client 0 alone writes a small ``save_v2`` bundle with a
   string tensor.
2. From then on clients 1-3 may not touch DATADIR: their storage layer (a mounted wrapper) and
   ``os.open`` / ``os.stat`` / ``open`` refuse any path under it and record the attempt.
3. Funnelled restores (``CheckpointOptions(io_device=<task 0>)``), each checked bit-exact:
   ``DTensorCheckpoint.restore`` onto other layouts of the 2x4 mesh (budget 64 KiB: the 2 MiB
   variable goes in chunks); ``DTensorCheckpoint.read`` onto an 8-device 1-D mesh; ``name_based_restore``
   of the ``sharded_save`` bundle with a 4 KiB budget (rows of 32 KiB are cut further); and
   ``restore_tensors`` of different regions on each client plus the string tensor.
   Then the 2 MiB variable alone: the io client reads each of its bytes once, every other client
   receives exactly the bytes of its distinct local pieces.
4. Failures end on every client, without a hang: a key missing on client 2 only (planning
   fails there), and a data file the io client finds corrupt (a read fails mid-stream).

Outcomes and refused attempts go to ``OUTDIR/rank<R>.json``.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dtensor_worker as W  # noqa: E402

U = "unsharded"
IO = "/job:worker/replica:0/task:0/device:CPU:0"
STRINGS = np.array([b"alpha", b"", b"\x00\xff binary", "ünïcode".encode()], dtype=object).reshape(2, 2)
TABLE = np.arange(64 * 48, dtype=np.float64).reshape(64, 48) / 7.0
result: Dict[str, Any] = {"phases": {}, "attempts": []}
OUT = ""


def flush() -> None:
    path = os.path.join(OUT, f"rank{result.get('rank', os.getpid())}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def phase(name: str, fn: Any) -> None:
    t0 = time.monotonic()
    entry: Dict[str, Any] = {}
    try:
        entry["value"] = fn()
        entry["ok"] = True
    except Exception as e:  # judged by the test
        entry.update(ok=False, type=type(e).__name__, message=str(e), traceback=traceback.format_exc())
    entry["elapsed"] = time.monotonic() - t0
    result["phases"][name] = entry
    flush()


def forbid(data: str) -> None:
    """Refuse (and record) every access to ``data`` from now on: storage layer and OS calls."""
    from shardckpt.errors import StorageError
    from shardckpt.storage.local import local_fs
    from shardckpt.storage.registry import mounted
    from shardckpt.storage.wrappers import FileSystemWrapper

    root = os.path.realpath(data)

    def inside(path: Any) -> bool:
        try:
            return os.path.realpath(os.fspath(path)).startswith(root)
        except TypeError:
            return False  # a descriptor

    class Forbidden(FileSystemWrapper):
        def before(self, op: str, path: str) -> None:
            if inside(path):
                result["attempts"].append([op, path])
                raise StorageError(f"client may not touch {path}", path=path)

        def identity(self, path: str, handle: Any = None) -> Any:
            self.before("identity", path)
            return local_fs.identity(path, handle)

    mounted(Forbidden(local_fs)).__enter__()  # for the rest of the process
    for module, name in ((os, "open"), (os, "stat"), (builtins, "open")):
        original = getattr(module, name)

        def guarded(path: Any, *args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            if inside(path):
                result["attempts"].append([__name, str(path)])
                raise PermissionError(13, "client may not touch the checkpoint folder", str(path))
            return __original(path, *args, **kwargs)

        setattr(module, name, guarded)


def exact(targets: Dict[str, Any], generation: int) -> Dict[str, List[str]]:
    return {name: W.mismatches(var, W.value(name, generation)) for name, var in targets.items()}


def main() -> None:
    global OUT
    OUT, data = sys.argv[1], sys.argv[2]
    os.makedirs(OUT, exist_ok=True)
    import shardckpt
    from shardckpt import CheckpointOptions
    from shardckpt import dtensor as dt
    from shardckpt.distributed import set_coordinator
    from shardckpt.format.tensor_slice import box_shape
    from shardckpt.io import save_v2
    from shardckpt.restoring import RestoreRequest, restore_tensors

    coord = W.make_coordinator(60.0)
    set_coordinator(coord)
    rank = coord.rank
    result.update(rank=rank, size=coord.size, backend=coord.backend)
    flush()
    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
    mesh8 = dt.create_distributed_mesh([("z", 8)])

    # 1. saves, every client writing its own pieces
    variables = W.dvariables(mesh, W.CKPT_GEN)
    plain = shardckpt.Variable(W.value(W.PLAIN, W.CKPT_GEN))
    ckpt_path = dt.DTensorCheckpoint(mesh, coordinator=coord, plain=plain, **variables).save(
        os.path.join(data, "ck", "ck"))
    sharded = os.path.join(data, "sharded", "model")
    dt.sharded_save(mesh, sharded, list(variables), [""] * len(variables), [v.value() for v in variables.values()])
    tensors = os.path.join(data, "tensors", "t")
    if rank == 0:
        save_v2(tensors, ["strings", "table"], ["", ""], [STRINGS, TABLE])
        save_v2(os.path.join(data, "bad", "t"), ["table"], [""], [TABLE])
        with open(os.path.join(data, "bad", "t.data-00000-of-00001"), "r+b") as f:  # a flipped byte mid-entry
            f.seek(TABLE.nbytes // 2)
            byte = f.read(1)
            f.seek(TABLE.nbytes // 2)
            f.write(bytes([byte[0] ^ 0x40]))
    coord.barrier("saved")

    # 2. only client 0 may touch the folder from now on
    if rank != 0:
        forbid(data)
    W.count_reads()
    coord.barrier("forbidden")
    opts = CheckpointOptions(io_device=IO, funnel_inflight_bytes=64 << 10)

    def restore_ckpt() -> Dict[str, Any]:
        targets = W.zero_dvariables(mesh, W.OTHER_24)
        restored_plain = shardckpt.Variable(np.zeros((3, 4), np.float32))
        ck = dt.DTensorCheckpoint(mesh, coordinator=coord, plain=restored_plain, **targets)
        ck.restore(ckpt_path, options=opts).assert_consumed()
        return {"mismatches": exact(targets, W.CKPT_GEN),
                "plain": bool(np.array_equal(restored_plain.numpy(), W.value(W.PLAIN, W.CKPT_GEN))),
                "save_counter": int(ck.save_counter.numpy())}

    def read_ckpt_dir() -> Dict[str, Any]:  # onto another mesh: the io client reads for all
        layouts = {n: (["z", U] if i % 2 else [U, "z"]) for i, n in enumerate(sorted(W.VARS))}
        targets = W.zero_dvariables(mesh8, layouts)
        # read() takes a prefix, as TF's does (a folder raises); the io client reads the index
        dt.DTensorCheckpoint(mesh8, coordinator=coord, **targets).read(
            ckpt_path, options=CheckpointOptions(io_device=IO)).expect_partial()
        return {"mismatches": exact(targets, W.CKPT_GEN)}

    def named() -> Dict[str, Any]:
        likes = {n: dt.from_global(np.zeros(W.VARS[n][2], W.VARS[n][1]), dt.Layout(W.OTHER_24[n], mesh))
                 for n in W.VARS}
        got = dt.name_based_restore(mesh, sharded, likes, options=CheckpointOptions(
            io_device=IO, funnel_inflight_bytes=4096), coordinator=coord)
        bad = {}
        for n, tensor in got.items():
            want = W.value(n, W.CKPT_GEN)
            bad[n] = [d for d in tensor.components
                      if not np.array_equal(tensor.components[d], want[tuple(slice(a, b) for a, b in tensor.box(d))])]
        return {"mismatches": bad}

    def tensor_level() -> Dict[str, Any]:
        rows = (rank * 13 % 64, min(64, rank * 13 % 64 + 20))
        region = ((rows[0], rows[1]), (rank, 48 - rank))
        reqs = [RestoreRequest("strings"), RestoreRequest("table", region, dtype="float64"),
                RestoreRequest("table", ((0, 64), (5, 6))), RestoreRequest("table")]
        got = restore_tensors(tensors, reqs, options=CheckpointOptions(io_device=IO, funnel_inflight_bytes=1000),
                              coordinator=coord)
        want = [STRINGS, TABLE[rows[0]:rows[1], rank:48 - rank], TABLE[:, 5:6], TABLE]
        return {"exact": [bool(g.shape == w.shape and np.array_equal(g, w)) for g, w in zip(got, want)],
                "shape": list(box_shape(region))}

    def big_once() -> Dict[str, Any]:  # each byte read once by the io client, each client gets its own
        from shardckpt.restoring.funnel import FunnelledReader, run_funnelled

        targets = W.zero_dvariables(mesh, W.OTHER_24, ["big"])
        W.BYTES_READ["bytes"] = 0
        funnel = FunnelledReader(sharded, coord, 0, budget=256 << 10)
        run_funnelled(funnel, lambda reader: targets["big"].value().restore_from(reader, "big"))
        return {"read": W.BYTES_READ["bytes"], "received": funnel.received,
                "needed": W.local_piece_bytes(targets["big"]), "mismatches": exact(targets, W.CKPT_GEN)}

    def missing_on_client_2() -> None:
        keys = ["table", "no such key"] if rank == 2 else ["table"]
        restore_tensors(tensors, keys, options=CheckpointOptions(io_device=IO), coordinator=coord)

    def corrupt_on_io() -> None:
        restore_tensors(os.path.join(data, "bad", "t"), [RestoreRequest("table", ((0, 64), (0, 48)))],
                        options=CheckpointOptions(io_device=IO, funnel_inflight_bytes=4096), coordinator=coord)

    def after() -> Dict[str, Any]:  # the coordinator still works after the failures
        got = restore_tensors(tensors, ["table"], options=CheckpointOptions(io_device=IO), coordinator=coord)
        return {"exact": bool(np.array_equal(got[0], TABLE))}

    phase("restore_ckpt", restore_ckpt)
    phase("read_ckpt_dir", read_ckpt_dir)
    phase("named", named)
    phase("tensor_level", tensor_level)
    phase("big_once", big_once)
    phase("missing_on_client_2", missing_on_client_2)
    phase("corrupt_on_io", corrupt_on_io)
    phase("after", after)
    coord.barrier("done")
    result["done"] = True
    flush()
    coord.close()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        result["fatal"] = traceback.format_exc()
        flush()
        raise
