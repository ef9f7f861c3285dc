"""A process that saved (its checksum, write-behind and reader pools started) forks; the child saves and
restores on its own: none of the parent's threads exist in the child, so work handed to the parent's
pools would wait forever (a hang, seen with the checksum pool).

The scenario runs in a spawned interpreter (``helpers.forking``), where nothing but shardckpt has
started threads, so the fork is the one under test and not one racing another library's threads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers.forking import fork_and_check

import shardckpt


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # large enough that entries are split into units checksummed on helper threads
    return {f"t{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(4)}


def _parent_saves_and_restores(folder: str) -> None:
    parent = _state(0)
    shardckpt.save_tensors(folder + "/parent", parent)
    with shardckpt.load_checkpoint(folder + "/parent") as reader:
        assert np.array_equal(reader.get_tensor("t1"), parent["t1"])


def _child_saves_and_restores(folder: str) -> int:
    child = _state(1)
    shardckpt.save_tensors(folder + "/child", child)
    with shardckpt.load_checkpoint(folder + "/child") as reader:
        return 0 if all(np.array_equal(reader.get_tensor(k), v) for k, v in child.items()) else 2


def test_a_forked_child_saves_and_restores_after_its_parent_did(tmp_path: Path) -> None:
    code = fork_and_check(_parent_saves_and_restores, _child_saves_and_restores, str(tmp_path))
    assert code != 124, "the forked child's save hung (it waited on its parent's threads)"
    assert code == 0
