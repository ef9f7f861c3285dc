"""One run of the kill soak (tests/helpers/soak.py): resume from the latest checkpoint, check it, save on.

    python soak_worker.py DIR MODE SAVES          (one process: CheckpointManager over Checkpoint; DIR may be
                                                   an s3:// folder, SHARDCKPT_SOAK_STALE_AFTER its stale_after)
    torchrun ... soak_worker.py DIR MODE SAVES    (several clients: CheckpointManager over DTensorCheckpoint)
    mpiexec  ... soak_worker.py DIR MODE SAVES

``MODE`` is ``sync``, ``async`` (``CheckpointOptions(enable_async=True)``) or, under a
launcher, ``disagree``: sync saves, where the save of every generation divisible by 3 is
first tried with the last client holding ``w0`` in another global shape; that save must
fail on every client (``REFUSED <G>``; one that returns is a ``MISMATCH``) and the same
generation is then saved by clients that agree; or ``skip``: sync saves numbered by generation
(``manager.save(checkpoint_number=G)``, as a training loop numbers them by step), where the last
client skips the save of every generation divisible by 3 and goes on to the next one
(``ckpt-<G+1>`` with generation ``G+1``'s values) while the others save ``ckpt-<G>``: both saves
must fail on every client (``REFUSED <G>``), nothing is committed, and then everyone saves
``G+1`` together (the skipping client for the second time). So a generation divisible by 3 is
never committed, and ``save_counter`` counts only the others (:func:`save_counter_of`). The run builds
a model, restores ``latest_checkpoint(DIR)`` through ``CheckpointManager.restore_or_initialize``
and checks every restored value against :func:`values` of the restored generation (the
checkpoint number ``N`` of ``DIR/ckpt-N`` holds generation ``N``; ``save_counter`` is ``N``).
It then saves generations ``N+1 .. N+SAVES`` with ``max_to_keep=2``. Lines on stdout, from
the io client (rank 0) only, that the driver reads::

    PID <rank> <pid>          every client, first (the driver may SIGKILL one of them)
    RESTORED <N>              resumed from ckpt-N, every value checked (0: nothing to resume)
    MISMATCH <message>        a restored value differs (exit status 3)
    READY                     about to save
    REFUSED <G>               the disagreeing save of generation G failed, as it must
    COMMITTED <G>             ckpt-G is committed and named by the state file (async: the
                              next save's call or the final sync waited for it)
    LOCAL <G>                 tiered: the save of G returned, committed in the tiers only

``tiered`` (under a launcher): sync saves through ``CheckpointManager(local=LocalTier(DIR.tier/{node},
replicas=1, keep=2), persist_every=3)``, the clients as two simulated nodes (``SHARDCKPT_NODE``:
the first half of the ranks on node 0); the resume restores the newest step complete across the
tiers (or the persistent one), and its values are checked as any other's.

The values depend on the generation in every element, so a mix of generations, a stale
region or a torn file shows as a mismatch.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import numpy as np

ROWS = 1024  # rows of each float32 variable (sharded over the clients under a launcher)
COLS = 1024
NUM_FLOAT = 4  # 4 x 4 MiB float32 variables
CLIENT_ROWS_ALIGN = 8
TIMEOUT = 30.0  # coordination timeout of a multi-client save (the driver waits longer)


PERSIST_EVERY = 3  # tiered: every third save also persistent


def tier_folder(directory: str) -> str:
    """tiered: the simulated nodes' tier folders, beside the persistent ``directory``."""
    return directory.rstrip("/") + ".tier/{node}"


def node_of(rank: int, size: int) -> int:
    """tiered: the simulated node of client ``rank`` of ``size`` (two nodes: the first half on node 0)."""
    return rank * 2 // size


def _launcher_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def _launcher_size() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))


def values(generation: int) -> Dict[str, np.ndarray]:
    """Generation ``generation``'s values: every element depends on it (float32 exact below 2048)."""
    out: Dict[str, np.ndarray] = {}
    base = (np.arange(ROWS * COLS, dtype=np.int64) % 4093).astype(np.float32) / 4096
    for i in range(NUM_FLOAT):
        out[f"w{i}"] = (base + np.float32(generation % 2048) + np.float32(i * 0.25)).reshape(ROWS, COLS)
    out["ids"] = (np.int64(generation) << 32) | np.arange(4096, dtype=np.int64)
    out["step"] = np.array(generation, np.int64)
    out["names"] = np.array([f"gen-{generation}-{j}".encode() for j in range(7)], dtype=object)
    return out


def save_counter_of(generation: int, mode: str) -> int:
    """``save_counter`` of ``ckpt-<generation>`` (``skip``: the skipped generations used no number)."""
    return generation - generation // 3 if mode == "skip" else generation


def skipped(generation: int, mode: str) -> bool:
    """Whether ``mode`` never commits ``generation`` (a client skipped its save)."""
    return mode == "skip" and generation % 3 == 0


def checkpoint_key(name: str) -> str:
    """The key of variable ``name`` in the checkpoint (object graph: ``model/<name>``)."""
    return f"model/{name}/.ATTRIBUTES/VARIABLE_VALUE"


def _line(line: str) -> None:
    """One line to the driver in one write: clients share the launcher's pipe, and a ``print``
    writes its text and its newline separately, so two clients' lines could run together."""
    os.write(1, (line + "\n").encode())


def _say(rank: int, line: str) -> None:
    if rank == 0:
        _line(line)


def main(argv: list) -> int:
    directory, mode, saves = argv[0], argv[1], int(argv[2])
    import shardckpt

    if os.environ.get("SHARDCKPT_SOAK_STALE_AFTER"):  # an object store (the endpoint comes from AWS_ENDPOINT_URL)
        shardckpt.storage.configure(directory.split("://", 1)[0],
                                    stale_after=float(os.environ["SHARDCKPT_SOAK_STALE_AFTER"]))

    multi = any(v in os.environ for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))
    if mode == "tiered":  # the clients as two simulated nodes: the first half on node 0
        os.environ["SHARDCKPT_NODE"] = str(node_of(_launcher_rank(), _launcher_size()))
    options = shardckpt.CheckpointOptions(enable_async=mode == "async", timeout=TIMEOUT if multi else None)
    model = shardckpt.Module()
    start = values(0)
    if multi:
        from shardckpt import dtensor as dt
        from shardckpt.distributed import get_coordinator

        coordinator = get_coordinator()
        rank, size = coordinator.rank, coordinator.size
        _line(f"PID {rank} {os.getpid()}")
        mesh = dt.create_distributed_mesh([("x", size)])
        sharded = dt.Layout(["x", dt.UNSHARDED], mesh)
        for name, value in start.items():
            if name.startswith("w"):
                setattr(model, name, dt.DVariable.from_global(value, sharded, name=name))
            else:
                setattr(model, name, shardckpt.Variable(value, name=name))
        ckpt: Any = dt.DTensorCheckpoint(mesh, model=model)

        def current(name: str) -> np.ndarray:
            var = getattr(model, name)
            return dt.to_global(var, coordinator) if name.startswith("w") else var.numpy()

        def set_values(v: Dict[str, np.ndarray]) -> None:
            for name, value in v.items():
                var = getattr(model, name)
                var.assign(dt.from_global(value, var.layout) if name.startswith("w") else value)
    else:
        rank, size = 0, 1
        _line(f"PID 0 {os.getpid()}")
        for name, value in start.items():
            setattr(model, name, shardckpt.Variable(value, name=name))
        ckpt = shardckpt.Checkpoint(model=model)

        def current(name: str) -> np.ndarray:
            return getattr(model, name).numpy()

        def set_values(v: Dict[str, np.ndarray]) -> None:
            for name, value in v.items():
                getattr(model, name).assign(value)

    if mode == "tiered":
        manager = shardckpt.CheckpointManager(ckpt, directory, max_to_keep=2, local=shardckpt.LocalTier(
            tier_folder(directory), replicas=1, keep=2), persist_every=PERSIST_EVERY)
    else:
        manager = shardckpt.CheckpointManager(ckpt, directory, max_to_keep=2)
    restored = manager.restore_or_initialize()
    generation = 0
    if restored is not None:
        generation = int(restored.rsplit("-", 1)[1])
        want = values(generation)
        for name, value in want.items():
            got = current(name)
            same = ([bytes(x) for x in got.ravel()] == [bytes(x) for x in value.ravel()] if value.dtype == object
                    else got.dtype == value.dtype and np.array_equal(got, value))
            if not same:
                _line(f"MISMATCH rank {rank}: {name} of {restored} is not generation {generation}")
                return 3
        if int(np.asarray(ckpt.save_counter.numpy())) != save_counter_of(generation, mode):
            _line(f"MISMATCH rank {rank}: save_counter {ckpt.save_counter.numpy()} in {restored}")
            return 3
    _say(rank, f"RESTORED {generation}")
    _say(rank, "READY")
    pending = None
    for g in range(generation + 1, generation + 1 + saves):
        set_values(values(g))  # in place (async: the save copied the previous values already)
        if mode == "disagree" and multi and g % 3 == 0:
            if not _refused(model, manager, options, rank, size, g):
                return 3
        if multi and skipped(g, mode):
            if not _skip_refused(manager, options, rank, size, g, set_values):
                return 3
            continue
        path = manager.save(checkpoint_number=g if mode == "skip" else None, options=options)
        assert path is not None and path.endswith(f"-{g}"), (path, g)
        if pending is not None:  # this save's call waited for the previous background save
            _say(rank, f"COMMITTED {pending}")
        if mode == "async":
            pending = g
        elif mode == "tiered" and g % PERSIST_EVERY:
            _say(rank, f"LOCAL {g}")
        else:
            _say(rank, f"COMMITTED {g}")
    manager.sync()
    if pending is not None:
        _say(rank, f"COMMITTED {pending}")
    return 0


def _refused(model: Any, manager: Any, options: Any, rank: int, size: int, g: int) -> bool:
    """Try generation ``g`` with the last client's ``w0`` in another shape: every client must fail."""
    from shardckpt import dtensor as dt
    from shardckpt.errors import ShardckptError

    original = model.w0
    if rank == size - 1:
        other = np.zeros((ROWS + size, COLS), np.float32)
        model.w0 = dt.DVariable.from_global(other, original.layout, name="w0")
    try:
        manager.save(options=options)
    except ShardckptError as exc:
        if "not committed" not in str(exc):
            _line(f"MISMATCH rank {rank}: the disagreeing save of {g} failed unclearly: {exc}")
            return False
        _say(rank, f"REFUSED {g}")
        return True
    finally:
        model.w0 = original
    _line(f"MISMATCH rank {rank}: the disagreeing save of generation {g} returned")
    return False


def _skip_refused(manager: Any, options: Any, rank: int, size: int, g: int, set_values: Any) -> bool:
    """Generation ``g``: the last client skips it and saves ``g + 1``; both saves must fail on every client."""
    from shardckpt.errors import ShardckptError

    skipper = rank == size - 1
    number = g + 1 if skipper else g
    if skipper:
        set_values(values(g + 1))
    try:
        manager.save(checkpoint_number=number, options=options)
    except ShardckptError as exc:
        if "which save" not in str(exc) and "not committed" not in str(exc):
            _line(f"MISMATCH rank {rank}: the save of {g} a client skipped failed unclearly: {exc}")
            return False
        _say(rank, f"REFUSED {g}")
        return True
    _line(f"MISMATCH rank {rank}: the save of generation {g} that client {size - 1} skipped returned "
          f"(ckpt-{number})")
    return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
