"""No leaks across many saves and restores in one process (issue 16, "no leaks").

200 ``CheckpointManager`` saves (retention ``max_to_keep=2``), synchronous and asynchronous,
each followed by a restore of the latest checkpoint, in one process: after a warm-up (pools
and buffers are made once and reused), open file descriptors and threads (Python's and the
kernel's count of the process's tasks) do not grow at all, resident memory grows less than
16 MiB, and the folder holds only the kept checkpoints and the state file.
"""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Tuple

import numpy as np
import pytest

import shardckpt

SAVES = 200
WARMUP = 20
RSS_SLACK = 16 << 20


def _counts() -> Tuple[int, int, int, int]:
    """(open fds, Python threads, kernel tasks, resident bytes) of this process."""
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    tasks = len(os.listdir("/proc/self/task"))
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return fds, threading.active_count(), tasks, rss


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_many_saves_and_restores_leak_no_fds_threads_or_memory(tmp_path: Path, mode: str) -> None:
    model = shardckpt.Module()
    model.w = shardckpt.Variable(np.zeros((64, 256), np.float32))
    model.b = shardckpt.Variable(np.zeros(256, np.float64))
    model.names = shardckpt.Variable(np.array([b"a", b"bc"], dtype=object))
    ckpt = shardckpt.Checkpoint(model=model)
    manager = shardckpt.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    options = shardckpt.CheckpointOptions(enable_async=mode == "async",
                                          sharding_callback=shardckpt.MaxShardSizePolicy(24 << 10))
    reader = shardckpt.Checkpoint(model=(back := shardckpt.Module()))
    back.w = shardckpt.Variable(np.zeros((64, 256), np.float32))
    back.b = shardckpt.Variable(np.zeros(256, np.float64))
    back.names = shardckpt.Variable(np.array([b"", b""], dtype=object))
    before = None
    for i in range(1, SAVES + 1):
        model.w.assign(np.full((64, 256), i, np.float32))
        model.b.assign(np.arange(256, dtype=np.float64) + i)
        manager.save(options=options)
        if i % 10 == 0 or i == WARMUP:
            manager.sync()
            reader.restore(manager.latest_checkpoint).assert_consumed()
            assert float(back.w.numpy()[0, 0]) == i and float(back.b.numpy()[1]) == i + 1
            with shardckpt.load_checkpoint(manager.latest_checkpoint) as r:
                r.get_tensor("model/w/.ATTRIBUTES/VARIABLE_VALUE")
        if i == WARMUP:
            before = _counts()
    manager.sync()
    after = _counts()
    assert before is not None
    fds, threads, tasks, rss = (a - b for a, b in zip(after, before))
    print(f"\n{mode}: after {SAVES - WARMUP} more saves: fds {fds:+d}, threads {threads:+d}, tasks {tasks:+d}, "
          f"rss {rss / 2**20:+.1f} MiB")
    assert fds <= 0, f"{fds} file descriptors leaked over {SAVES - WARMUP} saves"
    assert threads <= 0 and tasks <= 0, f"threads grew by {threads} (kernel tasks by {tasks})"
    assert rss < RSS_SLACK, f"resident memory grew by {rss / 2**20:.1f} MiB over {SAVES - WARMUP} saves"
    names = sorted(p.name for p in tmp_path.iterdir())
    kept = (f"ckpt-{SAVES - 1}.", f"ckpt-{SAVES}.")
    assert names[0] == "checkpoint" and all(n.startswith(kept) for n in names[1:]), names
