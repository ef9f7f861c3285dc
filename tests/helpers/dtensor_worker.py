"""One client of tests/test_dtensor_multiclient.py, started by torchrun or mpiexec.

    dtensor_worker.py MODE OUTDIR DATADIR

``MODE``:

* ``save4`` (4 clients, mesh ``[("x", 2), ("y", 4)]``, 2 devices each), in this order:

  - ``sharded``: ``dtensor.sharded_save`` of the variables of :data:`VARS` (one per layout)
    and a plain array, at ``DATADIR/raw/sharded``;
  - ``ckpt``: ``DTensorCheckpoint.save`` of DVariables of those layouts, a plain
    ``Variable`` and ``save_counter``, at ``DATADIR/ck/ck`` (``ck-1``);
  - ``funnel_sharded`` / ``funnel_ckpt``: the same two saves with
    ``CheckpointOptions(io_device="/job:worker/replica:0/task:1/device:CPU:0")`` at
    ``DATADIR/funnel/sharded`` and ``DATADIR/funnel_ck/ck``: client 1 alone touches files;
  - ``restore4``: ``ck-1`` and the funnelled ``ck-1`` restored onto the 4 clients with
    other meshes and layouts;
  - ``async``: a training loop whose every step runs ``all_reduce`` on the user's default
    group / ``COMM_WORLD``, with ``DTensorCheckpoint.save(..., enable_async=True)`` every
    second step at ``DATADIR/async/ck``, the values clobbered right after each return,
    then ``sync()``; each save's background writes are held at the first until the next
    step's first collective ran (so a save is in flight beside collectives on every run, not
    only when the machine is slow enough), then write, merge and agree beside the others;
  - ``fault``: a new save into ``DATADIR/ck`` on a coordinator with a short timeout
    (:data:`FAULT_TIMEOUT`) while client :data:`VICTIM` fails after writing its parts,
    before the barrier: under torch it SIGKILLs itself; under MPI (where one dying process
    ends the whole job) it hangs past the timeout instead. Under torchrun the survivors
    ignore the SIGTERM the elastic agent sends once it sees the victim die, so that they
    show what shardckpt does on its own (torchrun's agent would otherwise end them at once).

* ``fault2`` (4 clients, coordinator timeout :data:`FAULT_TIMEOUT`): a first save at
  ``DATADIR/fault2/ck`` (``ck-1``), then a second one during which client :data:`VICTIM2`
  fails inside the save's first collective (the all-gather of shard counts), before writing
  anything: SIGKILL under torch, a hang past the timeout under MPI (it takes part late).

* ``restore2`` (2 clients): the checkpoints of ``save4`` restored onto meshes of 2 clients
  (``[("x", 2), ("y", 2)]`` with transposed layouts, and ``[("y", 4)]``), counting the
  bytes each client reads.

Every phase's outcome and every filesystem write call (``LocalFileSystem.open_write``,
``rename``, ``makedirs``, ``remove``, ``remove_tree``) go into ``OUTDIR/rank<R>.json``; the
test judges those files and the checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Dict, List, Tuple

import numpy as np

U = "unsharded"
SHAPE = (8, 16)
BIG = (64, 8192)  # 2 MiB of float32: runs of >= 4 KiB in every resharded restore, so bytes read are telling
# name -> (layout on the 2x4 source mesh ("x", 2), ("y", 4), dtype, shape)
VARS: Dict[str, Tuple[List[str], str, Tuple[int, ...]]] = {
    "on_x": (["x", U], "float32", SHAPE),     # sharded on x, partially replicated: 2 pieces, 4 replicas each
    "x_cols": ([U, "x"], "float64", SHAPE),   # sharded on x over the columns
    "on_y": ([U, "y"], "float32", SHAPE),     # sharded on y: 4 pieces, 2 replicas each
    "on_xy": (["x", "y"], "int64", SHAPE),    # sharded on both: 8 pieces
    "on_yx": (["y", "x"], "float32", SHAPE),  # sharded on both, transposed
    "replicated": ([U, U], "int32", SHAPE),   # fully replicated: one whole entry
    "big": (["x", "y"], "float32", BIG),
}
# Another layout of every variable on the same 2x4 mesh (4-client restore).
OTHER_24: Dict[str, List[str]] = {"on_x": [U, "x"], "x_cols": ["y", "x"], "on_y": ["y", U], "on_xy": ["y", "x"],
                                  "on_yx": ["x", "y"], "replicated": ["x", "y"], "big": ["y", "x"]}
# The transposed layout of every variable on a 2x2 mesh ("x", 2), ("y", 2) of 2 clients.
TRANSPOSED_22: Dict[str, List[str]] = {name: list(reversed(spec)) if name != "replicated" else ["y", "x"]
                                       for name, (spec, _, _) in VARS.items()}
# Rows or columns on a 1-D mesh ("y", 4) of 2 clients.
ALTERNATE_Y4: Dict[str, List[str]] = {n: ([U, "y"] if i % 2 else ["y", U]) for i, n in enumerate(sorted(VARS))}
PLAIN = "plain"
KEY = "/.ATTRIBUTES/VARIABLE_VALUE"
IO_DEVICE = "/job:worker/replica:0/task:1/device:CPU:0"
VICTIM = 2
VICTIM2 = 3  # fault2: fails inside the save's first collective
FAULT_TIMEOUT = 5.0
LONG = 60.0
ASYNC_STEPS = 6
CKPT_GEN = 1  # generation of the values of every synchronous save
FAULT_GEN = 2  # the values the failed save tried to write
CLOBBER_GEN = 999  # written right after each async save returns: must never show in a checkpoint


def value(name: str, generation: int) -> np.ndarray:
    """The deterministic value of variable ``name`` in ``generation``."""
    if name == PLAIN:
        return (np.arange(12, dtype=np.float32) + 1000 * generation).reshape(3, 4)
    _, dtype, shape = VARS[name]
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([generation, sorted(VARS).index(name)])
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape, dtype=np.float32) * 10 + 1000 * generation).astype(dtype)


# -- recording ---------------------------------------------------------------------------------------------
OUT = ""
result: Dict[str, Any] = {"phases": {}, "writes": {}}
_phase = ["setup"]
_WRITE_METHODS = ("open_write", "rename", "makedirs", "remove", "remove_tree")


def flush() -> None:
    rank = result.get("rank", os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.getpid())))
    path = os.path.join(OUT, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def record_writes() -> None:
    """Record every filesystem write call of this process, under the current phase."""
    from shardckpt.storage.local import LocalFileSystem

    for method in _WRITE_METHODS:
        original = getattr(LocalFileSystem, method)

        def wrapper(self, *args, __original=original, __method=method, **kwargs):
            result["writes"].setdefault(_phase[0], []).append([__method, str(args[0]) if args else ""])
            return __original(self, *args, **kwargs)

        setattr(LocalFileSystem, method, wrapper)


BYTES_READ = {"bytes": 0}


def count_reads() -> None:
    from shardckpt.storage.local import LocalFileSystem

    original = LocalFileSystem.pread_into

    def counting(self, fd, buf, offset, path=""):
        BYTES_READ["bytes"] += memoryview(buf).nbytes
        return original(self, fd, buf, offset, path)

    LocalFileSystem.pread_into = counting


def phase(name: str, fn) -> Dict[str, Any]:
    _phase[0] = name
    t0 = time.monotonic()
    entry: Dict[str, Any] = {}
    try:
        entry["value"] = fn()
        entry["ok"] = True
    except Exception as e:  # recorded for the test to judge
        from shardckpt.distributed import CoordinationError, CoordinationTimeout

        entry.update(ok=False, type=type(e).__name__, message=str(e), missing=getattr(e, "missing", None),
                     timeout=isinstance(e, CoordinationTimeout), coordination=isinstance(e, CoordinationError),
                     cause=repr(e.__cause__) if e.__cause__ is not None else None,
                     traceback=traceback.format_exc())
    entry["elapsed"] = time.monotonic() - t0
    result["phases"][name] = entry
    _phase[0] = "between"
    flush()
    return entry


# -- helpers -------------------------------------------------------------------------------------------------
def launched(run, node_of_rank=None, register: bool = False) -> None:
    """A launched client's whole life: ``argv`` is ``OUTDIR DATADIR``; ``SHARDCKPT_NODE`` set to
    ``node_of_rank(rank)`` (when given) before anything is built; a coordinator (``register``: also the
    process's, ``set_coordinator``) in ``result["coordinator"]`` while ``run(datadir)`` runs; the record
    marked ``done``, or its ``fatal`` traceback kept, in ``OUTDIR/rank<R>.json``."""
    global OUT
    try:
        OUT, data = sys.argv[1], os.path.abspath(sys.argv[2])
        os.makedirs(OUT, exist_ok=True)
        rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        if node_of_rank is not None:
            os.environ["SHARDCKPT_NODE"] = str(node_of_rank(rank))
        coord = make_coordinator(LONG)
        if register:
            from shardckpt.distributed import set_coordinator

            set_coordinator(coord)
        result.update(rank=coord.rank, size=coord.size, backend=coord.backend, pid=os.getpid())
        flush()
        result["coordinator"] = coord
        try:
            run(data)
        finally:
            del result["coordinator"]
        result["done"] = True
        flush()
        coord.close()
    except BaseException:
        result.pop("coordinator", None)
        result["fatal"] = traceback.format_exc()
        flush()
        raise


def make_coordinator(timeout: float):
    from shardckpt.distributed.select import detect_backend

    if detect_backend() == "torch":
        from shardckpt.distributed.torch_backend import TorchCoordinator

        return TorchCoordinator(timeout=timeout)
    from shardckpt.distributed.mpi_backend import MPICoordinator

    return MPICoordinator(timeout=timeout)


def user_allreduce(backend: str):
    """The user's "training" collective: a sum over the default group / COMM_WORLD."""
    if backend == "torch":
        import torch
        import torch.distributed as dist

        def allreduce(v: float) -> float:
            t = torch.tensor([float(v)], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t.item())

        return allreduce
    from mpi4py import MPI

    def allreduce(v: float) -> float:
        recv = np.zeros(1)
        MPI.COMM_WORLD.Allreduce(np.array([float(v)]), recv, op=MPI.SUM)
        return float(recv[0])

    return allreduce


def mismatches(var, expected: np.ndarray) -> List[str]:
    """Devices whose component differs from its box of ``expected`` (empty: exact)."""
    out = []
    for device, component in var.value().components.items():
        box = var.value().box(device)
        want = expected[tuple(slice(a, b) for a, b in box)]
        if component.dtype != want.dtype or component.shape != want.shape or not np.array_equal(component, want):
            out.append(f"device {device} box {box}")
    return out


def local_piece_bytes(var) -> int:
    from shardckpt.format.tensor_slice import box_volume

    return sum(box_volume(box) for box in var.value().local_pieces()) * var.value().dtype.itemsize


def dvariables(mesh, generation: int, layouts: Dict[str, List[str]] = None) -> Dict[str, Any]:
    from shardckpt import dtensor as dt

    layouts = layouts or {name: spec for name, (spec, _, _) in VARS.items()}
    return {name: dt.DVariable.from_global(value(name, generation), dt.Layout(layouts[name], mesh), name=name)
            for name in VARS}


def zero_dvariables(mesh, layouts: Dict[str, List[str]], names=None) -> Dict[str, Any]:
    from shardckpt import dtensor as dt

    return {name: dt.DVariable.from_global(np.zeros(VARS[name][2], VARS[name][1]), dt.Layout(layouts[name], mesh),
                                           name=name) for name in (names or VARS)}


def set_generation(variables: Dict[str, Any], plain, generation: int) -> None:
    from shardckpt import dtensor as dt

    for name, var in variables.items():
        var.assign(dt.from_global(value(name, generation), var.layout))
    plain.assign(value(PLAIN, generation))


def restore_and_check(mesh, layouts: Dict[str, List[str]], path: str, coordinator, generation: int,
                      kind: str = "ckpt") -> Dict[str, Any]:
    """Restore ``path`` onto ``mesh`` with ``layouts``; mismatching devices and bytes read vs needed."""
    import shardckpt
    from shardckpt import dtensor as dt
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.storage.location import Location

    targets = zero_dvariables(mesh, layouts)
    BYTES_READ["bytes"] = 0
    out: Dict[str, Any] = {}
    if kind == "ckpt":
        plain = shardckpt.Variable(np.zeros((3, 4), np.float32))
        ckpt = dt.DTensorCheckpoint(mesh, coordinator=coordinator, plain=plain, **targets)
        ckpt.restore(path).assert_consumed()
        out["plain_ok"] = bool(np.array_equal(plain.numpy(), value(PLAIN, generation)))
        out["save_counter"] = int(ckpt.save_counter.numpy())
    else:  # a sharded_save bundle: keys are the names, no object graph
        with BundleReader(Location.of(path)) as reader:
            for name, var in targets.items():
                var.value().restore_from(reader, name)
            out["plain_ok"] = bool(np.array_equal(reader.read(PLAIN), value(PLAIN, generation)))
    out["bytes_read"] = BYTES_READ["bytes"]
    out["bytes_needed"] = sum(local_piece_bytes(v) for v in targets.values())
    out["mismatches"] = {name: mismatches(var, value(name, generation)) for name, var in targets.items()}
    out["gathered_ok"] = {name: bool(np.array_equal(dt.to_global(var.value(), coordinator), value(name, generation)))
                          for name, var in targets.items()}
    out["local_devices"] = mesh.local_device_ids()
    # the big variable alone: the bytes this client reads against the bytes of its distinct local pieces
    big = zero_dvariables(mesh, layouts, ["big"])
    BYTES_READ["bytes"] = 0
    if kind == "ckpt":
        dt.DTensorCheckpoint(mesh, coordinator=coordinator, **big).restore(path).expect_partial()
    else:
        with BundleReader(Location.of(path)) as reader:
            big["big"].value().restore_from(reader, "big")
    out["big_bytes_read"] = BYTES_READ["bytes"]
    out["big_bytes_needed"] = local_piece_bytes(big["big"])
    out["big_mismatches"] = mismatches(big["big"], value("big", generation))
    return out


# -- save4 ---------------------------------------------------------------------------------------------------
def run_save4(data: str) -> None:
    import shardckpt
    from shardckpt import CheckpointOptions
    from shardckpt import dtensor as dt
    from shardckpt.distributed import set_coordinator
    from shardckpt.distributed.select import detect_backend

    backend = detect_backend()
    if backend == "torch":
        import torch.distributed as dist

        dist.init_process_group(backend="gloo")  # the user's default group, for the training collectives
    coord = make_coordinator(LONG)
    fault_coord = make_coordinator(FAULT_TIMEOUT)  # collective: made up front by every client
    set_coordinator(coord)
    rank, size = coord.rank, coord.size
    result.update(rank=rank, size=size, backend=coord.backend, pid=os.getpid())
    flush()
    record_writes()
    count_reads()
    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
    result["local_devices"] = mesh.local_device_ids()
    names = sorted(VARS)

    def sharded(prefix: str, options=None):
        variables = dvariables(mesh, CKPT_GEN)
        tensors = [variables[n].value() for n in names] + [value(PLAIN, CKPT_GEN)]
        return dt.sharded_save(mesh, os.path.join(data, prefix), names + [PLAIN], [""] * (len(names) + 1),
                               tensors, options, coordinator=coord)

    def ckpt_save(folder: str, options=None):
        variables = dvariables(mesh, CKPT_GEN)
        plain = shardckpt.Variable(value(PLAIN, CKPT_GEN))
        ck = dt.DTensorCheckpoint(mesh, coordinator=coord, plain=plain, **variables)
        path = ck.save(os.path.join(data, folder, "ck"), options=options)
        return {"path": path, "save_counter": int(ck.save_counter.numpy())}

    funnel = CheckpointOptions(io_device=IO_DEVICE)
    phase("sharded", lambda: sharded("raw/sharded"))
    phase("ckpt", lambda: ckpt_save("ck"))
    phase("funnel_sharded", lambda: sharded("funnel/sharded", funnel))
    phase("funnel_ckpt", lambda: ckpt_save("funnel_ck", funnel))

    def restore4():
        out = {}
        mesh8 = dt.create_distributed_mesh([("a", 8)])
        cols = {n: [U, "a"] for n in VARS}
        out["ck_a8_cols"] = restore_and_check(mesh8, cols, os.path.join(data, "ck", "ck-1"), coord, CKPT_GEN)
        out["ck_24_other"] = restore_and_check(mesh, OTHER_24, os.path.join(data, "ck", "ck-1"), coord, CKPT_GEN)
        out["funnel_ck_a8_cols"] = restore_and_check(mesh8, cols, os.path.join(data, "funnel_ck", "ck-1"), coord,
                                                     CKPT_GEN)
        out["raw_24_other"] = restore_and_check(mesh, OTHER_24, os.path.join(data, "raw", "sharded"), coord,
                                                CKPT_GEN, kind="raw")
        return out

    phase("restore4", restore4)

    def train_with_async_saves():
        import threading

        from shardckpt.storage.local import LocalFileSystem
        from shardckpt.storage.registry import mounted
        from shardckpt.storage.wrappers import FileSystemWrapper

        gate = threading.Event()  # the background writes of a save wait for it: opened after the next collective
        gate.set()

        class Held(FileSystemWrapper):
            def write_all(self, handle, buf, path=""):
                if threading.current_thread() is not threading.main_thread() and not gate.wait(120):
                    raise TimeoutError("the test's gate never opened")
                self.inner.write_all(handle, buf, path)

        allreduce = user_allreduce(backend)
        variables = dvariables(mesh, 100)
        plain = shardckpt.Variable(value(PLAIN, 100))
        ck = dt.DTensorCheckpoint(mesh, coordinator=coord, plain=plain, **variables)
        options = CheckpointOptions(enable_async=True)
        saves, sums_ok, overlapped = [], True, 0
        saver = None
        with mounted(Held(LocalFileSystem())):
            for step in range(1, ASYNC_STEPS + 1):
                set_generation(variables, plain, 100 + step)  # the "training step" updates the values
                for k in range(10):  # the user's collectives, while the previous save is in flight
                    sums_ok &= allreduce(rank * step + k) == step * sum(range(size)) + k * size
                    saver = saver or ck.__dict__.get("_shardckpt_saver")
                    overlapped += int(saver is not None and saver.pending)
                    gate.set()  # the save writes, merges and agrees beside the next collectives
                if step % 2 == 0:
                    gate.clear()  # held at its first write until this client's next collective ran
                    t0 = time.monotonic()
                    path = ck.save(os.path.join(data, "async", "ck"), options=options)
                    saves.append({"path": path, "generation": 100 + step, "returned_s": time.monotonic() - t0,
                                  "counter": int(ck.save_counter.numpy())})
                    set_generation(variables, plain, CLOBBER_GEN)  # after the return: must not be in the checkpoint
            gate.set()
            ck.sync()
        return {"saves": saves, "sums_ok": bool(sums_ok), "overlapped": overlapped,
                "latest": shardckpt.latest_checkpoint(os.path.join(data, "async"))}

    phase("async", train_with_async_saves)

    # -- fault: client VICTIM fails after writing its parts, before the barrier --------------------------------
    ck_dir = os.path.join(data, "ck")
    variables = dvariables(mesh, FAULT_GEN)
    plain = shardckpt.Variable(value(PLAIN, FAULT_GEN))
    fault_ck = dt.DTensorCheckpoint(mesh, coordinator=fault_coord, plain=plain, **variables)
    fault_ck.restore(shardckpt.latest_checkpoint(ck_dir)).assert_consumed()  # save_counter = 1: the next save is ck-2
    set_generation(variables, plain, FAULT_GEN)
    result["fault_counter_before"] = int(fault_ck.save_counter.numpy())
    original_barrier = fault_coord.barrier

    def victim_barrier(name: str = "barrier", timeout=None):
        if name.startswith("shards of"):  # its parts are written; the others wait here
            result["victim_parts"] = list(result["writes"].get("fault", []))
            if backend == "torch":
                result["victim_killed_at"] = time.time()
                result["done"] = True
                flush()
                os.kill(os.getpid(), signal.SIGKILL)
            result["victim_slept"] = FAULT_TIMEOUT + 3.0
            time.sleep(FAULT_TIMEOUT + 3.0)
        return original_barrier(name, timeout)

    if rank == VICTIM:
        fault_coord.barrier = victim_barrier
    elif backend == "torch":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's agent: see the module docstring
    entry = phase("fault", lambda: fault_ck.save(os.path.join(ck_dir, "ck")))
    entry["counter_after"] = int(fault_ck.save_counter.numpy())
    entry["latest_after"] = shardckpt.latest_checkpoint(ck_dir)
    if backend == "mpi":  # the coordinators are still usable after a barrier timeout
        phase("after_fault", lambda: coord.barrier("after fault", timeout=LONG))
    result["done"] = True
    flush()
    if backend == "torch":
        os._exit(0)  # a peer is dead: no process-group teardown
    fault_coord.close()
    coord.close()


# -- fault2 --------------------------------------------------------------------------------------------------
def run_fault2(data: str) -> None:
    """Client VICTIM2 fails inside the save's first collective (before it writes anything)."""
    import shardckpt
    from shardckpt import dtensor as dt
    from shardckpt.distributed import set_coordinator
    from shardckpt.distributed.select import detect_backend

    backend = detect_backend()
    coord = make_coordinator(FAULT_TIMEOUT)
    set_coordinator(coord)
    rank = coord.rank
    result.update(rank=rank, size=coord.size, backend=coord.backend, pid=os.getpid())
    flush()
    record_writes()
    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
    variables = dvariables(mesh, CKPT_GEN)
    plain = shardckpt.Variable(value(PLAIN, CKPT_GEN))
    ck = dt.DTensorCheckpoint(mesh, coordinator=coord, plain=plain, **variables)
    ck_dir = os.path.join(data, "fault2")
    phase("first_save", lambda: ck.save(os.path.join(ck_dir, "ck")))
    set_generation(variables, plain, FAULT_GEN)
    original_all_gather = coord.all_gather

    def victim_all_gather(obj, timeout=None):
        if backend == "torch":
            result["victim_killed_at"] = time.time()
            result["done"] = True
            flush()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(FAULT_TIMEOUT + 1.0)  # MPI: hang past the others' timeout, then take part late
        return original_all_gather(obj, timeout)

    if rank == VICTIM2:
        coord.all_gather = victim_all_gather
    elif backend == "torch":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's agent: see the module docstring
    entry = phase("fault2", lambda: ck.save(os.path.join(ck_dir, "ck")))
    entry["counter_after"] = int(ck.save_counter.numpy())
    result["done"] = True
    flush()
    if backend == "torch":
        os._exit(0)  # a peer is dead: no process-group teardown


# -- restore2 ------------------------------------------------------------------------------------------------
def run_restore2(data: str) -> None:
    from shardckpt import dtensor as dt
    from shardckpt.distributed import set_coordinator

    coord = make_coordinator(LONG)
    set_coordinator(coord)
    result.update(rank=coord.rank, size=coord.size, backend=coord.backend, pid=os.getpid())
    flush()
    count_reads()
    mesh22 = dt.create_distributed_mesh([("x", 2), ("y", 2)])
    mesh4 = dt.create_distributed_mesh([("y", 4)])
    transposed = TRANSPOSED_22
    alternate = ALTERNATE_Y4
    ck1 = os.path.join(data, "ck", "ck-1")
    funnel = os.path.join(data, "funnel_ck", "ck-1")

    def restore():
        return {
            "ck_22_transposed": restore_and_check(mesh22, transposed, ck1, coord, CKPT_GEN),
            "ck_y4": restore_and_check(mesh4, alternate, ck1, coord, CKPT_GEN),
            "funnel_22_transposed": restore_and_check(mesh22, transposed, funnel, coord, CKPT_GEN),
            "raw_22_transposed": restore_and_check(mesh22, transposed, os.path.join(data, "raw", "sharded"),
                                                   coord, CKPT_GEN, kind="raw"),
            "funnel_raw_y4": restore_and_check(mesh4, alternate, os.path.join(data, "funnel", "sharded"),
                                               coord, CKPT_GEN, kind="raw"),
        }

    result["layouts"] = {"transposed": transposed, "alternate": alternate}
    phase("restore2", restore)
    result["done"] = True
    flush()
    coord.close()


def run_api4(data: str) -> None:
    """TF's DTensor client API across real clients: num_clients/client_id, barrier, DVariable to_global,
    relayout, name_based_save / name_based_restore onto other meshes and layouts, numpy() refused."""
    from shardckpt import dtensor as dt
    from shardckpt.distributed import set_coordinator
    from shardckpt.errors import InvalidArgumentError

    coord = make_coordinator(LONG)
    set_coordinator(coord)
    result.update(rank=coord.rank, size=coord.size, backend=coord.backend, pid=os.getpid())
    flush()
    mesh = dt.create_distributed_mesh([("x", 2), ("y", 4)])
    mesh8 = dt.create_distributed_mesh([("z", 8)])
    full_a = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    full_b = np.arange(8, dtype=np.int64)
    out: Dict[str, Any] = {"clients": [dt.num_clients(), dt.client_id()]}
    dt.barrier(mesh, "api4-start", timeout_in_ms=60_000)
    var = dt.DVariable.from_global(full_a, dt.Layout(["x", "y"], mesh), name="a")
    var.assign_add(1.0)
    out["to_global_dvariable"] = bool(np.array_equal(dt.to_global(var), full_a + 1))
    moved = dt.relayout(var, dt.Layout([U, "z"], mesh8))
    out["relayout"] = bool(np.array_equal(dt.to_global(moved), full_a + 1))
    try:
        var.numpy()
        out["numpy"] = "no error"
    except InvalidArgumentError as e:
        out["numpy"] = "to_global" in str(e)
    b = dt.from_global(full_b, dt.Layout(["z"], mesh8))
    prefix = os.path.join(data, "api4", "named")
    dt.name_based_save(mesh, prefix, {"a": var, "b": b})
    got = dt.name_based_restore(mesh, prefix, {
        "a": dt.from_global(np.zeros_like(full_a), dt.Layout(["y", U], mesh)),
        "b": dt.from_global(np.zeros_like(full_b), dt.Layout([U], mesh))})
    out["name_based"] = [bool(np.array_equal(dt.to_global(got["a"]), full_a + 1)),
                         bool(np.array_equal(dt.to_global(got["b"]), full_b))]
    dt.barrier(mesh, "api4-end")
    result["api"] = out
    result["done"] = True
    flush()
    coord.close()


def main() -> None:
    global OUT
    mode, OUT, data = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(OUT, exist_ok=True)
    {"save4": run_save4, "restore2": run_restore2, "fault2": run_fault2, "api4": run_api4}[mode](data)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        result["fatal"] = traceback.format_exc()
        flush()
        raise
