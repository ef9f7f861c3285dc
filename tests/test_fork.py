"""A process that saved (its checksum, write-behind and reader pools started) forks; the child saves and
restores on its own: none of the parent's threads exist in the child, so work handed to the parent's
pools would wait forever (a hang, seen with the checksum pool)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

import shardckpt


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # large enough that entries are split into units checksummed on helper threads
    return {f"t{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(4)}


def test_a_forked_child_saves_and_restores_after_its_parent_did(tmp_path: Path) -> None:
    parent = _state(0)
    shardckpt.save_tensors(str(tmp_path / "parent"), parent)
    with shardckpt.load_checkpoint(str(tmp_path / "parent")) as reader:
        assert np.array_equal(reader.get_tensor("t1"), parent["t1"])
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its own save and restore are exact
        code = 1
        try:
            child = _state(1)
            shardckpt.save_tensors(str(tmp_path / "child"), child)
            with shardckpt.load_checkpoint(str(tmp_path / "child")) as reader:
                code = 0 if all(np.array_equal(reader.get_tensor(k), v) for k, v in child.items()) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child's save hung (it waited on its parent's threads)")
