"""One client of tests/test_distributed.py, started by torchrun or mpiexec.

    coord_worker.py OUTDIR

Every step's outcome (values, or the exception's type, message and ``missing``)
goes into ``OUTDIR/rank<R>.json``; the test asserts on those files. The
backend comes from ``get_coordinator()``'s detection of the launcher.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

import numpy as np

from shardckpt.distributed import CoordinationError, CoordinationTimeout, get_coordinator

SHORT = 3.0  # the timeout of the steps that are meant to time out
LONG = 60.0  # the timeout of the steps that are not

OUT = sys.argv[1]
result: dict = {"steps": {}}
coord = None


def record(step, fn):
    """Run ``fn``; record its value, or its exception, with how long it took."""
    t0 = time.monotonic()
    entry: dict = {}
    try:
        entry["value"] = fn()
        entry["ok"] = True
    except Exception as e:  # recorded for the test to judge
        entry.update(ok=False, type=type(e).__name__, message=str(e),
                     missing=getattr(e, "missing", None),
                     timeout=isinstance(e, CoordinationTimeout), coordination=isinstance(e, CoordinationError))
        if not isinstance(e, CoordinationError):
            entry["traceback"] = traceback.format_exc()
    entry["elapsed"] = time.monotonic() - t0
    result["steps"][step] = entry
    flush()
    return entry


def flush():
    rank = result.get("rank", os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.getpid())))
    path = os.path.join(OUT, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def nested(r):
    return {"rank": r, "list": [r, r * 2.5, None, True, {"s": "x" * r, "u": "ünïcødé ✓"}],
            "deep": {"a": {"b": {"c": [[r], [], {}]}}}, "big": list(range(100 * r))}


# -- the user's own collectives, on the default group / COMM_WORLD ----------------------------------------------

def user_world():
    if coord.backend == "torch":
        import torch
        import torch.distributed as dist

        def allreduce(v):
            t = torch.tensor([float(v)])
            dist.all_reduce(t)  # the default group: the "training" collectives
            return float(t.item())

        default = dist.distributed_c10d._get_default_group()
        info = {"own_group_is_default": coord.group is dist.group.WORLD or coord.group is default,
                "own_group_backend": str(dist.get_backend(coord.group)),
                "own_group_ranks": dist.get_process_group_ranks(coord.group)}
        return allreduce, info
    from mpi4py import MPI

    def allreduce(v):
        send = np.array([float(v)])
        recv = np.zeros(1)
        MPI.COMM_WORLD.Allreduce(send, recv, op=MPI.SUM)
        return float(recv[0])

    cmp = MPI.Comm.Compare(coord.comm, MPI.COMM_WORLD)
    info = {"own_group_is_default": coord.comm == MPI.COMM_WORLD or cmp == MPI.IDENT,
            "compare": {MPI.IDENT: "ident", MPI.CONGRUENT: "congruent"}.get(cmp, str(cmp))}
    return allreduce, info


def main():
    global coord
    os.makedirs(OUT, exist_ok=True)
    coord = get_coordinator()
    rank, size = coord.rank, coord.size
    result.update(rank=rank, size=size, backend=coord.backend, pid=os.getpid())
    flush()

    record("barrier", lambda: coord.barrier("start", timeout=LONG))
    record("all_gather", lambda: coord.all_gather(nested(rank), timeout=LONG) == [nested(r) for r in range(size)])
    record("all_gather_scalar", lambda: coord.all_gather(rank * 10, timeout=LONG))

    def broadcasts():
        got = []
        for root in range(size):
            obj = {"root": root, "payload": [root] * (root + 1), "nested": nested(root)} if rank == root else None
            got.append(coord.broadcast(obj, root=root, timeout=LONG))
        return [g == {"root": r, "payload": [r] * (r + 1), "nested": nested(r)} for r, g in enumerate(got)]

    record("broadcast", broadcasts)

    def gathers():
        # to every root in turn: the root gets every rank's object in rank order, the others None
        got = [coord.gather(nested(rank) if rank % 2 else {"rank": rank, "to": root}, root=root, timeout=LONG)
               for root in range(size)]
        expected = [nested(r) if r % 2 else {"rank": r, "to": rank} for r in range(size)]
        return [g == expected if root == rank else g is None for root, g in enumerate(got)]

    record("gather", gathers)

    def ring():
        nbytes = 3 * 1024 * 1024 + 7
        mine = np.random.default_rng(rank).integers(0, 256, nbytes, dtype=np.uint8)
        src, dst = (rank - 1) % size, (rank + 1) % size
        expected = np.random.default_rng(src).integers(0, 256, nbytes, dtype=np.uint8)
        out = np.zeros(nbytes + 5, dtype=np.uint8)  # larger than needed: only nbytes are filled
        t0 = time.monotonic()
        # Even ranks send first, odd ranks receive first: no cycle of blocked sends.
        if rank % 2 == 0:
            coord.send_bytes(memoryview(mine), dst, tag=7)
            got = coord.recv_bytes(src, nbytes, out=memoryview(out), tag=7, timeout=LONG)
        else:
            got = coord.recv_bytes(src, nbytes, out=memoryview(out), tag=7, timeout=LONG)
            coord.send_bytes(memoryview(mine), dst, tag=7)
        # And a second message into a fresh buffer (out=None), a read-only bytes object as the source.
        small = bytes([rank]) * 1000
        if rank % 2 == 0:
            coord.send_bytes(small, dst, tag=8)
            got2 = coord.recv_bytes(src, 1000, tag=8, timeout=LONG)
        else:
            got2 = coord.recv_bytes(src, 1000, tag=8, timeout=LONG)
            coord.send_bytes(small, dst, tag=8)
        return {"len": len(got), "equal": bool(np.array_equal(np.frombuffer(got, dtype=np.uint8), expected)),
                "into_out": bool(np.array_equal(out[:nbytes], expected)),
                "small": bytes(got2) == bytes([src]) * 1000, "seconds": time.monotonic() - t0}

    record("ring", ring)

    def stream():
        # send_many / recv_many around the ring: messages of several sizes (an empty one among them),
        # each landing in order, the landed callback called once per message as it is in.
        sizes = [5 * 1024 * 1024 + 3, 0, 1, 4 * 1024 * 1024, 777, 2 * 1024 * 1024, 64, 3 * 1024 * 1024 + 1, 9]
        src, dst = (rank - 1) % size, (rank + 1) % size

        def message(sender, i, n):
            return np.random.default_rng([sender, i]).integers(0, 256, n, dtype=np.uint8)

        mine = [memoryview(message(rank, i, n)) for i, n in enumerate(sizes)]
        outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
        order = []
        complete_when_landed = []

        def landed(i):
            order.append(i)
            complete_when_landed.append(bool(np.array_equal(outs[i], message(src, i, sizes[i]))))

        if rank % 2 == 0:
            coord.send_many(mine, dst, tag=9)
            coord.recv_many(src, [memoryview(o) for o in outs], tag=9, timeout=LONG, landed=landed)
        else:
            coord.recv_many(src, [memoryview(o) for o in outs], tag=9, timeout=LONG, landed=landed)
            coord.send_many(mine, dst, tag=9)
        return {"order": order, "complete_when_landed": complete_when_landed,
                "equal": [bool(np.array_equal(o, message(src, i, n))) for i, (o, n) in enumerate(zip(outs, sizes))]}

    record("stream", stream)
    record("agree_ok", lambda: coord.agree(True, timeout=LONG))
    record("agree_fail", lambda: coord.agree(rank != 1, "" if rank != 1 else "disk full on rank one", timeout=LONG))

    allreduce, info = user_world()
    result["isolation"] = info

    def interleaved():
        # Checkpoint collectives interleaved with the user's collectives on the default group / COMM_WORLD.
        out = []
        for i in range(3):
            out.append(coord.all_gather(i + rank, timeout=LONG) == [i + r for r in range(size)])
            out.append(allreduce(rank + i) == sum(r + i for r in range(size)))
            out.append(coord.broadcast(i if rank == 0 else None, timeout=LONG) == i)
        return all(out)

    record("interleaved", interleaved)

    def concurrent():
        # The user's "training" collectives on another thread while the checkpoint's run: with one
        # shared communicator they would mismatch; on the coordinator's own one they cannot.
        user: dict = {}

        def train():
            try:
                user["ok"] = all(allreduce(rank * k) == k * sum(range(size)) for k in range(30))
            except Exception as e:  # reported below
                user["error"] = repr(e)

        t = threading.Thread(target=train)
        t.start()
        mine = all(coord.all_gather([k, rank], timeout=LONG) == [[k, r] for r in range(size)] for k in range(30))
        t.join(LONG)
        return {"checkpoint": mine, "user": user.get("ok", False), "user_error": user.get("error")}

    record("concurrent", concurrent)

    def subgroup():
        # A coordinator over a subgroup of the user's: the odd ranks.
        members = [r for r in range(size) if r % 2 == 1]
        if coord.backend == "torch":
            import torch.distributed as dist

            from shardckpt.distributed.torch_backend import TorchCoordinator

            user_group = dist.new_group(ranks=members)  # collective over every rank, as torch wants
            if rank not in members:
                return None
            sub = TorchCoordinator(group=user_group, timeout=LONG)
        else:
            from mpi4py import MPI

            from shardckpt.distributed.mpi_backend import MPICoordinator

            user_comm = MPI.COMM_WORLD.Split(rank % 2, rank)
            if rank not in members:
                user_comm.Free()
                return None
            sub = MPICoordinator(comm=user_comm, timeout=LONG)
        got = {"rank": sub.rank, "size": sub.size, "all_gather": sub.all_gather(rank, timeout=LONG)}
        sub.barrier("sub", timeout=LONG)
        peer = 1 - sub.rank
        if sub.rank == 0:
            sub.send_bytes(b"from %d" % rank, peer, tag=3)
            got["recv"] = bytes(sub.recv_bytes(peer, 6, tag=4, timeout=LONG)).decode()
        else:
            got["recv"] = bytes(sub.recv_bytes(peer, 6, tag=3, timeout=LONG)).decode()
            sub.send_bytes(b"from %d" % rank, peer, tag=4)
        sub.close()
        return got

    record("subgroup", subgroup)

    # A rank that is late: it sleeps past the others' deadline.
    late = 2 % size

    def late_barrier():
        if rank == late:
            time.sleep(SHORT + 2.0)
        coord.barrier("late", timeout=SHORT)

    record("late_barrier", late_barrier)
    record("barrier_after_timeout", lambda: coord.barrier("after", timeout=LONG))

    # Rank 0 itself is late.
    def late_root():
        if rank == 0:
            time.sleep(SHORT + 2.0)
        coord.barrier("late-root", timeout=SHORT)

    record("late_root", late_root)
    record("barrier_after_late_root", lambda: coord.barrier("after-root", timeout=LONG))
    record("all_gather_after_timeouts", lambda: coord.all_gather(rank, timeout=LONG))

    def mismatch():
        coord.barrier("odd" if rank == size - 1 else "even", timeout=LONG)

    record("barrier_name_mismatch", mismatch)

    def recv_timeout():
        # Nobody sends: the receive times out naming its source; the coordinator stays usable (MPI).
        if rank == 0:
            coord.recv_bytes(1, 10, tag=99, timeout=1.0)

    def stream_timeout_before():
        # Nobody sends: the stream times out naming its source; nothing arrived, the coordinator stays usable.
        if rank == 0:
            coord.recv_many(1, [memoryview(bytearray(10)) for _ in range(6)], tag=97, timeout=1.0)

    if coord.backend == "mpi":
        record("recv_timeout", recv_timeout)
        record("stream_timeout_before", stream_timeout_before)
    record("final_barrier", lambda: coord.barrier("final", timeout=LONG))

    # A collective that times out (on a second coordinator: it is unusable afterwards).
    if coord.backend == "torch":
        from shardckpt.distributed.torch_backend import TorchCoordinator as Backend
    else:
        from shardckpt.distributed.mpi_backend import MPICoordinator as Backend
    second = Backend(timeout=LONG)

    def gather_timeout():
        if rank == late:
            time.sleep(1.0 + 0.5)
        second.all_gather(rank, timeout=1.0)

    record("all_gather_timeout", gather_timeout)
    record("after_gather_timeout", lambda: second.broadcast(1, timeout=LONG))
    record("first_still_usable", lambda: coord.barrier("still", timeout=LONG))
    record("close_failed", second.close)

    if coord.backend == "mpi":
        # A stream that stops midway (rank 1 sends 2 of the 4 messages rank 0 waits for): the receive times
        # out naming rank 1, and since part of it had arrived, that coordinator is unusable afterwards.
        third = Backend(timeout=LONG)

        def stream_stops():
            if rank == 1:
                third.send_many([memoryview(bytes([i]) * 10) for i in range(2)], 0, tag=96)
            elif rank == 0:
                third.recv_many(1, [memoryview(bytearray(10)) for _ in range(4)], tag=96, timeout=1.0)

        record("stream_stops", stream_stops)
        if rank == 0:
            record("after_stream_stops", lambda: third.barrier("after", timeout=LONG))
        third.close()

    if coord.backend == "torch":
        # A rank that is gone for good: the others' barrier names it. (Under mpiexec a process that exits
        # early ends the whole job, so only torch.)
        gone = size - 1
        if rank == gone:
            result["done"] = True
            flush()
            os._exit(0)
        record("exited_rank", lambda: coord.barrier("gone", timeout=SHORT))
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
