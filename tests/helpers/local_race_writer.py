"""A writer process of tests/test_local_racing_writers.py: saves racing another writer on a local disk.

    python local_race_writer.py prefix  PREFIX WRITER COUNT [SLOW_SECONDS]
    python local_race_writer.py manager DIR    WRITER COUNT [SLOW_SECONDS [DIE_AFTER_STATE]]

``prefix``: ``COUNT`` saves of :func:`values` ``(WRITER, g)``, ``g = 1..COUNT``, with
``shardckpt.save_tensors`` to ``PREFIX`` (several shards, a shard count that changes with
``g``). ``manager``: ``COUNT`` saves through ``CheckpointManager(DIR, max_to_keep=2)`` of a
``Checkpoint`` holding the same values (checkpoint ``ckpt-g`` holds generation ``g``).
With ``SLOW_SECONDS`` every write into a save's temporary folder first sleeps that long
(a long-running live save). With ``DIE_AFTER_STATE`` = ``k`` the process SIGKILLs itself
right after its ``k``-th write of the ``checkpoint`` state file (before the manager deletes
what retention dropped). Prints ``READY`` once started, ``SAVED <WRITER> <g>`` after
each save returns, ``FAILED <WRITER> <g> <Type>: <message>`` for a save that raised a
``shardckpt.errors`` error (the run goes on), and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Dict

import numpy as np

MAX_SHARD = 256 << 10


def values(writer: int, generation: int) -> Dict[str, np.ndarray]:
    """Every element depends on (writer, generation); the sizes (so the shard count) on the generation."""
    n = (96 + 40 * (generation % 4)) << 10  # 96-216 Ki float32: 2-4 shards of 256 KiB per tensor
    tag = np.float32(writer * 4096 + generation)
    return {"tag": np.array([writer, generation], np.int64),
            "a": np.arange(n, dtype=np.float32) % 1024 + tag,
            "b": (np.arange(n // 2, dtype=np.int64) << 20) + writer * 1000 + generation,
            "names": np.array([f"w{writer}-g{generation}-{i}".encode() for i in range(5)], dtype=object)}


def main(argv: list) -> int:
    kind, where, writer, count = argv[0], argv[1], int(argv[2]), int(argv[3])
    slow = float(argv[4]) if len(argv) > 4 else 0.0
    die_after_state = int(argv[5]) if len(argv) > 5 else 0
    import shardckpt
    from shardckpt.errors import ShardckptError

    if slow or die_after_state:
        from shardckpt.storage.local import local_fs
        from shardckpt.storage.registry import mounted
        from shardckpt.storage.wrappers import FileSystemWrapper

        class Slow(FileSystemWrapper):
            def write_all(self, handle, buf, path: str = "") -> None:  # type: ignore[no-untyped-def]
                if "_temp_" in path:
                    time.sleep(slow)
                self.inner.write_all(handle, buf, path)

            def write_atomic(self, path: str, data: bytes, *, fsync: bool = False) -> None:
                self.inner.write_atomic(path, data, fsync=fsync)
                if os.path.basename(path) == "checkpoint":
                    state_writes.append(path)
                    if len(state_writes) == die_after_state:
                        os.kill(os.getpid(), signal.SIGKILL)

        state_writes: list = []
        mount = mounted(Slow(local_fs))
        mount.__enter__()  # for the life of the process
    options = shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(MAX_SHARD))
    manager = None
    model = shardckpt.Module()
    if kind == "manager":
        for name, value in values(writer, 0).items():
            setattr(model, name, shardckpt.Variable(value, name=name))
        manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), where, max_to_keep=2)
    print("READY", flush=True)
    for g in range(1, count + 1):
        try:
            if manager is None:
                shardckpt.save_tensors(where, values(writer, g), options)
            else:
                for name, value in values(writer, g).items():
                    setattr(model, name, shardckpt.Variable(value, name=name))  # shapes change with g
                manager.save(checkpoint_number=g, options=options)
            print(f"SAVED {writer} {g}", flush=True)
        except ShardckptError as exc:
            print(f"FAILED {writer} {g} {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
